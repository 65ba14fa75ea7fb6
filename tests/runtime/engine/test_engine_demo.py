"""The engine on SmolLM2-135M (demo asset): paged greedy == contiguous greedy, speculative ==
plain, and a second chat turn reuses the first turn's KV blocks."""

from __future__ import annotations

import pytest
import torch

from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.engine.test_engine import contiguous_greedy

pytestmark = pytest.mark.demo
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return Engine(smollm2_dir, kv_memory=64 << 20, max_num_seqs=4)


def test_paged_equals_contiguous_and_ngram_speculation(engine, smollm2_dir):
    tok = engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    if n < 2:\n        return n")]
    got = engine.generate(prompts, GREEDY)
    for p, c in zip(prompts, got):
        assert c.token_ids == contiguous_greedy(engine.model, p, len(c.token_ids))
    spec = Engine(smollm2_dir, kv_memory=64 << 20, max_num_seqs=4, draft="ngram")
    assert spec.generate(prompts[1:], GREEDY)[0].token_ids == got[1].token_ids
    assert spec.stats().spec_draft_tokens > 0


def test_second_chat_turn_hits_the_first_turns_blocks(engine):
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    turn1 = tok.encode(tok.apply_chat_template(messages), add_bos=False)
    reply = engine.generate([turn1], SamplingParams(temperature=0, max_tokens=12))[0]
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And two more?"}]
    turn2 = tok.encode(tok.apply_chat_template(messages), add_bos=False)
    shared = next(i for i, (a, b) in enumerate(zip(turn1, turn2)) if a != b) if turn2[: len(turn1)] != turn1 else len(turn1)
    before = engine.stats().prefix_cache_hits
    out = engine.generate([turn2], SamplingParams(temperature=0, max_tokens=4))[0]
    # every full block of the first turn's prompt is found again (the reply's blocks too when re-tokenized alike)
    assert out.num_cached_tokens >= (shared // 16) * 16 > 0
    assert engine.stats().prefix_cache_hits - before == out.num_cached_tokens
    with torch.inference_mode():
        assert out.token_ids == contiguous_greedy(engine.model, turn2, len(out.token_ids))
