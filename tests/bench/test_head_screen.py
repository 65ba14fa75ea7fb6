"""bench/head_screen.py end to end on the tiny engine model: the head alone at a few row counts and
the engine with the screen on and off, tokens checked equal, figures in the JSON and the table."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.bench.bench_scripts import load_bench
from tests.runtime.engine.conftest import engine_llama_dir  # noqa: F401 - the fixture


def _needs_screen():
    from lowbit.kernels import screened_head

    if screened_head.build(torch.zeros(16, 32), False) is None:
        pytest.skip("no AVX512-VNNI here")


def test_head_alone_and_engine_pairs(engine_llama_dir, tmp_path, monkeypatch, capsys):
    _needs_screen()
    module = load_bench("head_screen")
    out = tmp_path / "r.json"
    monkeypatch.setattr(module, "results_file", lambda stem: out)
    monkeypatch.setattr(sys, "argv", ["head_screen.py", "--model", str(engine_llama_dir), "--rows", "1,3",
                                      "--batches", "1,2", "--rounds", "1", "--positions", "12", "--gen-tokens", "4",
                                      "--threads", "1"])
    assert module.main() == 0
    result = json.loads(out.read_text())
    assert [a["rows"] for a in result["head_alone"]] == [1, 3]
    assert all(a["whole_ms"] > 0 and a["screened_ms"] > 0 and a["windows"] >= 1 for a in result["head_alone"])
    assert [p["batch"] for p in result["engine"]] == [1, 2]
    assert all(p["screen_tok_s"] > 0 and p["whole_tok_s"] > 0 and len(p["pairs"]) == 1 for p in result["engine"])
    printed = capsys.readouterr().out
    assert "| rows | whole head ms | screened ms | screened ÷ whole |" in printed and "| sequences |" in printed


def test_a_screen_that_changes_a_token_ends_the_script(engine_llama_dir, tmp_path, monkeypatch):
    _needs_screen()
    module = load_bench("head_screen")
    from lowbit.kernels import screened_head

    real = screened_head.argmax
    monkeypatch.setattr(screened_head, "argmax", lambda s, head, x: real(s, head, x) + 1)
    monkeypatch.setattr(module, "results_file", lambda stem: tmp_path / "r.json")
    monkeypatch.setattr(sys, "argv", ["head_screen.py", "--model", str(engine_llama_dir), "--rows", "2", "--batches", "",
                                      "--rounds", "1", "--positions", "8", "--threads", "1"])
    with pytest.raises(SystemExit, match="differ from the whole head's"):
        module.main()


def test_bad_arguments_are_refused(monkeypatch):
    module = load_bench("head_screen")
    monkeypatch.setattr(sys, "argv", ["head_screen.py", "--rows", "0"])
    with pytest.raises(SystemExit, match="must be positive"):
        module.main()


def test_model_label():
    module = load_bench("head_screen")
    assert module.model_label("smollm2-135m") == "smollm2-135m"
    assert module.model_label("org/name") == "org-name"
