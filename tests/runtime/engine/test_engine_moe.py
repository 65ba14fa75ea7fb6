"""The engine's exactness properties (tests/runtime/engine/test_engine.py) on tiny MoE models, greedy
fp32: paged == contiguous == full recompute, batched == alone, chunked prefill == whole, prefix-cache
hit == miss. Qwen2-MoE brings a shared expert and a dense layer, OLMoE full-width q/k norms."""

from __future__ import annotations

import pytest

from lowbit.runtime.engine import paged_attention
from lowbit.runtime.engine.engine import Engine
from tests.runtime.engine.test_engine import GREEDY, check_paged_contiguous_batched_alone, prompts
from tests.runtime.moe_models import save_moe


@pytest.fixture(scope="module", params=["qwen2_moe", "olmoe"])
def moe_dir(request, tmp_path_factory):
    return save_moe(request.param, tmp_path_factory.mktemp(request.param))[0]


@pytest.fixture(scope="module")
def moe_engine(moe_dir):
    return Engine(moe_dir, kv_memory=2 << 20)


def test_paged_equals_contiguous_and_recompute_batched_and_alone(moe_engine):
    check_paged_contiguous_batched_alone(moe_engine)


def test_chunked_prefill_and_tiled_attention(moe_dir, moe_engine, monkeypatch):
    monkeypatch.setattr(paged_attention, "PREFILL_TILE", 8)
    engine = Engine(moe_dir, kv_memory=2 << 20, max_num_batched_tokens=12, enable_prefix_caching=False)
    ps = prompts()
    assert [c.token_ids for c in engine.generate(ps, GREEDY)] == [c.token_ids for c in moe_engine.generate(ps, GREEDY)]


def test_prefix_cache_hit_equals_miss(moe_engine):
    p = prompts(3)[2]  # 40 tokens: two full blocks can be reused
    first = moe_engine.generate([p], GREEDY)[0]
    before = moe_engine.stats().prefix_cache_hits
    second = moe_engine.generate([p], GREEDY)[0]
    assert second.num_cached_tokens == 32 and moe_engine.stats().prefix_cache_hits - before == 32
    assert second.token_ids == first.token_ids


def test_decode_bytes_count_only_the_routed_experts(moe_engine):
    # the roofline `lowbit bench` reports: a token reads top_k of each block's experts, not all of them
    from lowbit.runtime.engine.benchmark import decode_weight_bytes, weight_bytes
    from lowbit.runtime.models.moe import SparseMoE

    model = moe_engine.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks
    skipped = sum(weight_bytes(b.experts) * (1 - b.top_k / len(b.experts)) for b in blocks)
    embed = model.model.embed_tokens.weight
    dense = weight_bytes(model) - embed.numel() * embed.element_size()  # untied: the table is read by rows
    assert decode_weight_bytes(model) == pytest.approx(dense - skipped, abs=len(blocks))


def test_multi_step_decode_equals_single_steps(moe_dir):
    # routed experts per row inside each C call of several greedy steps (runtime/engine/multi_step.py)
    ps = prompts()
    multi, single = Engine(moe_dir, kv_memory=2 << 20, decode_steps=8), Engine(moe_dir, kv_memory=2 << 20, decode_steps=1)
    got = [c.token_ids for c in multi.generate(ps, GREEDY)]
    assert multi.num_multi_steps > 0
    assert got == [c.token_ids for c in single.generate(ps, GREEDY)]
