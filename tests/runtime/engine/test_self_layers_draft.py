"""`--draft self:layers=N`: the target's first N layers + its final norm and head draft over the
target's own KV cache. Greedy output equals plain decoding token for token (batched and alone),
every draft equals what the N-layer prefix computes from scratch (so the shared KV is never stale),
sampled output keeps the target's distribution, and bad N is a one-line error."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine.drafter import LayerPrefixDrafter
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.conftest import _llama_config, build_hf
from tests.runtime.engine.conftest import assert_speculative_sampling_keeps_distribution, save_with_tokenizer

LAYERS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_llama_4l")
    save_with_tokenizer(build_hf(_llama_config(num_hidden_layers=LAYERS)), path)
    return path


def prompts():
    return [[40 + i for i in range(9)], [70, 71, 72], [100 + (i * 7) % 50 for i in range(21)]]


@pytest.fixture(scope="module")
def plain(deep_llama_dir):
    return Engine(deep_llama_dir, kv_memory=4 << 20)


@pytest.mark.parametrize("n", [1, 3])
def test_greedy_equals_plain_batched_and_alone(n, deep_llama_dir, plain):
    ps = prompts()
    expected = [c.token_ids for c in plain.generate(ps, GREEDY)]
    spec = Engine(deep_llama_dir, kv_memory=4 << 20, draft=f"self:layers={n}", num_speculative_tokens=3)
    assert isinstance(spec.drafter, LayerPrefixDrafter)
    assert [c.token_ids for c in spec.generate(ps, GREEDY)] == expected  # batched
    assert [spec.generate([p], GREEDY)[0].token_ids for p in ps] == expected  # alone
    stats = spec.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    # no weights and no KV of its own: the same tensors, the same number of KV blocks as plain decoding
    view = spec.drafter.model
    assert len(view.model.layers) == n and len(spec.model.model.layers) == LAYERS
    assert view.model.layers[0] is spec.model.model.layers[0] and view.lm_head is spec.model.lm_head
    assert view.model.norm is spec.model.model.norm
    assert spec.block_manager.num_blocks == plain.block_manager.num_blocks


def test_every_draft_is_the_prefix_models_from_scratch(deep_llama_dir, monkeypatch):
    spec = Engine(deep_llama_dir, kv_memory=4 << 20, draft="self:layers=2", num_speculative_tokens=3)
    view = spec.drafter.model
    seen = []
    propose = spec.drafter.propose

    def recording(items, drafting, unsure=None):
        out = propose(items, drafting, unsure)
        seen.extend((list(seq.token_ids), drafts) for (seq, _), (drafts, _, _) in zip(drafting, out))
        return out

    monkeypatch.setattr(spec.drafter, "propose", recording)
    spec.generate(prompts(), GREEDY)
    assert len(seen) > 10
    with torch.inference_mode():
        for context, drafts in seen:
            ids = context + drafts
            # the N-layer model without any cache: its argmax after each prefix is the draft
            logits = view(torch.tensor([ids[:-1]]))[0, len(context) - 1 :]
            assert logits.argmax(-1).tolist() == drafts


def test_sampling_keeps_the_target_distribution(deep_llama_dir):
    engine = Engine(deep_llama_dir, kv_memory=8 << 20, draft="self:layers=1", num_speculative_tokens=2)
    assert_speculative_sampling_keeps_distribution(engine, [40, 41, 42, 43, 44], top_k=4, requests=200)


@pytest.mark.parametrize("draft, message", [("self:layers=0", "between 1 and 3"), ("self:layers=4", "between 1 and 3"),
                                            ("self:layers=-2", "between 1 and 3"), ("self:layers=x", "integer"),
                                            ("self:layers=", "integer")])
def test_bad_layer_count_is_a_usage_error(draft, message, deep_llama_dir):
    with pytest.raises(UsageError, match=message):
        Engine(deep_llama_dir, kv_memory=4 << 20, draft=draft)
