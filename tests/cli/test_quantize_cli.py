"""`lowbit quantize` end to end: JSON summary, eval of the result, one-line errors leaving nothing behind;
and the demo: SmolLM2 to int4 g64, perplexity within a sane band of bf16."""

from __future__ import annotations

import json

import pytest


TEXT = "The quick brown fox jumps over the lazy dog; sphinx of black quartz, judge my vow. " * 12


def test_quantize_json_and_eval_the_result(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    out = tmp_path / "q"
    code, stdout, _ = run_cli(["quantize", str(src), "--format", "int4", "--group-size", "32", "-o", str(out), "--json"])
    assert code == 0
    summary = json.loads(stdout)
    assert summary["formats"] == {"int4-g32": 14} and summary["method"] == "rtn"
    assert summary["linear_bits_per_weight"] == pytest.approx(4.5)  # 4 bits + an fp16 scale per 32
    assert summary["bytes_after"] < summary["bytes_before"] and summary["seconds"] > 0
    assert len(summary["modules"]) == 14

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code, stdout, _ = run_cli(["eval", str(out), "--data", str(text), "--ctx", "64", "--base", str(src), "--json"])
    assert code == 0
    result = json.loads(stdout)
    assert result["kld"]["mean"] > 0 and result["ppl"] > 1


def test_human_summary_and_recipe_with_skip(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    recipe = tmp_path / "mixed.json"
    recipe.write_text(json.dumps({"rules": [{"pattern": "*.down_proj", "format": "int8"}]}))
    code, _, err = run_cli(["quantize", str(src), "--recipe", str(recipe), "--format", "nvfp4", "--skip", "*.o_proj",
                            "-o", str(tmp_path / "q")])
    assert code == 0
    assert "int8 ×2" in err and "nvfp4 ×10" in err and "dense ×2" in err and "bits/weight" in err
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["modules"]["model.layers.1.mlp.down_proj"]["format"] == "int8"
    assert "model.layers.1.self_attn.o_proj" not in qc["modules"]


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--format", "int7"], 2, "unknown format"),
        (["--format", "mxfp4", "--group-size", "64"], 2, "blocks of exactly 32"),
        (["--format", "int4", "--group-size", "100"], 2, "group size 100"),
        (["--format", "fp8-tensor", "--group-size", "128"], 2, "group"),
        (["--format", "int4", "--skip", "*.no_such_proj"], 2, "matches no"),
        (["--format", "int4", "--method", "magic"], 2, "unknown method"),
        (["--format", "int4", "--method", "magic", "--data", "wiki-calib"], 2, "unknown method 'magic'"),
        (["--format", "int4", "--method", "gptq"], 2, "needs exactly one of --calib"),
        (["--format", "int4", "--calib", "stats.safetensors"], 2, "go with --method"),
        (["--group-size", "64"], 2, "--format"),
        (["--format", "int4", "--recipe", "missing.yaml"], 2, "recipe file not found"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(extra, code, message, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama", tie=True)
    out = tmp_path / "out"
    got, stdout, err = run_cli(["quantize", str(src), "-o", str(out), *extra])
    assert got == code
    assert err.count("\n") == 1 and err.startswith("lowbit: error:") and message in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_model_existing_output_and_quantized_input(tiny_float_model, tmp_path, run_cli):
    code, _, err = run_cli(["quantize", str(tmp_path / "nowhere"), "--format", "int4", "-o", str(tmp_path / "o1")])
    assert code == 1 and "model not found" in err and not (tmp_path / "o1").exists()
    src = tiny_float_model("llama")
    out = tmp_path / "q"
    assert run_cli(["quantize", str(src), "--format", "int8", "-o", str(out)])[0] == 0
    code, _, err = run_cli(["quantize", str(src), "--format", "int8", "-o", str(out)])
    assert code == 2 and "already exists" in err and err.count("\n") == 1
    code, _, err = run_cli(["quantize", str(out), "--format", "int4", "-o", str(tmp_path / "again")])
    assert code == 1 and "already quantized" in err and not (tmp_path / "again").exists()
    assert run_cli(["quantize", str(src), "--format", "nf4", "-o", str(out), "--overwrite"])[0] == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"]["format"] == "nf4"


@pytest.mark.demo
def test_smollm2_int4_g64_perplexity_near_bf16(smollm2_dir, wiki_eval_path, tmp_path, run_cli):
    out = tmp_path / "smollm2-int4"
    code, stdout, _ = run_cli(["quantize", str(smollm2_dir), "--format", "int4", "--group-size", "64", "-o", str(out), "--json"])
    assert code == 0
    summary = json.loads(stdout)
    assert summary["formats"] == {"int4-g64": 210}
    assert summary["linear_bits_per_weight"] == pytest.approx(4.25)
    code, stdout, _ = run_cli(["eval", str(out), "--data", str(wiki_eval_path), "--chunks", "1", "--ctx", "1024",
                               "--base", str(smollm2_dir), "--json"])
    assert code == 0
    result = json.loads(stdout)
    ratio = result["kld"]["ppl_ratio"]
    # RTN int4 g64 on a 135M model costs a few tens of percent of perplexity, never a collapse
    assert 1.0 < ratio < 1.6, ratio
    assert 0.05 < result["kld"]["mean"] < 0.8 and result["kld"]["same_top_pct"] > 55


def test_gptq_through_the_cli_beats_rtn_on_its_own_text(tiny_float_model, tmp_path, run_cli):
    """--method gptq --data: sequential calibration through the command line, then eval against the float model."""
    src = tiny_float_model("llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 20)
    kld = {}
    for method, extra in (("rtn", []), ("gptq", ["--data", str(text), "--samples", "4", "--seqlen", "64"])):
        out = tmp_path / method
        code, stdout, _ = run_cli(["quantize", str(src), "--format", "int3", "--group-size", "32", "--method", method,
                                   *extra, "-o", str(out), "--json"])
        assert code == 0 and json.loads(stdout)["method"] == method
        assert not (tmp_path / f".{method}.lowbit-work").exists()  # the resume folder goes once the run completes
        code, stdout, _ = run_cli(["eval", str(out), "--data", str(text), "--ctx", "64", "--chunks", "2",
                                   "--base", str(src), "--json"])
        assert code == 0
        kld[method] = json.loads(stdout)["kld"]["mean"]
    assert 0 < kld["gptq"] < kld["rtn"]
