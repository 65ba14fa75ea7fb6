"""`--sink-weight`: the first position of every calibration window counts W tokens in the
statistics. It changes what GPTQ produces, the default below 512-token windows is exactly W = 1,
and bad values are one-line errors that write nothing."""

from __future__ import annotations

import pytest


TEXT = " ".join(f"The {i}th river flows past the old mill near town number {i * 7 % 13}." for i in range(300))


def test_sink_weight_changes_gptq_and_defaults_to_one_on_short_windows(tiny_float_model, tmp_path, gptq_digest):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    default = gptq_digest(src, text, tmp_path / "default")
    one = gptq_digest(src, text, tmp_path / "one", "--sink-weight", "1")
    heavy = gptq_digest(src, text, tmp_path / "heavy", "--sink-weight", "16")
    again = gptq_digest(src, text, tmp_path / "again", "--sink-weight", "16")
    assert default == one  # 32-token windows: seqlen / 32 = 1
    assert heavy != one and heavy == again


@pytest.mark.parametrize(
    "args, message",
    [
        (["calibrate", "{src}", "--data", "{text}", "--sink-weight", "0.5", "-o", "{out}"], "--sink-weight must be at least 1, got 0.5"),
        (["quantize", "{src}", "--format", "int4", "--method", "gptq", "--data", "{text}", "--sink-weight", "-2", "-o", "{out}"],
         "--sink-weight must be at least 1"),
        (["quantize", "{src}", "--format", "int4", "--method", "gptq", "--calib", "{text}", "--sink-weight", "2", "-o", "{out}"],
         "--sink-weight goes with --data"),
    ],
)
def test_bad_sink_weight_is_one_line(args, message, tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model("llama")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    code, _, err = run_cli([a.format(src=src, text=text, out=out) for a in args])
    assert code == 2 and err.count("\n") == 1 and err.startswith("lowbit: error:") and message in err, err
    assert not out.exists()
