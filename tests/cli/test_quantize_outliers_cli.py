"""`lowbit quantize --keep-outliers P [--keep-channels P]` end to end: the side matrices are in the
checkpoint, counted at 48 bits each by the summary and by `lowbit inspect`, and `lowbit eval` runs
them (they lower the KL divergence); rtn with outliers calibrates; bad flags are one-line errors."""

from __future__ import annotations

import json

import pytest


TEXT = " ".join(f"The {i}th river flows past the old mill near town number {i * 7 % 13}." for i in range(300))


def _quantize(src, out, run_cli, *extra):
    code, stdout, err = run_cli(["quantize", str(src), "--format", "int3", "--group-size", "32", "-o", str(out), "--json",
                                 *extra])
    assert code == 0, err
    return json.loads(stdout)


def _kld(model, src, text, run_cli) -> float:
    code, stdout, err = run_cli(["eval", str(model), "--data", str(text), "--ctx", "64", "--chunks", "2", "--base", str(src),
                                 "--json"])
    assert code == 0, err
    return json.loads(stdout)["kld"]["mean"]


def test_gptq_with_outliers_counts_them_and_eval_uses_them(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    calib = ["--data", str(text), "--samples", "4", "--seqlen", "64"]

    summary = _quantize(src, tmp_path / "g", run_cli, "--method", "gptq", *calib, "--keep-outliers", "0.5")
    base_bits = 3 + 16 / 32  # int3 codes + an fp16 scale per 32
    for m in summary["modules"]:
        n, k = m["shape"]
        assert m["outliers"] == round(n * k * 0.005)  # exactly the top 0.5 % of each matrix
        assert m["bits_per_weight"] == pytest.approx(base_bits + 48 * m["outliers"] / (n * k))
    assert summary["outliers"] == sum(m["outliers"] for m in summary["modules"])
    assert summary["linear_bits_per_weight"] == pytest.approx(base_bits + 48 * summary["outliers"] / summary["linear_params"])

    qc = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    assert {k: v["count"] for k, v in qc["outliers"].items()} == {m["name"]: m["outliers"] for m in summary["modules"]}
    code, stdout, _ = run_cli(["inspect", str(tmp_path / "g"), "--json"])
    report = json.loads(stdout)
    assert code == 0 and report["quantized"]["outliers"] == summary["outliers"]
    assert report["quantized"]["bits_per_weight"] == pytest.approx(summary["linear_bits_per_weight"])

    # whole channels on top: every row of the kept columns, so at least N per kept column
    both = _quantize(src, tmp_path / "gc", run_cli, "--method", "gptq", *calib, "--keep-outliers", "0.5",
                     "--keep-channels", "2", "--outlier-salience", "hessian")
    for m in both["modules"]:
        n, k = m["shape"]
        assert m["outliers"] >= n * round(k * 0.02) and m["outliers"] >= round(n * k * 0.005)

    # the act salience (the default is error) keeps exactly as many weights, not the same ones
    act = _quantize(src, tmp_path / "ga", run_cli, "--method", "gptq", *calib, "--keep-outliers", "0.5",
                    "--outlier-salience", "act")
    assert [m["outliers"] for m in act["modules"]] == [m["outliers"] for m in summary["modules"]]
    assert (tmp_path / "ga" / "model.safetensors").read_bytes() != (tmp_path / "g" / "model.safetensors").read_bytes()

    plain = _quantize(src, tmp_path / "p", run_cli, "--method", "gptq", *calib)
    assert plain["outliers"] == 0 and plain["linear_bits_per_weight"] == pytest.approx(base_bits)
    assert "outliers" not in json.loads((tmp_path / "p" / "config.json").read_text())["quantization_config"]
    assert _kld(tmp_path / "gc", src, text, run_cli) < _kld(tmp_path / "p", src, text, run_cli)


def test_rtn_with_outliers_calibrates_and_beats_plain_rtn(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    kept = _quantize(src, tmp_path / "r", run_cli, "--data", str(text), "--samples", "4", "--seqlen", "64",
                     "--keep-outliers", "1")
    assert kept["method"] == "rtn" and kept["outliers"] > 0
    plain = _quantize(src, tmp_path / "plain", run_cli)
    assert _kld(tmp_path / "r", src, text, run_cli) < _kld(tmp_path / "plain", src, text, run_cli)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--keep-outliers", "0.5"], "--keep-outliers / --keep-channels (salience needs activation statistics) needs"),
        (["--keep-channels", "1"], "needs exactly one of --calib STATS or --data TEXT"),
        (["--keep-outliers", "100", "--data", "x.txt"], "--keep-outliers is a percentage in [0, 100), got 100"),
        (["--keep-channels", "-1", "--data", "x.txt"], "--keep-channels is a percentage"),
        (["--keep-outliers", "1", "--outlier-salience", "magic", "--data", "x.txt"], "one of act, hessian, error, got 'magic'"),
        (["--data", "x.txt"], "go with --method"),
    ],
)
def test_bad_outlier_flags_are_one_line(extra, message, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-o", str(out), *extra])
    assert code == 2 and err.count("\n") == 1 and err.startswith("lowbit: error:") and message in err, err
    assert not out.exists()
