"""lowbit in shell pipelines (#25): outputs that are refused up front, leftovers swept, modes, resume
notices, plain progress in logs, GGUF files taken directly, NaN logits never turned into text."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.formats.test_gguf_tiny import write_tiny


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("lowbit: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "--debug" not in err, err
    return lines[0]


# --- outputs refused before any work -------------------------------------------------------------

@pytest.mark.parametrize("name", [".", ".."])
def test_output_that_names_the_current_folder_is_a_usage_error(name, tiny_float_model, tmp_path, run_cli, monkeypatch):
    src = tiny_float_model()
    work = tmp_path / "here" / "deeper"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", name])
    assert code == 2
    assert "not a new output" in _error_line(err)  # was: ValueError: PosixPath('.') has an empty name
    assert sorted(os.listdir(work)) == []


def test_output_under_a_file_names_that_file(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(tmp_path / "notes.txt" / "out")])
    assert code == 2
    assert "notes.txt is a file, not a folder" in _error_line(err)


def test_write_failure_names_the_output_not_the_temporary_path(tiny_float_model, tmp_path, run_cli, monkeypatch):
    import lowbit.formats.native as native

    src = tiny_float_model()
    out = tmp_path / "out"

    def full_disk(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    monkeypatch.setattr(native, "save_file", full_disk)
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(out)])
    line = _error_line(err)
    assert code == 1
    assert f"cannot write output {out}: No space left on device" in line
    assert ".tmp-" not in line  # the internal temporary sibling is not the user's business
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(folder), "--overwrite"])
    assert code == 2
    assert "does not look like a checkpoint" in _error_line(err) and "thesis.tex" in err
    assert (folder / "thesis.tex").read_text() == "precious"
    # a checkpoint it wrote itself is replaced as asked
    out = tmp_path / "out"
    for _ in range(2):
        code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(out), "--overwrite"])
        assert code == 0, err


def test_stale_temporary_siblings_of_killed_runs_are_swept(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-0badc0de"
    live = tmp_path / f".out.tmp-{os.getpid()}-0badc0de"  # a run still going keeps its own
    other = tmp_path / f".other.tmp-{dead.pid}-0badc0de"  # another output's is not ours to judge
    for folder in (stale, live, other):
        folder.mkdir()
    code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(tmp_path / "out")])
    assert code == 0, err
    assert not stale.exists() and live.exists() and other.exists()


def test_checkpoint_files_get_the_umask_mode(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    old = os.umask(0o022)
    try:
        code, _, err = run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(tmp_path / "out")])
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == 0o644, modes  # safetensors alone writes 0600
    assert set(modes.values()) == {0o644}


def test_inspect_of_a_float_model_says_so(tiny_float_model, run_cli):
    src = tiny_float_model()
    code, _, err = run_cli(["inspect", str(src)])
    assert code == 1
    assert "is a float checkpoint: no quantized layers" in _error_line(err)  # was: "checkpoint not found"


# --- resume, progress in logs --------------------------------------------------------------------

def test_resumed_run_says_so_and_progress_prints_plain_lines(tiny_float_model, tmp_path, run_cli, monkeypatch):
    from lowbit.compress.workdir import WorkDir

    src = tiny_float_model(layers=3)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    args = ["quantize", str(src), "--format", "int4", "-g", "32", "--method", "gptq", "--data", str(text),
            "--samples", "2", "--seqlen", "32", "-o", str(out)]
    save_layer = WorkDir.save_layer

    def killed_after_layer_0(self, index, tensors, meta):
        save_layer(self, index, tensors, meta)
        if index == 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkDir, "save_layer", killed_after_layer_0)
    code, _, err = run_cli(args)
    assert code == 130 and "interrupted (SIGINT)" in err
    assert not out.exists()
    monkeypatch.setattr(WorkDir, "save_layer", save_layer)
    monkeypatch.setenv("LOWBIT_PROGRESS_EVERY", "0")
    code, _, err = run_cli(args)
    assert code == 0, err
    assert f"resuming from {tmp_path / '.out.lowbit-work'}: 1 layer(s) already done" in err
    # stderr is not a terminal here: plain lines, one per step, the last one complete; nothing wrapped
    steps = [line for line in err.splitlines() if line.startswith("lowbit: quantizing ")]
    assert len(steps) >= 3 and steps[-1].startswith("lowbit: quantizing 5/5 head"), err
    summary = [line for line in err.splitlines() if line.lstrip().startswith("bits/weight")]
    assert len(summary) == 1 and summary[0].rstrip().endswith(")"), err


def test_tables_in_a_log_are_not_wrapped_at_80_columns(tiny_float_model, tmp_path, run_cli):
    src = tiny_float_model()
    out = tmp_path / "a-rather-long-output-directory-name-for-a-checkpoint-in-a-ci-log"
    assert run_cli(["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(out)])[0] == 0
    code, _, err = run_cli(["inspect", str(out)])
    assert code == 0
    assert any(len(line) > 80 for line in err.splitlines())
    assert "model.layers.0.self_attn.q_proj" in err  # a full name on one line, greppable


# --- GGUF taken directly; NaN never becomes text -------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny(path)
    return path


def test_eval_and_generate_take_a_gguf_file(tiny_gguf, tmp_path, run_cli):
    text = tmp_path / "text.txt"
    text.write_text("the theory of the thing is that the then there " * 30)
    code, out, err = run_cli(["eval", str(tiny_gguf), "--data", str(text), "--ctx", "32", "--chunks", "2", "--json"])
    assert code == 0, err  # was: no tokenizer.json in tiny.gguf
    direct = json.loads(out)["ppl"]
    assert run_cli(["convert", str(tiny_gguf), "-o", str(tmp_path / "hf"), "--dtype", "float32"])[0] == 0
    code, out, err = run_cli(["eval", str(tmp_path / "hf"), "--data", str(text), "--ctx", "32", "--chunks", "2", "--json"])
    assert code == 0, err
    # the direct load keeps the quantized blocks in the fused kernels; the converted copy is dense f32
    assert direct == pytest.approx(json.loads(out)["ppl"], rel=2e-3)
    code, out, err = run_cli(["generate", str(tiny_gguf), "the", "--max-tokens", "4", "--temperature", "0", "--json"])
    assert code == 0, err
    assert json.loads(out)["num_generated_tokens"] == 4


def test_generate_never_prints_text_from_nan_logits(tiny_float_model, run_cli):
    src = tiny_float_model(dtype=torch.float32)
    weights = load_file(str(src / "model.safetensors"))
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head / head.abs().max() * 3e38  # finite weights whose logits overflow to inf
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, out, err = run_cli(["generate", str(src), "hello", "--max-tokens", "4", "--dtype", "float32"])
    assert code == 1 and out == ""
    assert "logits hold NaN or inf" in _error_line(err)


@pytest.mark.demo
def test_convert_takes_a_demo_name_like_every_command(smollm2_dir, tmp_path, run_cli):
    code, out, err = run_cli(["convert", "smollm2-135m", "-o", str(tmp_path / "s.gguf"), "--to", "gguf", "--json"])
    assert code == 0, err  # was: checkpoint not found: smollm2-135m
    assert json.loads(out)["exact"]  # bf16 weights → BF16
