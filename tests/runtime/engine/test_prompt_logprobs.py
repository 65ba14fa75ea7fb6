"""Prompt log-probs from the engine's prefill forwards equal `lowbit eval`'s token log-probs
(runtime/evaluate.py's scoring of the same tokens) bit for bit, alone, batched, under chunked
prefill, after a prefix-cache hit and across a preemption, and in the CPU's default activation
modes on the demo model (bf16 and int4); they match the model's plain float32 forward to its
rounding; n sequences of one prompt share its blocks."""

from __future__ import annotations

import pytest
import torch

from lowbit.runtime.engine import model_runner
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from lowbit.runtime.evaluate import Window, _Accumulator, _score_window, _scoring_model, _window_logits
from lowbit.runtime.loader import load_model

WANT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
# fp32 throughout; the engine's fused q/k/v, batch-invariant linears and paged attention round
# differently from the model's plain forward, by far less than this
ATOL = 2e-5


def prompt(length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def eval_model(engine_llama_dir):
    return _scoring_model(engine_llama_dir, torch.float32, torch.device("cpu"), 128)  # as `lowbit eval` scores


@pytest.fixture(scope="module")
def plain_model(engine_llama_dir):
    return load_model(engine_llama_dir, torch.float32)  # the model's own forward: an independent reference


def eval_logprobs(model, ids: list[int]) -> list[float]:
    """Per-token log-probs of ids[1:] as lowbit eval scores a window [0, len) from token 1."""
    if len(ids) == 1:
        return []
    window = Window(0, len(ids), 1)
    acc = _Accumulator()
    with torch.inference_mode():
        logits = _window_logits(model, torch.tensor([ids]), window)
    _score_window(logits, torch.tensor(ids[1:]), None, acc)
    return (-torch.cat(acc.nll)).tolist()


def check(out, ids, model, top=3, plain=None):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    assert [e.token_id for e in lps[1:]] == ids[1:]
    got = [e.logprob for e in lps[1:]]
    assert got == eval_logprobs(model, ids)  # lowbit eval's numbers, exactly
    if plain is not None:
        ref = torch.tensor(eval_logprobs(plain, ids), dtype=torch.float64)
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), ref, atol=ATOL, rtol=0)
    for e in lps[1:]:
        assert len(e.top) == top and e.rank >= 1
        if top:
            assert e.top[0][1] >= e.logprob and all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
            # rank 1 exactly when the token is the most likely (top-1 or tied with it)
            assert (e.rank == 1) == (e.logprob == e.top[0][1])
            if e.rank <= top:
                assert e.top[e.rank - 1][1] == e.logprob


def test_prompt_logprobs_equal_eval_alone_batched_and_chunked(engine_llama_dir, eval_model, plain_model, monkeypatch):
    ps = [prompt(40, 1), prompt(7, 2), prompt(1, 3), prompt(23, 4)]
    engine = Engine(engine_llama_dir, kv_memory=2 << 20)
    outs = engine.generate(ps, WANT)
    for c, p in zip(outs, ps):
        check(c, p, eval_model, plain=plain_model)
    # chunks of 8 tokens (and prompt rows scored 5 at a time): same numbers
    monkeypatch.setattr(model_runner, "PROMPT_ROWS", 5)
    chunked = Engine(engine_llama_dir, kv_memory=2 << 20, max_num_batched_tokens=8)
    for c, p, plain in zip(chunked.generate(ps, WANT), ps, outs):
        check(c, p, eval_model)
        assert c.token_ids == plain.token_ids
    # without prompt_logprobs nothing is computed or returned
    assert engine.generate([ps[0]], SamplingParams(temperature=0, max_tokens=2))[0].prompt_logprobs is None


def test_prompt_logprobs_after_a_prefix_cache_hit_are_recomputed(engine_llama_dir, eval_model):
    engine = Engine(engine_llama_dir, kv_memory=2 << 20)
    p = prompt(40, 5)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate([p], plain)  # its two full blocks are now cached
    again = engine.generate([p], plain)[0]
    assert again.num_cached_tokens == 32
    hits = engine.stats().prefix_cache_hits
    wanted = engine.generate([p], WANT)[0]
    assert wanted.num_cached_tokens == 0 and engine.stats().prefix_cache_hits == hits  # skipped the cache
    check(wanted, p, eval_model)
    assert wanted.token_ids == again.token_ids


def test_prompt_logprobs_survive_preemption(engine_llama_dir, eval_model):
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers * k/v * kv_heads * head_dim * fp32 * block
    tiny = Engine(engine_llama_dir, kv_memory=8 * per_block, max_model_len=128, max_num_batched_tokens=16)
    ps = [prompt(30, 6), prompt(30, 7), prompt(20, 8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0)
    outs = tiny.generate(ps, params)
    assert tiny.stats().preemptions_total > 0
    for c, p in zip(outs, ps):
        check(c, p, eval_model, top=0)


def test_siblings_share_the_prompt_blocks(engine_llama_dir):
    engine = Engine(engine_llama_dir, kv_memory=2 << 20)
    p = prompt(40, 9)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", p, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1))
    engine.add_request("b", p, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=2),
                       share_prefix_with="a")
    engine.add_request("c", p, params, share_prefix_with="a")
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert cached == {"a": 0, "b": 32, "c": 32}


@pytest.mark.parametrize("fmt", [None, "int4-g32"])
def test_eval_equals_serve_in_the_default_activations(smollm2_dir, wiki_eval_path, tmp_path, monkeypatch, fmt):
    """The CPU defaults round activations (bf16 x for bf16 weights on AVX512-BF16, int8 x for int4
    on VNNI): there a last-bit difference in attention moves a rounding, and the model's plain
    forward drifts from the engine's by up to 0.1 nats a token. Eval scores on the engine's path,
    so an lm-eval perplexity through the server is `lowbit eval`'s, in every mode and chunking."""
    monkeypatch.delenv("LOWBIT_DENSE_ACTIVATIONS", raising=False)
    monkeypatch.delenv("LOWBIT_INT8_ACTIVATIONS", raising=False)
    model = smollm2_dir
    if fmt is not None:
        from lowbit.compress.pipeline import quantize_model

        quantize_model(smollm2_dir, fmt, out_dir=tmp_path / "q")
        model = tmp_path / "q"
    from lowbit.runtime.tokenizer import load_tokenizer

    ids = load_tokenizer(model).encode(wiki_eval_path.read_text(encoding="utf-8")[:600])[:96]
    scorer = _scoring_model(model, torch.float32, torch.device("cpu"), 128)
    want = eval_logprobs(scorer, ids)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for chunk in (2048, 24):
        engine = Engine(model, kv_memory=16 << 20, max_num_batched_tokens=chunk)
        out = engine.generate([ids], params)[0]
        assert [e.logprob for e in out.prompt_logprobs[1:]] == want
