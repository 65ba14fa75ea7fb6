"""`lowbit distill --student QCKPT`: quantization loss won back on a tiny random Llama, same format out,
same bytes twice, a killed run resumes to the same bytes, exports reload exactly, bad inputs refused."""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest
import torch

from tests.conftest import _byte_tokenizer

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which but".split()
ARGS = ["--samples", "6", "--seqlen", "64", "--block-steps", "8", "--steps", "12", "--save-every", "5",
        "--eval-chunks", "3", "--lr", "3e-3", "--threads", "1"]


def _text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n"


def _tiny(directory, intermediate=128, seed=1, tie=False, layers=2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=258, max_position_embeddings=512,
                         bos_token_id=256, eos_token_id=257, tie_word_embeddings=tie)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(0.1 * noise) if "norm" in name else p.copy_(0.15 * noise)
    model.to(torch.bfloat16).save_pretrained(directory)
    _byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher dir, int4-g32 RTN student dir, training text, held-out text)."""
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    root = tmp_path_factory.mktemp("distill")
    teacher = _tiny(root / "teacher")
    student = root / "student"
    quantize_model(teacher, parse_spec("int4-g32"), out_dir=student)
    text, held = root / "train.txt", root / "held.txt"
    text.write_text(_text(700, seed=0))
    held.write_text(_text(300, seed=1))
    return teacher, student, text, held


def _digest(directory) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def _distill(run_cli, pair, out, *extra):
    teacher, student, text, _ = pair
    return run_cli(["distill", str(teacher), "--data", str(text), "--student", str(student), "-o", str(out), *ARGS, *extra])


def test_kld_falls_on_held_out_text_and_the_format_stays(run_cli, pair, tmp_path):
    teacher, student, _, held = pair
    out = tmp_path / "out"
    code, stdout, err = _distill(run_cli, pair, out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["steps"] == 12 and summary["train_tokens"] == 6 * 64
    assert summary["heldout_kld_after"] < 0.85 * summary["heldout_kld_before"]
    assert "end-to-end 12/12 KL" in err  # the progress lines carry the running loss
    # the same modules in the same format and bits; the codes untouched, the scales moved
    q_in = json.loads((student / "config.json").read_text())["quantization_config"]["modules"]
    q_out = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    assert q_in == q_out
    from lowbit.formats.native import load_native

    a, b = load_native(student), load_native(out)
    for module, qt in a.qtensors.items():
        assert torch.equal(qt.qweight, b.qtensors[module].qweight)
    assert any(not torch.equal(qt.scales, b.qtensors[m].scales) for m, qt in a.qtensors.items())
    assert (out / "tokenizer.json").read_bytes() == (student / "tokenizer.json").read_bytes()
    # `lowbit eval` on text neither run saw: the distilled checkpoint is closer to the teacher
    klds = []
    for model in (student, out):
        code, stdout, err = run_cli(["eval", str(model), "--data", str(held), "--base", str(teacher), "--ctx", "64", "--json"])
        assert code == 0, err
        klds.append(json.loads(stdout)["kld"]["mean"])
    assert klds[1] < 0.85 * klds[0]


def test_same_bytes_twice_and_a_killed_run_resumes_to_them(run_cli, pair, tmp_path):
    from lowbit.compress.distill.recover import RecoverOptions, prepare_recover, run_recover

    teacher, student, text, _ = pair
    code, _, err = _distill(run_cli, pair, tmp_path / "a")
    assert code == 0, err
    code, _, err = _distill(run_cli, pair, tmp_path / "b")
    assert code == 0, err
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    options = RecoverOptions(samples=6, seqlen=64, block_steps=8, steps=12, save_every=5, eval_chunks=3, lr=3e-3)
    for stage, at in (("block", 1), ("distill", 7)):  # killed after layer 0, then after end-to-end step 7
        out = tmp_path / f"killed-{stage}"

        def kill(where, done, total, loss, stage=stage, at=at):
            if where == stage and done == at:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            run_recover(prepare_recover(str(teacher), str(text), str(student), out, options), kill)
        assert not out.exists()
        code, _, err = _distill(run_cli, pair, out)
        assert code == 0, err
        assert "resuming" in err or stage == "block"
        assert _digest(out) == _digest(tmp_path / "a"), stage
        assert not (tmp_path / f".{out.name}.lowbit-work").exists()


def test_exported_compressed_tensors_and_gguf_reload_to_the_same_weights(run_cli, pair, tmp_path):
    from lowbit.formats.foreign import read_checkpoint

    out = tmp_path / "out"
    code, _, err = _distill(run_cli, pair, out)
    assert code == 0, err
    native = read_checkpoint(out)
    for target, path in (("compressed-tensors", tmp_path / "ct"), ("gguf", tmp_path / "model.gguf")):
        code, _, err = run_cli(["convert", str(out), "-o", str(path), "--to", target])
        assert code == 0, err
        back = read_checkpoint(path)
        assert set(back.qtensors) == set(native.qtensors), target
        for module, qt in native.qtensors.items():
            assert torch.equal(back.qtensors[module].dequantize(), qt.dequantize()), (target, module)
        for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight"):
            assert torch.equal(back.dense[name].float(), native.dense[name].float()), (target, name)


def test_a_gguf_student_comes_back_as_gguf_with_its_vocabulary(run_cli, pair, tmp_path):
    teacher, student, text, held = pair
    gguf = tmp_path / "student.gguf"
    code, _, err = run_cli(["convert", str(student), "-o", str(gguf), "--to", "gguf"])
    assert code == 0, err
    out = tmp_path / "distilled.gguf"
    code, _, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(gguf), "-o", str(out), *ARGS])
    assert code == 0, err
    klds = []
    for model in (gguf, out):  # eval checks that both tokenizers split the text alike
        code, stdout, err = run_cli(["eval", str(model), "--data", str(held), "--base", str(teacher), "--ctx", "64", "--json"])
        assert code == 0, err
        klds.append(json.loads(stdout)["kld"]["mean"])
    assert klds[1] < klds[0]


def test_a_quantized_tied_head_trains_for_the_embedding_too(run_cli, pair, tmp_path):
    _, _, text, held = pair
    teacher = _tiny(tmp_path / "tied", tie=True)
    student = tmp_path / "tied-q"
    code, _, err = run_cli(["quantize", str(teacher), "--format", "int4", "-g", "32", "--quantize-head", "-o", str(student)])
    assert code == 0, err
    out = tmp_path / "out"
    code, stdout, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(student), "-o", str(out),
                                 *ARGS, "--json"])
    assert code == 0, err
    from lowbit.formats.native import load_native

    a, b = load_native(student), load_native(out)
    assert "lm_head" in b.qtensors and "model.embed_tokens.weight" not in b.dense  # still one quantized matrix
    assert torch.equal(a.qtensors["lm_head"].qweight, b.qtensors["lm_head"].qweight)
    assert not torch.equal(a.qtensors["lm_head"].scales, b.qtensors["lm_head"].scales)
    klds = []
    for model in (student, out):
        code, stdout, err = run_cli(["eval", str(model), "--data", str(held), "--base", str(teacher), "--ctx", "64", "--json"])
        assert code == 0, err
        klds.append(json.loads(stdout)["kld"]["mean"])
    assert klds[1] < 0.9 * klds[0]


def _one_line_error(code, err, out):
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("lowbit: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists()
    return lines[0]


def test_bad_inputs_are_one_line_and_write_nothing(run_cli, pair, tmp_path):
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    teacher, student, text, _ = pair
    out = tmp_path / "out"
    # a quantization of another model (the STATS file's identity: config and shapes)
    other = tmp_path / "other-q"
    quantize_model(_tiny(tmp_path / "other", intermediate=96), parse_spec("int4-g32"), out_dir=other)
    code, _, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(other), "-o", str(out), *ARGS])
    assert "not a quantization of" in _one_line_error(code, err, out)
    # the same model with another tokenizer
    retok = tmp_path / "retok"
    shutil.copytree(student, retok)
    _byte_tokenizer(retok, chars=sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(), reverse=True))
    code, _, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(retok), "-o", str(out), *ARGS])
    assert "tokenizer" in _one_line_error(code, err, out)
    # a float student with the quantized student's options
    code, _, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(teacher), "-o", str(out), *ARGS])
    assert "quantized --student only" in _one_line_error(code, err, out)
    # too little text
    short = tmp_path / "short.txt"
    short.write_text(_text(60))
    code, _, err = run_cli(["distill", str(teacher), "--data", str(short), "--student", str(student), "-o", str(out), *ARGS])
    assert "too little text" in _one_line_error(code, err, out) or "fewer than" in err
    code, _, err = _distill(run_cli, pair, out, "--lr", "-1")
    assert "--lr" in _one_line_error(code, err, out)
    # a device torch cannot place on
    code, _, err = _distill(run_cli, pair, out, "--device", "tpu")
    assert "--device must be auto, cpu, cuda or cuda:N, got 'tpu'" in _one_line_error(code, err, out)
    if not torch.cuda.is_available():
        code, _, err = _distill(run_cli, pair, out, "--device", "cuda")
        assert "torch sees no CUDA device" in _one_line_error(code, err, out)


def test_nan_loss_stops_and_keeps_the_last_good_state(run_cli, pair, tmp_path):
    out = tmp_path / "out"
    code, _, err = _distill(run_cli, pair, out, "--block-steps", "0", "--lr", "1e30")
    line = _one_line_error(code, err, out)
    assert "NaN" in line or "nan" in line or "inf" in line
    assert "last good state (step 0)" in line
    work = tmp_path / ".out.lowbit-work"
    assert (work / "state.safetensors").is_file()
    # a rerun with a sane learning rate resumes from it and finishes
    code, _, err = _distill(run_cli, pair, out, "--block-steps", "0")
    assert code == 0, err and out.is_dir()


# ---------------------------------------------------------------------------------------------
# float students: a cut of the teacher (--student-layers / --drop-layers) or any model (--student)

DENSE_ARGS = ["--samples", "6", "--seqlen", "64", "--steps", "12", "--save-every", "5", "--eval-chunks", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def deep_teacher(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("deep")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=258, max_position_embeddings=512,
                         bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(0.1 * noise) if "norm" in name else p.copy_(0.15 * noise)
        model.model.layers[2].mlp.down_proj.weight.mul_(0.3)  # a layer that changes its input least
        model.model.layers[2].self_attn.o_proj.weight.mul_(0.3)
    model.to(torch.bfloat16).save_pretrained(root / "teacher")
    _byte_tokenizer(root / "teacher")
    text = root / "train.txt"
    text.write_text(_text(700, seed=0))
    return root / "teacher", text


def test_student_layers_drops_the_least_important_and_transformers_runs_it(run_cli, deep_teacher, tmp_path):
    from transformers import AutoModelForCausalLM

    from lowbit.runtime.loader import load_model

    teacher, text = deep_teacher
    out = tmp_path / "small"
    code, stdout, err = run_cli(["distill", str(teacher), "--data", str(text), "--student-layers", "3", "-o", str(out),
                                 *DENSE_ARGS, "--json"])
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["dropped_layers"] == [2] and summary["importance"][0]["layer"] == 2
    assert "least first: 2 " in err
    assert summary["heldout_kld_after"] < 0.9 * summary["heldout_kld_before"]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and (out / "tokenizer.json").is_file()
    ids = torch.tensor([[256, 5, 70, 71, 100, 33, 80, 90, 12]])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()(ids).logits
        ours = load_model(out)(ids)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    # `lowbit quantize` takes it like any model
    code, _, err = run_cli(["quantize", str(out), "--format", "int4", "-g", "32", "-o", str(tmp_path / "q")])
    assert code == 0, err
    # --drop-layers names them instead; the same run twice gives the same bytes, and a killed one too
    from lowbit.compress.distill.dense import DenseOptions, prepare_dense, run_dense

    args = ["distill", str(teacher), "--data", str(text), "--drop-layers", "0,3", *DENSE_ARGS]
    code, _, err = run_cli([*args, "-o", str(tmp_path / "a")])
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_hidden_layers"] == 2

    def kill(stage, done, total, loss):
        if stage == "distill" and done == 7:
            raise KeyboardInterrupt

    options = DenseOptions(samples=6, seqlen=64, steps=12, save_every=5, eval_chunks=3, drop_layers="0,3")
    with pytest.raises(KeyboardInterrupt):
        run_dense(prepare_dense(str(teacher), str(text), tmp_path / "b", options), kill)
    assert not (tmp_path / "b").exists()
    code, _, err = run_cli([*args, "-o", str(tmp_path / "b")])
    assert code == 0 and "resuming" in err, err
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_any_float_student_with_the_teachers_tokenizer(run_cli, deep_teacher, tmp_path):
    teacher, text = deep_teacher
    student = _tiny(tmp_path / "student", intermediate=96, seed=5)
    out = tmp_path / "out"
    code, stdout, err = run_cli(["distill", str(teacher), "--data", str(text), "--student", str(student), "-o", str(out),
                                 *DENSE_ARGS, "--json"])
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["heldout_kld_after"] < summary["heldout_kld_before"]
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96
    # another vocabulary, another tokenizer, and options that do not fit: one line each, nothing written
    config = json.loads((student / "config.json").read_text())
    wide = tmp_path / "wide"
    shutil.copytree(student, wide)
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    retok = tmp_path / "retok"
    shutil.copytree(student, retok)
    _byte_tokenizer(retok, chars=sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(), reverse=True))
    bad = tmp_path / "bad"
    for extra, words in (([ "--student", str(wide)], "vocabulary"), (["--student", str(retok)], "tokenizer"),
                         (["--student-layers", "4"], "between 1 and 3"), (["--drop-layers", "1,9"], "outside"),
                         (["--student", str(student), "--block-steps", "3"], "quantized --student only"), ([], "give --student")):
        code, _, err = run_cli(["distill", str(teacher), "--data", str(text), "-o", str(bad), *extra, *DENSE_ARGS])
        assert words in _one_line_error(code, err, bad), (extra, err)


def test_bf16_autocast_trains_too_and_stays_deterministic(run_cli, pair, tmp_path):
    # accelerate's bf16 mixed precision, then none, then bf16 again in one process (accelerate keeps
    # one state per process; placement.py starts each run from a fresh one)
    digests = {}
    for name, extra in (("a", ["--bf16"]), ("plain", []), ("b", ["--bf16"])):
        code, stdout, err = _distill(run_cli, pair, tmp_path / name, *extra, "--device", "cpu", "--json")
        assert code == 0, err
        summary = json.loads(stdout)
        assert summary["bf16"] == bool(extra) and summary["device"] == "cpu"
        assert summary["heldout_kld_after"] < 0.85 * summary["heldout_kld_before"]
        digests[name] = _digest(tmp_path / name)
    assert digests["a"] == digests["b"] != digests["plain"]
