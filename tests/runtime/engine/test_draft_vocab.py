"""A draft head over the most frequent tokens only (runtime/engine/draft_vocab.py): the tokens are
counted right, the head scores exactly those, and speculation over it still gives the model's own
output, greedy token for token and sampled in distribution."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine import draft_vocab
from lowbit.runtime.engine.draft_models import RescoredHead, _draft_head
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from lowbit.runtime.tokenizer import load_tokenizer
from tests.runtime.engine.conftest import assert_speculative_sampling_keeps_distribution

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEXT = "the cat sat on the mat. " * 40 + "a dog ran far away! " * 10


@pytest.fixture
def frequency_text(tmp_path, monkeypatch):
    """A small frequency text and a private LOWBIT_HOME for the counts' cache."""
    path = tmp_path / "freq.txt"
    path.write_text(TEXT)
    monkeypatch.setattr(draft_vocab, "FREQUENCY_TEXT", str(path))
    monkeypatch.setenv("LOWBIT_HOME", str(tmp_path / "home"))
    return path


def test_sizes_auto_all_and_bad():
    assert draft_vocab.draft_vocab_size(None, 262144) == draft_vocab.AUTO_SIZE == 32768
    assert draft_vocab.draft_vocab_size(None, 49152) is None  # SmolLM2: the whole head (no gain measured)
    assert draft_vocab.draft_vocab_size(0, 262144) is None
    assert draft_vocab.draft_vocab_size(300, 256) is None  # as many as the vocabulary: all of it
    assert draft_vocab.draft_vocab_size(100, 256) == 100
    with pytest.raises(UsageError, match=r"--draft-vocab -1: give a token count"):
        draft_vocab.draft_vocab_size(-1, 256)


def test_most_frequent_tokens_with_eos_filled_in_id_order_and_cached(engine_llama_dir, frequency_text, monkeypatch):
    tok = load_tokenizer(engine_llama_dir)  # byte tokens: id i is byte i, EOS is 2
    counts = {}
    for b in TEXT.encode():
        counts[b] = counts.get(b, 0) + 1
    ranked = sorted(counts, key=lambda b: -counts[b])
    ids = draft_vocab.frequent_tokens(tok, 6, 256)
    assert ids.dtype == torch.long and ids.tolist() == sorted([2] + ranked[:5])
    # more than the text uses: every byte it saw, EOS, then the lowest unused ids
    many = draft_vocab.frequent_tokens(tok, len(counts) + 3, 256).tolist()
    assert set(many) == set(counts) | {0, 1, 2} and many == sorted(many)
    # keyed by the model's tokenizer.json where given (cheap), else by the whole vocabulary
    assert draft_vocab.frequent_tokens(tok, 6, 256, model_path=engine_llama_dir).tolist() == ids.tolist()
    cached = list((frequency_text.parent / "home" / "draft_vocab").glob("*.json"))
    assert len(cached) == 3 and all(isinstance(json.loads(p.read_text()), list) for p in cached)
    monkeypatch.setattr(type(tok), "encode", lambda *a, **k: pytest.fail("counted again instead of reading the cache"))
    assert draft_vocab.frequent_tokens(tok, 6, 256).tolist() == ids.tolist()
    assert draft_vocab.frequent_tokens(tok, 6, 256, model_path=engine_llama_dir).tolist() == ids.tolist()


def test_without_the_text_auto_keeps_the_head_and_a_number_is_an_error(engine_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(draft_vocab, "FREQUENCY_TEXT", str(tmp_path / "missing.txt"))
    monkeypatch.setattr(draft_vocab, "AUTO_ABOVE", 100)  # make the tiny vocabulary "large"
    tok = load_tokenizer(engine_llama_dir)
    assert draft_vocab.draft_vocabulary(tok, None, 256) is None
    with pytest.raises(UsageError, match=r"--draft-vocab 64: text not found"):
        draft_vocab.draft_vocabulary(tok, 64, 256)


def test_a_vocabulary_head_scores_only_its_tokens():
    torch.manual_seed(0)
    w = torch.randn(3000, 128)
    vocab = torch.tensor(sorted(torch.randperm(3000)[:500].tolist()))
    head = _draft_head(w, None, "cpu", "int8", vocab)
    assert isinstance(head, RescoredHead) and head.fast.out_features == 500
    x = torch.randn(5, 128)
    y = head(x)
    assert y.shape == (5, 3000)
    outside = torch.ones(3000, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(y[:, outside]).all() and torch.isfinite(y[:, vocab]).all()
    ref = x.double() @ w.double().T
    assert torch.equal(y.argmax(-1), vocab[ref[:, vocab].argmax(-1)])  # the float head's choice among them
    whole = _draft_head(w, None, "cpu", "int8")(x)
    assert not torch.equal(whole.argmax(-1), y.argmax(-1))  # restricting moved some choice (the test can fail)


def test_speculation_over_a_small_draft_vocabulary_keeps_greedy_output(engine_llama_dir, frequency_text):
    plain = Engine(engine_llama_dir, kv_memory=4 << 20)
    ps = [[40 + i, 41, 42 + 2 * i, 43, 44] for i in range(4)]
    expected = [c.token_ids for c in plain.generate(ps, GREEDY)]
    spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft="self:int8", num_speculative_tokens=3, draft_vocab=12)
    assert spec.draft_head_vocab == 12 and spec.drafter.model.lm_head.vocab.numel() == 12
    assert [c.token_ids for c in spec.generate(ps, GREEDY)] == expected
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # accepted and corrected drafts both
    assert Engine(engine_llama_dir, kv_memory=4 << 20, draft="self:int8").draft_head_vocab is None  # 256: all


def test_a_draft_checkpoint_head_is_restricted_and_reported_as_loaded(engine_llama_dir, engine_llama_draft_dir,
                                                                       frequency_text):
    spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft=str(engine_llama_draft_dir), draft_vocab=12)
    head = spec.drafter.model.lm_head
    assert isinstance(head, RescoredHead) and head.vocab.numel() == 12 == spec.draft_head_vocab
    layers = Engine(engine_llama_dir, kv_memory=4 << 20, draft="self:layers=1", draft_vocab=12)
    assert layers.draft_head_vocab is None  # the model's own head: nothing restricted, nothing reported


def test_speculative_sampling_over_a_small_draft_vocabulary_keeps_the_distribution(engine_llama_dir, frequency_text):
    engine = Engine(engine_llama_dir, kv_memory=8 << 20, draft="self:int4", num_speculative_tokens=2, draft_vocab=24)
    assert engine.draft_head_vocab == 24
    done = assert_speculative_sampling_keeps_distribution(engine, [40, 41, 42, 43, 44], top_k=4, requests=300)
    vocab = set(engine.drafter.model.lm_head.vocab.tolist())
    outside = sum(t not in vocab for c in done for t in c.token_ids)
    assert outside > 100  # most sampled tokens are ones the draft cannot propose: the rule's residual draws them


def test_a_cascade_keeps_the_whole_head(engine_llama_dir, frequency_text):
    from lowbit.runtime.cascade import CascadeSettings

    engine = Engine(engine_llama_dir, kv_memory=4 << 20, draft="self:int8", cascade=CascadeSettings(0.5),
                    draft_vocab=12)
    assert engine.draft_head_vocab is None and engine.drafter.model.lm_head.vocab is None


@pytest.mark.parametrize("draft, vocab", [("self:int8", 12), ("self:int8", 0), ("self:int4", 0), ("self:layers=1", None)])
def test_a_greedy_drafts_later_steps_in_one_call_propose_the_step_by_step_drafts(engine_llama_dir, frequency_text,
                                                                                  draft, vocab):
    """A greedy draft's steps after its first run in one C call (the rescored head's top 16, over the
    frequent tokens or all, mapped back to token ids, in C): the same drafts, so the same acceptance,
    as one step at a time, and the model's own output."""
    ps = [[40 + i, 41, 42 + 2 * i, 43, 44] for i in range(3)]
    runs = []
    for steps in (8, 1):
        spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft=draft, num_speculative_tokens=4, draft_vocab=vocab,
                      decode_steps=steps)
        calls, proposed = [], []
        real = spec.drafter.runner.decode_steps
        spec.drafter.runner.decode_steps = lambda works, n, head: calls.append(n) or real(works, n, head)

        def record(*args, propose=spec.drafter.propose, proposed=proposed):
            out = propose(*args)
            proposed.append([tokens for tokens, _, _ in out])
            return out

        spec.drafter.propose = record
        out = [c.token_ids for c in spec.generate(ps, GREEDY)]
        stats = spec.stats()
        runs.append((out, proposed, stats.spec_draft_tokens, stats.spec_accepted_tokens))
        assert bool(calls) == (steps > 1) and all(n > 1 for n in calls)
    assert runs[0] == runs[1]
    assert runs[0][0] == [c.token_ids for c in Engine(engine_llama_dir, kv_memory=4 << 20).generate(ps, GREEDY)]
