"""Speculative SAMPLING keeps the target's distribution: many seeded requests through a draft (an int4 copy of the target)
that often disagrees, the rank of each speculated token under the exact target distribution
(recomputed without cache) checked with a chi-square test."""

from __future__ import annotations

from lowbit.runtime.engine.engine import Engine
from tests.runtime.engine.conftest import assert_speculative_sampling_keeps_distribution


def test_speculative_sampling_matches_target_distribution(engine_llama_dir):
    engine = Engine(engine_llama_dir, kv_memory=8 << 20, draft="self:int4", num_speculative_tokens=2)
    assert_speculative_sampling_keeps_distribution(engine, [40, 41, 42, 43, 44], top_k=4, requests=400)
