"""Perplexity and KLD numerics against naive, independently written references on tiny models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.runtime.evaluate import (
    chunk_windows,
    evaluate_text,
    evaluate_tokens,
    ppl_and_error,
    stride_windows,
)

VOCAB = 37


class TinyCausalLM(torch.nn.Module):
    """A stand-in obeying the runtime's forward contract; each logit depends on the whole prefix."""

    def __init__(self, seed: int, vocab: int = VOCAB, hidden: int = 16, max_positions: int = 256):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen))
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=gen) * 2)
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_positions)
        self.calls: list[tuple[int, int]] = []

    def forward(self, input_ids, positions=None, cache=None, logits_start=0):
        self.calls.append((input_ids.shape[1], logits_start))
        x = self.embed[input_ids]
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        prefix_mean = x.cumsum(dim=1) / steps  # causal: position t sees tokens ≤ t only
        h = torch.tanh(prefix_mean @ self.mix + x)
        return h[:, logits_start:] @ self.head.T


class TinyTokenizer:
    """One token per character, optionally with a BOS prepended (id 0)."""

    def __init__(self, add_bos: bool):
        self.add_bos = add_bos
        self.bos_id = 0

    def encode(self, text, add_bos=None):
        ids = [1 + (ord(c) % (VOCAB - 1)) for c in text]
        use_bos = self.add_bos if add_bos is None else add_bos
        return ([self.bos_id] if use_bos else []) + ids


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _nll64(model, ids: list[int], position: int, target: int) -> float:
    """-log p(target | ids[:position+1]) from full-sequence logits, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).to(torch.float64)[0, position]
    return float(torch.logsumexp(logits, 0) - logits[target])


def _naive_llama_ppl(model, tokens, ctx, n_chunks, bos):
    nlls = []
    for c in range(n_chunks):
        chunk = list(tokens[c * ctx : (c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        for j in range(ctx // 2, ctx - 1):
            nlls.append(_nll64(model, chunk, j, tokens[c * ctx + j + 1]))
    return nlls


def _stats(nlls):
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum(x * x for x in nlls) / n - mean * mean
    return math.exp(mean), math.exp(mean) * math.sqrt(var / (n - 1))


@pytest.mark.parametrize("bos", [None, 0])
def test_chunk_ppl_matches_naive_llama_perplexity(bos):
    model = TinyCausalLM(seed=3)
    tokens = _tokens(3 * 32 + 5)
    result = evaluate_tokens(model, tokens, chunk_windows(len(tokens), 32), bos_id=bos)
    # Only the scored half (plus the row predicting past the end) is projected.
    assert model.calls == [(32, 16)] * 3
    nlls = _naive_llama_ppl(model, tokens, 32, 3, bos)
    ppl, err = _stats(nlls)
    assert result.tokens_scored == len(nlls) == 3 * 15
    assert result.ppl == pytest.approx(ppl, rel=1e-5)
    assert result.ppl_err == pytest.approx(err, rel=1e-4)


def test_bos_replacement_changes_the_result():
    model = TinyCausalLM(seed=3)
    tokens = _tokens(64)
    with_bos = evaluate_tokens(model, tokens, chunk_windows(64, 32), bos_id=0)
    without = evaluate_tokens(model, tokens, chunk_windows(64, 32), bos_id=None)
    assert with_bos.ppl != pytest.approx(without.ppl, rel=1e-6)


def test_chunk_windows_follow_llama_perplexity():
    windows = chunk_windows(100, 32)
    assert [(w.start, w.end, w.score_from) for w in windows] == [(0, 32, 17), (32, 64, 49), (64, 96, 81)]
    assert [w.logits_start for w in windows] == [16, 16, 16]
    assert len(chunk_windows(100, 32, chunks=2)) == 2
    assert len(chunk_windows(100, 32, chunks=50)) == 3


def test_evaluate_text_uses_tokenizer_bos_rule():
    model = TinyCausalLM(seed=5)
    text = "the quick brown fox jumps over the lazy dog; " * 3
    tokenizer = TinyTokenizer(add_bos=True)
    tokens = tokenizer.encode(text)
    result = evaluate_text(model, tokenizer, text, ctx=32)
    n_chunks = len(tokens) // 32
    ppl, _ = _stats(_naive_llama_ppl(model, tokens, 32, n_chunks, bos=0))
    assert result.windows == n_chunks and result.mode == "chunks"
    assert result.ppl == pytest.approx(ppl, rel=1e-5)


def _naive_hf_stride(model, tokens, ctx, stride):
    """Hugging Face's documented sliding-window loop, scoring token by token."""
    nlls, prev_end = [], 0
    seq_len = len(tokens)
    for begin in range(0, seq_len, stride):
        end = min(begin + ctx, seq_len)
        trg_len = end - prev_end
        window = list(tokens[begin:end])
        for t in range(max(end - trg_len, begin + 1), end):
            nlls.append(_nll64(model, window, t - 1 - begin, tokens[t]))
        prev_end = end
        if end == seq_len:
            break
    return nlls


@pytest.mark.parametrize("stride", [8, 16, 32])
def test_stride_matches_naive_sliding_window(stride):
    model = TinyCausalLM(seed=7)
    tokens = _tokens(75, seed=2)
    result = evaluate_tokens(model, tokens, stride_windows(len(tokens), 32, stride))
    nlls = _naive_hf_stride(model, tokens, 32, stride)
    assert result.tokens_scored == len(nlls)
    if stride < 32:  # overlapping windows score every token but the first exactly once
        assert len(nlls) == len(tokens) - 1
    assert result.ppl == pytest.approx(_stats(nlls)[0], rel=1e-5)


def test_stride_window_limit():
    windows = stride_windows(100, 32, 16, windows=2)
    assert [(w.start, w.end, w.score_from) for w in windows] == [(0, 32, 1), (16, 48, 32)]


def test_kld_of_model_against_itself_is_zero():
    model = TinyCausalLM(seed=3)
    tokens = _tokens(96)
    result = evaluate_tokens(model, tokens, chunk_windows(96, 32), base_model=TinyCausalLM(seed=3))
    kld = result.kld
    assert kld.mean == pytest.approx(0.0, abs=1e-12)
    assert kld.p99 == pytest.approx(0.0, abs=1e-12)
    assert kld.same_top_pct == 100.0
    assert kld.rms_dp_pct == pytest.approx(0.0, abs=1e-9)
    assert kld.ppl_ratio == pytest.approx(1.0)
    assert kld.base_ppl == pytest.approx(result.ppl)


def test_kld_matches_float64_reference_for_two_models():
    model, base = TinyCausalLM(seed=3), TinyCausalLM(seed=4)
    tokens = _tokens(96)
    ctx = 32
    result = evaluate_tokens(model, tokens, chunk_windows(96, ctx), bos_id=0, base_model=base)
    kls, same, dps, nll_m, nll_b = [], [], [], [], []
    with torch.no_grad():
        for c in range(3):
            chunk = list(tokens[c * ctx : (c + 1) * ctx])
            chunk[0] = 0
            lm = torch.log_softmax(model(torch.tensor([chunk]))[0].to(torch.float64), -1)
            lb = torch.log_softmax(base(torch.tensor([chunk]))[0].to(torch.float64), -1)
            for j in range(ctx // 2, ctx - 1):
                target = tokens[c * ctx + j + 1]
                pb = lb[j].exp()
                kls.append(float((pb * (lb[j] - lm[j])).sum()))
                same.append(int(lm[j].argmax() == lb[j].argmax()))
                dps.append(float(lm[j, target].exp() - lb[j, target].exp()))
                nll_m.append(-float(lm[j, target]))
                nll_b.append(-float(lb[j, target]))
    kld = result.kld
    n = len(kls)
    mean = sum(kls) / n
    err = math.sqrt((sum(k * k for k in kls) / n - mean * mean) / (n - 1))
    ordered = sorted(kls)
    pos = 0.99 * (n - 1)
    p99 = ordered[int(pos)] + (pos - int(pos)) * (ordered[int(pos) + 1] - ordered[int(pos)])
    assert mean > 0.05  # the two models really differ
    assert kld.mean == pytest.approx(mean, rel=1e-6)
    assert kld.err == pytest.approx(err, rel=1e-5)
    assert kld.p99 == pytest.approx(p99, rel=1e-6)
    assert kld.same_top_pct == pytest.approx(100.0 * sum(same) / n)
    assert kld.rms_dp_pct == pytest.approx(100.0 * math.sqrt(sum(d * d for d in dps) / n), rel=1e-6)
    assert kld.base_ppl == pytest.approx(math.exp(sum(nll_b) / n), rel=1e-6)
    assert kld.ppl_ratio == pytest.approx(math.exp((sum(nll_m) - sum(nll_b)) / n), rel=1e-6)


def test_ppl_error_formula():
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    ppl, err, mean = ppl_and_error(nll)
    assert mean == 2.5 and ppl == pytest.approx(math.exp(2.5))
    assert err == pytest.approx(math.exp(2.5) * math.sqrt(1.25 / 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"ctx": 31}, UsageError, "even"),
        ({"ctx": 4}, UsageError, "too small"),
        ({"ctx": 512}, UsageError, "maximum context"),
        ({"ctx": 200}, UsageError, "larger than the text"),
        ({"ctx": 32, "chunks": 0}, UsageError, "--chunks"),
        ({"ctx": 32, "stride": 0}, UsageError, "--stride"),
        ({"ctx": 32, "stride": 33}, UsageError, "--stride"),
    ],
)
def test_bad_options(kwargs, error, needle):
    model = TinyCausalLM(seed=1)
    with pytest.raises(error, match=needle):
        evaluate_text(model, TinyTokenizer(False), "x" * 100, **kwargs)


def test_empty_text_and_vocab_mismatch():
    model = TinyCausalLM(seed=1)
    with pytest.raises(LowbitError, match="empty"):
        evaluate_text(model, TinyTokenizer(False), "  \n", ctx=32)
    with pytest.raises(LowbitError, match="vocabulary"):
        evaluate_text(model, TinyTokenizer(False), "x" * 100, ctx=32, base_model=TinyCausalLM(seed=1, vocab=40))


@pytest.mark.demo
@pytest.mark.slow
def test_smollm2_wiki_eval_ppl_matches_transformers(smollm2_dir, wiki_eval_path):
    """lowbit's PPL on the real model equals transformers' fp32 PPL on the same tokens within 0.5%."""
    from transformers import AutoModelForCausalLM

    from lowbit.data.text import load_text
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    ctx, n_chunks = 2048, 2
    tokenizer = load_tokenizer(smollm2_dir)
    text = load_text(wiki_eval_path)
    result = evaluate_text(load_model(smollm2_dir, dtype=torch.float32), tokenizer, text, ctx=ctx, chunks=n_chunks)

    tokens, bos = tokenizer.encode(text), (tokenizer.bos_id if tokenizer.add_bos else None)
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    nlls = []
    with torch.no_grad():
        for c in range(n_chunks):
            chunk = tokens[c * ctx : (c + 1) * ctx]
            if bos is not None:
                chunk[0] = bos
            logits = reference(torch.tensor([chunk])).logits[0, ctx // 2 : ctx - 1].to(torch.float64)
            targets = torch.tensor(tokens[c * ctx + ctx // 2 + 1 : (c + 1) * ctx])
            nlls.append(torch.logsumexp(logits, -1) - logits.gather(1, targets[:, None]).squeeze(1))
    expected = math.exp(float(torch.cat(nlls).mean()))
    assert result.tokens_scored == n_chunks * (ctx // 2 - 1)
    assert 5 < expected < 60  # a real language model on English text
    assert result.ppl == pytest.approx(expected, rel=5e-3)


def test_non_finite_log_probabilities_are_an_error_not_a_nan_perplexity():
    from lowbit.runtime.evaluate import ppl_and_error

    with pytest.raises(LowbitError, match="NaN or inf at 1 of 3 scored tokens"):
        ppl_and_error(torch.tensor([1.0, float("nan"), 2.0]))
    assert ppl_and_error(torch.tensor([1.0, 1.0]))[0] == pytest.approx(math.e)
