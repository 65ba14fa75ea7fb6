"""bench/self_speculation.py end to end on the tiny engine model: plain and speculative engines
take turns, outputs are checked identical, and the figures land in the JSON and the table."""

from __future__ import annotations

import json
import sys

from tests.bench.bench_scripts import load_bench
from tests.runtime.engine.conftest import engine_llama_dir  # noqa: F401 - the fixture


def test_a_round_of_plain_and_self_speculation(engine_llama_dir, tmp_path, monkeypatch, capsys):
    module = load_bench("self_speculation")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["self_speculation.py", "--model", str(engine_llama_dir), "--prompts", "2",
                                      "--gen-tokens", "6", "--rounds", "1", "--k", "2", "--threads", "1",
                                      "--drafts", "self:int8", "--json", str(out)])
    module.main()
    result = json.loads(out.read_text())
    plain, spec = result["rows"]
    assert plain["setting"] == "plain" and plain["speedup"] == 1.0 and plain["draft_share"] == 0.0
    assert spec["setting"] == "self:int8 k=2" and spec["speedup"] > 0 and 0 < spec["draft_share"] < 1
    assert 1.0 <= spec["mean_accepted_length"] <= 3.0
    printed = capsys.readouterr().out
    assert "| setting | tok/s | speedup (rounds) |" in printed and "| self:int8 k=2 |" in printed


def test_a_draft_that_changes_the_output_is_refused(engine_llama_dir, tmp_path, monkeypatch):
    import pytest

    module = load_bench("self_speculation")
    from lowbit.runtime.engine.engine import Engine

    real = Engine.generate

    def wrong(self, prompts, params=None):  # the speculative engine emits one token off
        outs = real(self, prompts, params)
        if self.drafter is not None:
            outs[0].token_ids = [t + 1 for t in outs[0].token_ids]
        return outs

    monkeypatch.setattr(Engine, "generate", wrong)
    monkeypatch.setattr(sys, "argv", ["self_speculation.py", "--model", str(engine_llama_dir), "--prompts", "1",
                                      "--gen-tokens", "4", "--rounds", "1", "--k", "2", "--threads", "1",
                                      "--drafts", "self:int8", "--json", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="self:int8 k=2: output differs from plain greedy decoding"):
        module.main()
