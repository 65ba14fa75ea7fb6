"""`--refit-rounds N`: GPTQ's scale refit is on by default (one round), changes the checkpoint, is
deterministic, and bad values or a method without GPTQ are one-line errors; the same for
`--float-target` (GPTQ matched to the float model's outputs)."""

from __future__ import annotations

import pytest

TEXT = " ".join(f"Boat {i} carried {i * 3 % 17} crates of salt down the canal to market {i % 5}." for i in range(300))


def test_refit_is_default_and_deterministic(tiny_float_model, tmp_path, gptq_digest):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    default = gptq_digest(src, text, tmp_path / "default", fmt="int4-asym")
    explicit = gptq_digest(src, text, tmp_path / "explicit", "--refit-rounds", "1", fmt="int4-asym")
    plain = gptq_digest(src, text, tmp_path / "plain", "--refit-rounds", "0", fmt="int4-asym")
    more = gptq_digest(src, text, tmp_path / "more", "--refit-rounds", "3", fmt="int4-asym")
    assert default == explicit and len({default, plain, more}) == 3


@pytest.mark.parametrize("method, rounds, message", [
    ("awq", "0", "--refit-rounds goes with --method gptq or awq+gptq, not awq"),
    ("gptq", "-1", "--refit-rounds must be between 0 and 100, got -1"),
])
def test_bad_refit_rounds_is_one_line(method, rounds, message, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "--method", method, "--data", str(text),
                            "--refit-rounds", rounds, "-o", str(out)])
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_float_target_is_deterministic_and_changes_the_checkpoint(tiny_float_model, tmp_path, gptq_digest):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    plain = gptq_digest(src, text, tmp_path / "plain")
    first = gptq_digest(src, text, tmp_path / "a", "--float-target")
    again = gptq_digest(src, text, tmp_path / "b", "--float-target")
    assert first == again != plain


@pytest.mark.parametrize("extra", [["--method", "awq+gptq", "--data", "DATA"], ["--method", "gptq", "--calib", "x.stats"],
                                   ["--method", "rtn"]])
def test_float_target_needs_gptq_with_data(extra, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    extra = [str(text) if a == "DATA" else a for a in extra]
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", *extra, "--float-target", "-o", str(out)])
    assert code == 2 and err.count("\n") == 1 and "--float-target goes with --method gptq and --data" in err, err
    assert not out.exists()
