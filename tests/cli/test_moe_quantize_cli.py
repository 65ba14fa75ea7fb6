"""Calibrated quantization of mixture-of-experts models (#26): every expert gets statistics, even
one the text never routes a token to, and GPTQ and AWQ beat RTN on the tiny random MoEs."""

from __future__ import annotations

import json

import pytest

from lowbit.compress.stats import StatsFile
from tests.runtime.moe_models import save_moe

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_gptq_and_awq_beat_rtn_on_a_tiny_moe(case, tmp_path, run_cli):
    src, _ = save_moe(case, tmp_path / case)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 20)
    kld = {}
    calib = ["--data", str(text), "--samples", "4", "--seqlen", "64"]
    for method, extra in (("rtn", []), ("gptq", calib), ("awq", calib)):
        out = tmp_path / method
        code, stdout, err = run_cli(["quantize", str(src), "--format", "int3", "-g", "32", "--method", method, *extra,
                                     "-o", str(out), "--json"])
        # was: "lacks weight model.layers.0.mlp.gate.weight" (Mixtral's hub names); AWQ: "'SparseMoE'
        # object has no attribute 'up_proj'"
        assert code == 0, err
        code, stdout, err = run_cli(["eval", str(out), "--data", str(text), "--ctx", "64", "--chunks", "2",
                                     "--base", str(src), "--json"])
        assert code == 0, err
        kld[method] = json.loads(stdout)["kld"]["mean"]
    assert 0 < kld["gptq"] < kld["rtn"] and 0 < kld["awq"] < kld["rtn"], kld


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


def test_routed_experts_only_falls_back_to_rtn_for_unrouted(tmp_path, run_cli):
    """--routed-experts: each expert's statistics from the tokens the router sends it; an expert
    that gets none has no statistics and is quantized with RTN, named in a note, never with NaN scales."""
    import torch

    from lowbit.formats.native import NativeReader

    src, _ = save_moe("mixtral", tmp_path / "m", num_local_experts=8, num_experts_per_tok=1)
    text = tmp_path / "text.txt"
    text.write_text("ab" * 200)
    window = ["--data", str(text), "--samples", "2", "--seqlen", "16"]
    stats = tmp_path / "stats.st"
    code, _, err = run_cli(["calibrate", str(src), *window, "--routed-experts", "-o", str(stats)])
    assert code == 0, err
    sites = StatsFile(stats)
    assert sites.header["calibration"]["all_experts"] is False

    runs = {}
    for name, extra in (("routed", [*window, "--routed-experts"]), ("from-stats", ["--calib", str(stats)]), ("rtn", [])):
        method = "rtn" if name == "rtn" else "gptq"
        code, out, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "--method", method, *extra,
                                  "-o", str(tmp_path / name), "--json"])
        assert code == 0, err
        runs[name] = json.loads(out)
    tokens = runs["routed"]["expert_tokens"]
    assert tokens == runs["from-stats"]["expert_tokens"]
    # no expert of these runs took statistics from every token (the default's note)
    assert not any("every token" in n for run in ("routed", "from-stats") for n in runs[run]["notes"])
    rtn = NativeReader(tmp_path / "rtn")
    for layer in (0, 1):
        counts = tokens[f"model.layers.{layer}.mlp"]
        idle = [e for e, c in enumerate(counts) if c == 0]
        fed = [e for e, c in enumerate(counts) if c > 0]
        assert idle and fed  # the 2-token text leaves experts unrouted
        for e in idle:
            with pytest.raises(Exception, match="no statistics"):
                sites.site_of(f"model.layers.{layer}.mlp.experts.{e}.gate_proj")
        for e in fed:
            assert sites.site(sites.site_of(f"model.layers.{layer}.mlp.experts.{e}.gate_proj")).tokens > 0
        note = next(n for n in runs["routed"]["notes"] if n.startswith(f"model.layers.{layer}.mlp:"))
        assert "RTN" in note and note.endswith("quantized with RTN")
        assert f"expert{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} " in note
        for run in ("routed", "from-stats"):
            reader = NativeReader(tmp_path / run)
            for e in idle:  # RTN's own codes and scales
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                    assert torch.equal(reader.quantized(module).dequantize(), rtn.quantized(module).dequantize()), module
            for e in fed:  # GPTQ's
                module = f"model.layers.{layer}.mlp.experts.{e}.down_proj"
                assert not torch.equal(reader.quantized(module).dequantize(), rtn.quantized(module).dequantize()), module


def test_routed_experts_goes_with_data(tmp_path, run_cli):
    src, _ = save_moe("mixtral", tmp_path / "m")
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "--routed-experts", "-o", str(tmp_path / "o")])
    assert code == 2 and "--routed-experts goes with --data" in err and err.count("\n") == 1
    (tmp_path / "s.st").write_text("")
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "--method", "gptq", "--calib", str(tmp_path / "s.st"),
                            "--routed-experts", "-o", str(tmp_path / "o")])
    assert code == 2 and "--routed-experts goes with --data" in err and err.count("\n") == 1
