"""The token cascade in the engine (Engine(draft=CHEAP, cascade=CascadeSettings(T))): the cheap
model's token stands where its confidence is strictly above T, the model takes every position where
it is not (and every (run+1)-th: CascadeSettings.run); the model's one batched pass over a run of
drafts catches it up and decides the unsure ones at once, as a verify. Checked against from-scratch
forwards of both models, against the single-sequence CascadeDecoder (one model pass per unsure
position), batched and alone; threshold 1 is plain decoding token for token."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.cascade import CascadeSettings
from lowbit.runtime.early_exit import confidence_of
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams
from tests.runtime.cascade_reference import CascadeDecoder
from tests.runtime.test_cascade import dirs  # noqa: F401 - the fixture: a 3-layer model and a peaked 1-layer cheap one

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[40 + i for i in range(9)], [70, 71, 72], [100 + (i * 7) % 50 for i in range(21)]]


def _engine(dirs, threshold, k=4):
    return Engine(dirs[0], kv_memory=4 << 20, draft=str(dirs[1]), cascade=CascadeSettings(threshold, run=k))


def _median_confidence(cheap) -> float:
    ids = torch.tensor([sum(PROMPTS, [])])
    with torch.no_grad():
        return float(confidence_of(cheap(ids).float(), "top1").median())


def _models(engine):
    # the engine's own modules: the cheap model as it loads for a cascade (its head int8, as a draft's)
    return engine.model, engine.drafter.model


def _who_answered(engine, prompt, out, threshold):
    """For each generated token after the first: 'cheap' or 'full', from from-scratch forwards of
    both models over the whole sequence; asserts the token is that model's argmax."""
    full, cheap = _models(engine)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        f, c = full(ids).float()[0], cheap(ids).float()[0]
    conf = confidence_of(c, "top1")
    who = []
    for i in range(len(prompt), len(prompt) + len(out) - 1):  # logits at i predict token i + 1
        token = (prompt + out)[i + 1]
        if conf[i] > threshold and token == int(c[i].argmax()):
            who.append("cheap")
        else:
            assert token == int(f[i].argmax()), f"position {i + 1}: neither model's argmax"
            who.append("full")
    return who


def test_threshold_one_is_plain_decoding(dirs):
    plain = Engine(dirs[0], kv_memory=4 << 20)
    expected = [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    engine = _engine(dirs, 1.0)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == expected
    stats = engine.stats()
    assert stats.cascade_cheap_tokens == 0 and stats.cascade_full_tokens == 3 * (GREEDY.max_tokens - 1)


def test_threshold_zero_runs_k_cheap_tokens_then_one_of_the_model(dirs):
    engine = _engine(dirs, 0.0, k=3)
    for prompt in PROMPTS:
        out = engine.generate([prompt], GREEDY)[0].token_ids
        who = _who_answered(engine, prompt, out, 0.0)
        # top-1 > 0 always: runs of 3 cheap tokens, then the model's after catching up on them; the
        # last run is cut to what max_tokens leaves room for
        assert who == (["cheap"] * 3 + ["full"]) * 5 + ["cheap"] * 2 + ["full"]
    stats = engine.stats()
    assert stats.cascade_cheap_tokens == 3 * 17 and stats.cascade_full_tokens == 3 * 6


def test_a_middle_threshold_matches_the_single_sequence_cascade(dirs):
    engine = _engine(dirs, 0.5, k=32)  # longer than any run: only confidence ends one
    full, cheap = _models(engine)
    t = engine.cascade.threshold = _median_confidence(cheap)
    batched = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == batched
    mixed = 0
    for prompt, out in zip(PROMPTS, batched):
        who = _who_answered(engine, prompt, out, t)
        mixed += "cheap" in who and "full" in who
        dec = CascadeDecoder(full, cheap, CascadeSettings(t), 64)
        tokens = [int(dec.prefill(prompt).argmax())]
        while len(tokens) < GREEDY.max_tokens:
            tokens.append(int(dec.step(tokens[-1]).argmax()))
        # the last token is the model's in the engine (no room for a cheap run after it)
        assert tokens[:-1] == out[:-1] and who[-1] == "full"
    assert mixed >= 2  # the threshold splits the work, so the catch-up path is exercised


def test_the_cli_default_run_is_the_runtime_default():
    from lowbit.cli.common import CASCADE_RUN_OPTION
    from lowbit.runtime.cascade import DEFAULT_RUN

    assert CASCADE_RUN_OPTION.default == DEFAULT_RUN


def test_bad_cascades(dirs):
    with pytest.raises(UsageError, match="--cascade-run must be >= 1, got 0"):
        CascadeSettings(0.5, run=0)
    with pytest.raises(UsageError, match="a token cascade needs a cheap model"):
        Engine(dirs[0], kv_memory=4 << 20, draft="ngram", cascade=CascadeSettings(0.5))
    engine = _engine(dirs, 0.5)
    with pytest.raises(UsageError, match="logprobs are not reported under a token cascade"):
        engine.add_request("r", [40, 41], SamplingParams(max_tokens=4, logprobs=2))


def test_unsure_positions_share_the_models_passes(dirs):
    # the model decides a run's unsure drafts in its one pass over the run: fewer passes than the
    # positions it answered, each of which took a pass of its own before (and the same tokens)
    # (the model's own int8 copy as the cheap one: it agrees with the model where it is unsure)
    engine = Engine(dirs[0], kv_memory=4 << 20, draft="self:int8", cascade=CascadeSettings(0.5, run=32))
    full, cheap = _models(engine)
    t = engine.cascade.threshold = _median_confidence(cheap)
    before = engine.runner.num_forwards
    out = engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
    passes = engine.runner.num_forwards - before - 1  # less the prefill
    who = _who_answered(engine, PROMPTS[0], out, t)
    assert who.count("full") > passes and "cheap" in who


def test_a_sampled_cascade_keeps_sure_drafts_and_samples_the_rest(dirs):
    # sampling: sure drafts stand (their target row is the draft's own distribution, so the
    # rejection rule keeps them whatever it draws); at threshold 0 every draft is sure, so runs of
    # k cheap tokens then the model's, as greedy; at 0.5 the unsure ones go through the rule
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    engine = _engine(dirs, 0.0, k=3)
    outs = [engine.generate([p], sampled)[0].token_ids for p in PROMPTS]
    assert all(len(o) == sampled.max_tokens for o in outs)
    stats = engine.stats()
    assert stats.cascade_cheap_tokens == 3 * 17 and stats.cascade_full_tokens == 3 * 6
    again = _engine(dirs, 0.0, k=3)
    assert [again.generate([p], sampled)[0].token_ids for p in PROMPTS] == outs  # seeded: reproducible
    middle = _engine(dirs, 0.5, k=3)
    outs = [middle.generate([p], sampled)[0].token_ids for p in PROMPTS]
    assert all(len(o) == sampled.max_tokens for o in outs)
    stats = middle.stats()
    assert stats.cascade_cheap_tokens + stats.cascade_full_tokens == 3 * (sampled.max_tokens - 1)
