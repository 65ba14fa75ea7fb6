"""`lowbit distill --exit-layers`: exit adapters trained on a tiny random Llama bring each exit's
logits nearer the full model's on held-out text; OUT is the teacher plus the adapters file, which
eval/generate pick up; the same bytes twice and after a resumed kill; bad inputs refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.cli.test_distill_cli import _text, _tiny

ARGS = ["--samples", "6", "--seqlen", "64", "--steps", "30", "--save-every", "10", "--eval-chunks", "3",
        "--exit-rank", "16", "--lr", "1e-2", "--threads", "1"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("exits")
    model = _tiny(root / "teacher", layers=4, seed=3, tie=True)
    text, held = root / "train.txt", root / "held.txt"
    text.write_text(_text(700, seed=0))
    held.write_text(_text(300, seed=1))
    return model, text, held


def _run(run_cli, teacher, out, *extra):
    model, text, held = teacher
    return run_cli(["distill", str(model), "--data", str(text), "--eval-data", str(held), "--exit-layers", "1,3",
                    "-o", str(out), *ARGS, *extra])


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(teacher, tmp_path_factory):
    """(OUT, summary) of the library call the CLI makes with ARGS."""
    from lowbit.compress.distill.exits import ExitOptions, prepare_exits, run_exits

    model, text, held = teacher
    out = tmp_path_factory.mktemp("exits_out") / "out"
    torch.set_num_threads(1)
    options = ExitOptions(layers="1,3", rank=16, steps=30, lr=1e-2, samples=6, seqlen=64, save_every=10, eval_chunks=3,
                          eval_data=str(held))
    return out, run_exits(prepare_exits(str(model), str(text), out, options))


def test_exits_come_nearer_the_full_model(trained, teacher):
    out, summary = trained
    assert summary["exit_layers"] == [1, 3] and summary["steps"] == 30 and summary["rank"] == 16
    for layer in ("1", "3"):
        assert summary["heldout_after"][layer]["kld"] < 0.8 * summary["heldout_before"][layer]["kld"]
    # OUT is the teacher's files, byte for byte, with the adapters beside them
    model = teacher[0]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _digest(out / name) == _digest(model / name)
    assert (out / "exit_adapters.safetensors").stat().st_size == summary["adapter_bytes"]


def test_the_summary_matches_what_eval_measures_with_the_adapters(trained, run_cli, teacher):
    """eval --early-exit at threshold 0 takes the first exit everywhere: its KLD against the model
    itself falls with the adapters (same text, the teacher without them beside)."""
    out, _ = trained
    held = teacher[2]
    common = ["--data", str(held), "--ctx", "64", "--early-exit", "3", "--exit-threshold", "0", "--json", "--threads", "1"]
    code, plain, err = run_cli(["eval", str(teacher[0]), *common])
    assert code == 0, err
    code, adapted, err = run_cli(["eval", str(out), *common])
    assert code == 0, err
    plain, adapted = json.loads(plain), json.loads(adapted)
    assert plain["early_exit"]["adapted_layers"] == [] and adapted["early_exit"]["adapted_layers"] == [1, 3]
    assert adapted["early_exit"]["exit_rate"]["3"] == 1.0
    assert adapted["kld"]["mean"] < 0.8 * plain["kld"]["mean"]


def test_same_bytes_twice_and_after_a_kill(trained, run_cli, teacher, tmp_path, monkeypatch):
    out, _ = trained
    again = tmp_path / "again"
    code, _, err = _run(run_cli, teacher, again)
    assert code == 0, err
    assert "end-to-end 30/30 KL" in err  # the progress lines carry the running loss
    assert _digest(again / "exit_adapters.safetensors") == _digest(out / "exit_adapters.safetensors")

    from lowbit.compress.distill import train

    real = train.save_state
    calls = {"n": 0}

    def dies_after_second_save(*args, **kwargs):
        real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_state", dies_after_second_save)
    killed = tmp_path / "killed"
    code, _, _ = _run(run_cli, teacher, killed)
    assert code == 130 and not killed.exists()
    monkeypatch.setattr(train, "save_state", real)
    code, _, err = _run(run_cli, teacher, killed)
    assert code == 0, err
    assert "resuming" in err and "step 20 of 30" in err
    assert _digest(killed / "exit_adapters.safetensors") == _digest(out / "exit_adapters.safetensors")


def test_quantize_carries_the_adapters(trained, run_cli, tmp_path):
    out, _ = trained
    q = tmp_path / "q"
    code, _, err = run_cli(["quantize", str(out), "--format", "int8", "-o", str(q)])
    assert code == 0, err
    assert _digest(q / "exit_adapters.safetensors") == _digest(out / "exit_adapters.safetensors")


@pytest.mark.parametrize("extra, message", [
    (["--exit-layers", "4"], "--early-exit layer 4 is out of range"),
    (["--exit-layers", "1", "--exit-rank", "65"], "--exit-rank 65 is more than the hidden size 64"),
    (["--exit-layers", "1", "--exit-rank", "0"], "--exit-rank must be >= 1"),
    (["--exit-layers", "1", "--student-layers", "2"], "--exit-layers trains adapters on TEACHER itself"),
])
def test_bad_input_is_one_line_and_writes_nothing(run_cli, teacher, tmp_path, extra, message):
    model, text, _ = teacher
    out = tmp_path / "out"
    code, _, err = run_cli(["distill", str(model), "--data", str(text), "-o", str(out), *extra])
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_quantized_teacher_is_refused(run_cli, teacher, tmp_path):
    model, text, _ = teacher
    q = tmp_path / "q"
    assert run_cli(["quantize", str(model), "--format", "int4", "-o", str(q)])[0] == 0
    code, _, err = run_cli(["distill", str(q), "--data", str(text), "--exit-layers", "1", "-o", str(tmp_path / "o")])
    assert code == 2 and "is quantized; train exit adapters on the float model" in err


def test_a_nan_adapter_file_is_refused_by_eval(trained, run_cli, teacher, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    out, _ = trained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    path = bad / "exit_adapters.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    tensors["exit.3.up"][0, 0] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    code, _, err = run_cli(["eval", str(bad), "--data", str(teacher[2]), "--ctx", "64", "--early-exit", "3",
                            "--exit-threshold", "0.5"])
    assert code == 1 and "exit.3 holds NaN/inf" in err and "Traceback" not in err
    assert torch.isnan(tensors["exit.3.up"]).any()
