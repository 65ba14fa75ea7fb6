"""Speculative SAMPLING keeps the target's distribution: many seeded requests through a draft (an int4 copy of the target)
that often disagrees, the rank of each speculated token under the exact target distribution
(recomputed without cache) checked with a chi-square test."""

from __future__ import annotations

import torch

from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import process_logits
from lowbit.runtime.engine.sequence import SamplingParams

TOP_K = 4
CHI2_3DOF_P001 = 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_speculative_sampling_matches_target_distribution(engine_llama_dir):
    engine = Engine(engine_llama_dir, kv_memory=8 << 20, draft="self:int4", num_speculative_tokens=2)
    prompt = [40, 41, 42, 43, 44]
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=3, ignore_eos=True) for i in range(400)]
    completions = engine.generate([prompt] * len(params), params)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # both accept and reject paths ran

    observed = torch.zeros(TOP_K)
    expected = torch.zeros(TOP_K, dtype=torch.float64)
    with torch.inference_mode():
        for c in completions:
            ids = prompt + c.token_ids
            logits = engine.model(torch.tensor([ids]))[0]
            for pos in (len(prompt) + 1, len(prompt) + 2):  # tokens 2 and 3 come from verify passes
                probs = process_logits(logits[pos - 1 : pos], [params[0]], [[]]).softmax(-1)[0].double()
                ranked = probs.argsort(descending=True)
                rank = int((ranked == ids[pos]).nonzero())
                assert rank < TOP_K  # never a token the target gives zero probability
                observed[rank] += 1
                expected += probs[ranked[:TOP_K]]
    chi2 = float(((observed.double() - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_3DOF_P001, (observed.tolist(), expected.tolist(), chi2)
