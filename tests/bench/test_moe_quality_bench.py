"""bench/moe_quality.py: its coverage column and its refusal of an unknown model (the measuring runs
`lowbit quantize` and `lowbit eval`, tested elsewhere; the script takes minutes)."""

from __future__ import annotations

import sys

import pytest

from tests.bench.bench_scripts import load_bench


def test_coverage_column():
    mq = load_bench("moe_quality")
    row = {"expert_tokens": {"model.layers.0.mlp": [0, 5, 9], "model.layers.1.mlp": [3, 0, 7]}}
    assert mq.coverage(row) == "0 / 5 / 9; 2 got none"
    assert mq.coverage({}) == "–"
    assert [label for label, _ in mq.METHODS] == ["rtn", "gptq", "gptq-routed", "rtn-asym", "awq"]


def test_unknown_model_is_refused(monkeypatch):
    mq = load_bench("moe_quality")
    monkeypatch.setattr(sys, "argv", ["moe_quality.py", "--models", "split,mixtrel"])
    with pytest.raises(SystemExit, match="unknown model.*mixtrel"):
        mq.main()
