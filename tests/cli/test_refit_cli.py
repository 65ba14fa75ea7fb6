"""`--refit/--no-refit`: GPTQ's scale refit is on by default, changes the checkpoint, is
deterministic, and `--no-refit` with a method that has no GPTQ is a one-line error."""

from __future__ import annotations

import hashlib

TEXT = " ".join(f"Boat {i} carried {i * 3 % 17} crates of salt down the canal to market {i % 5}." for i in range(300))


def _gptq(src, text, out, run_cli, *extra) -> str:
    code, _, err = run_cli(["quantize", str(src), "--format", "int4-asym", "--group-size", "32", "--method", "gptq",
                            "--data", str(text), "--samples", "4", "--seqlen", "32", "-o", str(out), *extra])
    assert code == 0, err
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def test_refit_is_default_and_deterministic(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    default = _gptq(src, text, tmp_path / "default", run_cli)
    explicit = _gptq(src, text, tmp_path / "explicit", run_cli, "--refit")
    plain = _gptq(src, text, tmp_path / "plain", run_cli, "--no-refit")
    assert default == explicit and default != plain


def test_no_refit_without_gptq_is_one_line(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "--method", "awq", "--data", str(text),
                            "--no-refit", "-o", str(out)])
    assert code == 2 and err.count("\n") == 1 and "--no-refit goes with --method gptq or awq+gptq" in err, err
    assert not out.exists()
