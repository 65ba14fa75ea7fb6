"""Engine exactness on tiny random models, greedy fp32: paged == contiguous == full recompute,
batched == alone, prefix hit == miss, preempted == uninterrupted, speculative == plain."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine import paged_attention
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from lowbit.runtime.quant_linear import QuantLinear

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 9, 33, 1][:n]
    return [torch.randint(3, 256, (length,), generator=gen).tolist() for length in lengths]


def recompute_greedy(model, prompt, n):
    """No cache at all: the whole sequence through the model for every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def contiguous_greedy(model, prompt, n):
    cache = model.new_cache(1, len(prompt) + n)
    out = []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), cache=cache)[0, -1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.fixture(scope="module")
def llama_engine(engine_llama_dir):
    return Engine(engine_llama_dir, kv_memory=2 << 20)


def test_paged_equals_contiguous_and_recompute_batched_and_alone(llama_engine):
    check_paged_contiguous_batched_alone(llama_engine)


def check_paged_contiguous_batched_alone(engine) -> None:
    """Greedy tokens of the engine batched == each prompt alone == a contiguous cache == recomputing."""
    ps = prompts()
    batched = [c.token_ids for c in engine.generate(ps, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in ps]
    model = engine.model
    for p, b, a in zip(ps, batched, alone):
        assert b == a
        assert b == contiguous_greedy(model, p, GREEDY.max_tokens)
        assert b == recompute_greedy(model, p, GREEDY.max_tokens)


def test_chunked_prefill_and_tiled_attention(engine_llama_dir, monkeypatch):
    monkeypatch.setattr(paged_attention, "PREFILL_TILE", 8)
    engine = Engine(engine_llama_dir, kv_memory=2 << 20, max_num_batched_tokens=12, enable_prefix_caching=False)
    ps = prompts()
    got = [c.token_ids for c in engine.generate(ps, GREEDY)]
    assert got == [contiguous_greedy(engine.model, p, GREEDY.max_tokens) for p in ps]


def test_prefill_cap_changes_no_token(engine_llama_dir):
    # prompts through 5 tokens a step while the others wait and decode: the same greedy text
    engine = Engine(engine_llama_dir, kv_memory=2 << 20, max_prefill_tokens=5)
    ps = prompts()
    got = [c.token_ids for c in engine.generate(ps, GREEDY)]
    assert got == [contiguous_greedy(engine.model, p, GREEDY.max_tokens) for p in ps]
    assert engine.scheduler.max_prefill_tokens == 5


def test_prefix_cache_hit_equals_miss(llama_engine):
    p = prompts(3)[2]  # 40 tokens: two full blocks can be reused
    first = llama_engine.generate([p], GREEDY)[0]
    before = llama_engine.stats().prefix_cache_hits
    second = llama_engine.generate([p], GREEDY)[0]
    assert second.num_cached_tokens == 32 and llama_engine.stats().prefix_cache_hits - before == 32
    assert second.token_ids == first.token_ids


def test_preempted_and_resumed_equals_uninterrupted(engine_llama_dir, llama_engine):
    ps = prompts(4)
    expected = [c.token_ids for c in llama_engine.generate(ps, GREEDY)]
    # 8 blocks of 16 tokens: the four sequences need 10 at the end, so someone is preempted.
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers * k/v * kv_heads * head_dim * fp32 * block
    tiny = Engine(engine_llama_dir, kv_memory=8 * per_block, max_model_len=128)
    assert tiny.cache.num_blocks == 8
    got = [c.token_ids for c in tiny.generate(ps, GREEDY)]
    assert tiny.stats().preemptions_total > 0
    assert got == expected


def test_multi_turn_reuses_previous_turn_blocks(llama_engine):
    turn1 = prompts(3)[1] + prompts(3)[0]  # 20 tokens
    out1 = llama_engine.generate([turn1], GREEDY)[0]
    history = turn1 + out1.token_ids  # 44 tokens, the first 2 blocks computed and cached
    turn2 = history + [65, 66, 67]
    before = llama_engine.stats().prefix_cache_hits
    out2 = llama_engine.generate([turn2], GREEDY)[0]
    assert llama_engine.stats().prefix_cache_hits - before == 32 == out2.num_cached_tokens
    assert out2.token_ids == contiguous_greedy(llama_engine.model, turn2, GREEDY.max_tokens)


@pytest.mark.parametrize("draft", ["ngram", "self:int4", "self:int8", "other"])
def test_speculative_greedy_equals_plain(draft, engine_llama_dir, engine_llama_draft_dir, llama_engine):
    ps = prompts()
    # n-gram lookup needs repetition to propose anything: repeat each prompt
    ps = [p + p for p in ps] if draft == "ngram" else ps
    expected = [c.token_ids for c in llama_engine.generate(ps, GREEDY)]
    spec = Engine(engine_llama_dir, kv_memory=4 << 20,
                  draft=str(engine_llama_draft_dir) if draft == "other" else draft, num_speculative_tokens=3)
    got = [c.token_ids for c in spec.generate(ps, GREEDY)]
    stats = spec.stats()
    assert got == expected
    assert stats.spec_draft_tokens > 0
    assert 1.0 <= stats.spec_mean_accepted_length <= 7.0
    if draft == "self:int8":  # a near-lossless copy agrees almost always, if its own KV cache is right
        # (k <= 3 per pass: each of the few disagreements costs a larger share of the drafts than
        # when k could grow to 6; a stale draft KV cache gives well under 0.5)
        assert stats.spec_accepted_tokens / stats.spec_draft_tokens > 0.9


@pytest.mark.parametrize("draft", ["self:int4", "other"])
def test_cpu_draft_lm_head_is_quantized_and_rescored(draft, engine_llama_dir, engine_llama_draft_dir):
    # the head is read in full at every draft step: int4-g32, its top candidates rescored exactly
    spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft=str(engine_llama_draft_dir) if draft == "other" else draft)
    head = spec.drafter.model.lm_head
    from lowbit.kernels import cpu_int4dot
    from lowbit.runtime.engine.draft_models import RescoredHead

    vnni = cpu_int4dot.vnni_int8_available()
    assert isinstance(head, RescoredHead) and head.label == "int4-g32"
    assert not vnni or head.fast.prepared.path == "cpu-int4dot"
    body = spec.drafter.model.model.layers[0].mlp.down_proj
    assert draft == "other" or body.label == "int4"
    # the target's float32 on the CPU, where the one-call decode step runs (a bf16 draft went layer
    # by layer through Python: SmolLM2's speculation 0.62x -> 0.87x of plain decoding)
    assert spec.draft_dtype is torch.float32 and spec.drafter.runner.chained is not None


def test_gemma3_sliding_window_paged_equals_contiguous(engine_gemma3_dir, monkeypatch):
    monkeypatch.setattr(paged_attention, "PREFILL_TILE", 8)
    engine = Engine(engine_gemma3_dir, kv_memory=2 << 20, max_num_batched_tokens=16)
    ps = prompts()  # window 8: most prompts and all generations pass it
    got = [c.token_ids for c in engine.generate(ps, GREEDY)]
    for p, g in zip(ps, got):
        assert g == contiguous_greedy(engine.model, p, GREEDY.max_tokens)


def test_same_seed_same_text_whatever_the_batch(llama_engine):
    ps = prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llama_engine.generate([ps[0]], params)[0]
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batched = llama_engine.generate(ps, [params, other, other, other])[0]
    again = llama_engine.generate([ps[0]], params)[0]
    assert alone.token_ids == batched.token_ids == again.token_ids
    assert alone.text == again.text
    different = llama_engine.generate([ps[0]], SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=16,
                                                               ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_stop_strings_are_cut_and_never_streamed(llama_engine):
    p = prompts()[1]
    full = llama_engine.generate([p], GREEDY)[0]
    stop = full.text[5:8]
    assert len(stop) == 3 and stop not in full.text[:7]
    llama_engine.add_request("s", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,)))
    streamed, outs = "", []
    while llama_engine.has_unfinished_requests():
        for out in llama_engine.step():
            streamed += out.text_delta
            outs.append(out)
    assert streamed == full.text[: full.text.index(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_logprobs_abort_and_limits(llama_engine):
    p = prompts()[0]
    c = llama_engine.generate([p], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert len(c.logprobs) == 3
    for token, (lp, top) in zip(c.token_ids, c.logprobs):
        assert top[0][0] == token and abs(top[0][1] - lp) < 1e-6 and lp <= 0 and len(top) == 2
    llama_engine.add_request("x", p, SamplingParams(max_tokens=50))
    llama_engine.step()
    llama_engine.abort_request("x")
    outs = llama_engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("x", "abort")]
    assert llama_engine.stats().kv_blocks_used == 0 and not llama_engine.has_unfinished_requests()
    with pytest.raises(UsageError, match="maximum model length"):
        llama_engine.add_request("y", p, SamplingParams(max_tokens=llama_engine.max_model_len))
    vocab = llama_engine.config.vocab_size
    for bad in ([*p, vocab], [-1, *p]):  # an id the embedding has no row for: refused, nothing queued
        with pytest.raises(UsageError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
            llama_engine.add_request("z", bad, SamplingParams(max_tokens=2))
    assert not llama_engine.has_unfinished_requests()
    llama_engine.add_request("z", [*p, vocab - 1], SamplingParams(max_tokens=1))  # the last id is fine
    assert [o.request_id for o in llama_engine.step() if o.finished] == ["z"]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_is_close_and_smaller(engine_llama_dir, llama_engine, kv_dtype):
    engine = Engine(engine_llama_dir, kv_memory=2 << 20, kv_dtype=kv_dtype)
    assert engine.cache.num_blocks > 3 * llama_engine.cache.num_blocks  # 1 byte + a scale per 16 vs 4 bytes
    ps = prompts()
    got = [c.token_ids for c in engine.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    ref = [c.token_ids for c in llama_engine.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(map(len, ref))
    assert agree > 0.7


def test_a_bf16_checkpoint_keeps_its_kv_cache_in_bf16_unless_asked(tiny_float_model):
    """auto (the default): a checkpoint saved in bf16 and run in float32 stores keys and values in
    bf16 (vLLM's auto; llama.cpp's f16 cache), half the bytes a token; f32 asks for the float32 pool,
    which a float32 checkpoint gets anyway; a bf16 model has no float32 pool to ask for."""
    bf16_ckpt = tiny_float_model(dtype=torch.bfloat16, name="bf16")
    f32_ckpt = tiny_float_model(dtype=torch.float32, name="f32")
    auto = Engine(bf16_ckpt, kv_memory=1 << 20)
    wide = Engine(bf16_ckpt, kv_memory=1 << 20, kv_dtype="f32")
    assert auto.kv_dtype == "bf16" and auto.cache.keys[0].dtype == torch.bfloat16 and auto.cache.fused_decode
    assert wide.cache.keys[0].dtype == torch.float32 and wide.cache.kv_dtype is None
    assert auto.cache.num_blocks in (2 * wide.cache.num_blocks, 2 * wide.cache.num_blocks + 1)
    assert Engine(bf16_ckpt, kv_memory=1 << 20, kv_dtype="auto").cache.keys[0].dtype == torch.bfloat16
    assert Engine(f32_ckpt, kv_memory=1 << 20).cache.keys[0].dtype == torch.float32
    assert Engine(bf16_ckpt, kv_memory=1 << 20, dtype=torch.bfloat16).cache.keys[0].dtype == torch.bfloat16
    with pytest.raises(UsageError, match="--kv-dtype f32 needs a float32 model"):
        Engine(bf16_ckpt, kv_memory=1 << 20, dtype=torch.bfloat16, kv_dtype="f32")
    # both pools decode the same greedy tokens here (a tiny random model; SmolLM2's KLD: docs/kv-cache.md)
    ps = prompts()
    assert [c.token_ids for c in auto.generate(ps, GREEDY)] == [c.token_ids for c in wide.generate(ps, GREEDY)]


def test_touch_kv_keeps_every_bit_and_covers_the_blocks_a_run_writes(engine_llama_dir):
    """The bench faults in blocks 0..n-1 before timing: that must leave the cache's contents alone
    (a cached prefix stays valid) and be the blocks a run of that size takes."""
    engine = Engine(engine_llama_dir, kv_memory=2 << 20)
    ps = prompts()
    engine.generate(ps, GREEDY)  # the pool now holds real keys and values
    before = [t.clone() for t in engine.cache.keys + engine.cache.values]
    engine.cache.keys[0][0, 0, 0] = -0.0  # a write that must survive bit for bit
    before[0][0, 0, 0] = -0.0
    engine.touch_kv(len(ps), max(map(len, ps)) + GREEDY.max_tokens)

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    for a, b in zip(before, engine.cache.keys + engine.cache.values):
        assert torch.equal(bits(a), bits(b))
    size = engine.cache.block_size
    touched = len(ps) * -(-(max(map(len, ps)) + GREEDY.max_tokens + engine.num_speculative_tokens + 1) // size)
    used = set()
    original = engine.block_manager._take_free_block

    def take():
        block = original()
        used.add(block)
        return block

    engine.block_manager._take_free_block = take
    engine.reset_prefix_cache()
    engine.generate(ps, GREEDY)
    assert used and max(used) < touched
