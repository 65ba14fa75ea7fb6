"""`lowbit eval` end to end on a tiny saved checkpoint, and its one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import _byte_tokenizer


TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. "
) * 4


def _gpt2_byte_chars() -> list[str]:
    """The byte → character map of byte-level BPE: printable bytes stay, the rest move to 256 + n."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, moved = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars


def _save_tiny_llama(directory, seed: int, vocab: int = 258, add_bos: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=256, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(directory)
    _byte_tokenizer(directory, add_bos, _gpt2_byte_chars())
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    a, b, other_vocab = root / "a", root / "b", root / "c"
    hf_a = _save_tiny_llama(a, seed=1)
    _save_tiny_llama(b, seed=2)
    _save_tiny_llama(other_vocab, seed=3, vocab=300)
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    short = root / "short.txt"
    short.write_text(TEXT[:100], encoding="utf-8")
    return {"short": short, "a": a, "b": b, "other_vocab": other_vocab, "text": text, "hf_a": hf_a, "root": root}


def _reference_ppl(hf_model, text: str, ctx: int) -> float:
    """transformers' logits, llama-perplexity's chunking, written out by hand."""
    ids = list(text.encode("utf-8"))
    ids = [256] + ids  # the tokenizer adds BOS
    nlls = []
    with torch.no_grad():
        for c in range(len(ids) // ctx):
            chunk = ids[c * ctx : (c + 1) * ctx]
            chunk[0] = 256
            logits = hf_model(torch.tensor([chunk])).logits[0].to(torch.float64)
            for j in range(ctx // 2, ctx - 1):
                nlls.append(float(torch.logsumexp(logits[j], 0) - logits[j, ids[c * ctx + j + 1]]))
    return math.exp(sum(nlls) / len(nlls))


def test_eval_json_matches_transformers_reference(tiny, run_cli):
    code, out, _ = run_cli(["eval", str(tiny["a"]), "--data", str(tiny["text"]), "--ctx", "64", "--json"])
    assert code == 0
    report = json.loads(out)
    n_tokens = len(TEXT.encode()) + 1
    assert report["chunks"] == n_tokens // 64
    assert report["tokens_scored"] == report["chunks"] * 31
    assert report["ppl"] == pytest.approx(_reference_ppl(tiny["hf_a"], TEXT, 64), rel=1e-4)
    assert set(report["timings"]) == {"load_s", "eval_s", "tokens_per_s"}
    assert "kld" not in report
    assert report["device"].startswith("cuda") if torch.cuda.is_available() else report["device"] == "cpu"  # --device auto


def test_eval_on_an_explicit_device_gives_the_same_ppl(tiny, run_cli):
    # --device cpu (and cuda where there is one) loads the model there; the CPU's PPL is the reference
    reports = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        code, out, _ = run_cli(["eval", str(tiny["a"]), "--data", str(tiny["text"]), "--ctx", "64", "--chunks", "2",
                                "--device", device, "--json"])
        assert code == 0
        reports[device] = json.loads(out)
    assert reports["cpu"]["device"] == "cpu"
    if "cuda" in reports:
        assert reports["cuda"]["device"].startswith("cuda")
        assert reports["cuda"]["ppl"] == pytest.approx(reports["cpu"]["ppl"], rel=1e-3)


def test_eval_with_base(tiny, run_cli):
    code, out, _ = run_cli(
        ["eval", str(tiny["a"]), "--data", str(tiny["text"]), "--ctx", "64", "--chunks", "2", "--base", str(tiny["a"]), "--json"])
    assert code == 0
    same = json.loads(out)
    assert same["chunks"] == 2
    assert same["kld"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert same["kld"]["same_top_pct"] == 100.0
    code, out, _ = run_cli(
        ["eval", str(tiny["a"]), "--data", str(tiny["text"]), "--ctx", "64", "--chunks", "2", "--base", str(tiny["b"]), "--json"])
    other = json.loads(out)
    assert other["kld"]["mean"] > 0.01
    assert other["kld"]["ppl_ratio"] == pytest.approx(other["ppl"] / other["kld"]["base_ppl"], rel=1e-9)
    assert set(other["kld"]) >= {"mean", "err", "p99", "p999", "same_top_pct", "rms_dp_pct", "base_ppl", "ppl_ratio"}


def test_eval_stride_and_human_summary(tiny, run_cli):
    code, out, err = run_cli(["eval", str(tiny["a"]), "--data", str(tiny["text"]), "--ctx", "64", "--stride", "32"])
    assert code == 0 and out == ""
    # rich wraps the summary at the terminal width, so compare with whitespace folded
    flat = " ".join(err.split())
    assert "PPL = " in flat and "stride 32" in flat


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--ctx", "1024"], 2, "maximum context"),
        (["--ctx", "128", "--data", "SHORT"], 2, "larger than the text"),
        (["--ctx", "63"], 2, "even"),
        (["--ctx", "2"], 2, "too small"),
        (["--ctx", "64", "--chunks", "0"], 2, "--chunks"),
        (["--ctx", "64", "--stride", "0"], 2, "--stride"),
        (["--ctx", "64", "--dtype", "f8"], 2, "--dtype"),
        (["--ctx", "64", "--device", "tpu"], 2, "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--ctx", "64", "--device", "cuda:64"], 2, "--device cuda:64"),
        (["--ctx", "64", "--base", "OTHER_VOCAB"], 1, "vocabulary"),
        (["--ctx", "64", "--base", "/no/such/model"], 1, "model not found"),
    ],
)
def test_eval_errors(tiny, run_cli, args, code, needle):
    placeholders = {"OTHER_VOCAB": str(tiny["other_vocab"]), "SHORT": str(tiny["short"])}
    args = [placeholders.get(a, a) for a in args]
    got, out, err = run_cli(["eval", str(tiny["a"]), "--data", str(tiny["text"]), *args])
    assert got == code
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("lowbit: error:") and needle in err and "Traceback" not in err


def test_eval_bad_model_and_data(tiny, run_cli, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for args, needle in [
        (["eval", "/no/such/model", "--data", str(tiny["text"])], "model not found"),
        (["eval", str(tiny["a"]), "--data", str(tmp_path / "missing.txt")], "text not found"),
        (["eval", str(tiny["a"]), "--data", str(empty)], "empty"),
    ]:
        code, _, err = run_cli(args)
        assert code == 1
        assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_eval_missing_data_option_is_usage_error(tiny, run_cli):
    code, _, err = run_cli(["eval", str(tiny["a"])])
    assert code == 2 and "--data" in err
