"""Calibrated quantization of mixture-of-experts models (#26): every expert gets statistics, even
one the text never routes a token to, and GPTQ beats RTN on the tiny random MoEs."""

from __future__ import annotations

import json

import pytest

from lowbit.compress.stats import StatsFile
from tests.runtime.moe_models import save_moe

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_gptq_beats_rtn_on_a_tiny_moe(case, tmp_path, run_cli):
    src, _ = save_moe(case, tmp_path / case)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 20)
    kld = {}
    for method, extra in (("rtn", []), ("gptq", ["--data", str(text), "--samples", "4", "--seqlen", "64"])):
        out = tmp_path / method
        code, stdout, err = run_cli(["quantize", str(src), "--format", "int3", "-g", "32", "--method", method, *extra,
                                     "-o", str(out), "--json"])
        assert code == 0, err  # was: "lacks weight model.layers.0.mlp.gate.weight" (Mixtral's hub names)
        code, stdout, err = run_cli(["eval", str(out), "--data", str(text), "--ctx", "64", "--chunks", "2",
                                     "--base", str(src), "--json"])
        assert code == 0, err
        kld[method] = json.loads(stdout)["kld"]["mean"]
    assert 0 < kld["gptq"] < kld["rtn"], kld


def test_every_expert_gets_statistics_even_unrouted(tmp_path, run_cli):
    # 8 experts, top-1, a 2-token text: most experts receive no token in the routed forward
    src, _ = save_moe("mixtral", tmp_path / "m", num_local_experts=8, num_experts_per_tok=1)
    text = tmp_path / "text.txt"
    text.write_text("ab" * 200)
    stats = tmp_path / "stats.st"
    code, _, err = run_cli(["calibrate", str(src), "--data", str(text), "--samples", "2", "--seqlen", "16",
                            "-o", str(stats)])
    assert code == 0, err
    sites = StatsFile(stats)
    routed = set()
    for expert in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):  # lowbit's per-expert names, from Mixtral's w1/w3/w2
            site = sites.site_of(f"model.layers.0.mlp.experts.{expert}.{proj}")
            assert sites.site(site).hessian.abs().sum() > 0, (expert, proj)
        routed.add(sites.site_of(f"model.layers.0.mlp.experts.{expert}.down_proj"))
    assert len(routed) == 8  # each expert's own down_proj input: every expert ran on the tokens
