"""logit_bias, presence/frequency penalties and min_tokens: the sampler against references
computed by hand in float64, the engine's use of them (alone, batched, under speculative decoding)."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import process_logits, sample
from lowbit.runtime.engine.sequence import SamplingParams

EOS = 2  # the tiny engine models' EOS


def reference(logits, p: SamplingParams, history, output, eos_ids=()):
    """The documented order, one row, float64, written out by hand."""
    x = logits.double().clone()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(history):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        count = output.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x / (p.temperature if p.temperature > 0 else 1.0)


def test_penalties_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5, -1.0]])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 2.5, 0: -100})
    x = process_logits(logits, [p], [[0, 1, 2, 2, 1, 2]], [[2, 2, 1, 2]])
    # token 2 seen 3 times: 3 - 0.5*3 - 0.25; token 1 once: 2 - 0.5 - 0.25; prompt-only token 0 untouched
    # by the penalties (they count generated tokens only), but biased by -100
    assert x[0].tolist() == [-99.0, 1.25, 1.25, 0.5, 1.5]
    # negative penalties reward repetition
    x = process_logits(logits, [SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0)], [[]], [[3, 3]])
    assert x[0].tolist() == [1.0, 2.0, 3.0, 4.5, -1.0]


def test_batched_processing_matches_float64_reference():
    torch.manual_seed(0)
    V = 300
    logits = torch.randn(6, V) * 4
    rows = [
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, temperature=0.8), [5, 9, 9], [9, 9, 17, 17, 17]),
        (SamplingParams(logit_bias={3: 7.5, 299: -100.0, 10: 0.25}), [1, 2], [4]),
        (SamplingParams(temperature=0), [], []),  # untouched neighbour
        (SamplingParams(repetition_penalty=1.3, frequency_penalty=2.0, logit_bias={9: -3.0}), [9, 8, 7], [9, 9, 1]),
        (SamplingParams(min_tokens=3, stop_token_ids=(11, 12), logit_bias={EOS: 5.0}), [4], [6, 6]),
        (SamplingParams(min_tokens=3, stop_token_ids=(11,), ignore_eos=True, presence_penalty=1.5), [4], [6, 7]),
    ]
    params, histories, outputs = (list(col) for col in zip(*rows))
    ours = process_logits(logits, params, histories, outputs, eos_ids={EOS})
    for row, (p, h, o) in enumerate(rows):
        ref = reference(logits[row], p, h, o, {EOS})
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref)), row
        finite = torch.isfinite(ref)
        torch.testing.assert_close(ours[row][finite].double(), ref[finite], rtol=1e-6, atol=1e-5)
        # a row alone gives the same numbers as inside the batch
        alone = process_logits(logits[row : row + 1], [p], [h], [o], eos_ids={EOS})
        assert torch.equal(alone[0], ours[row])
    assert torch.isinf(ours[4, [EOS, 11, 12]]).all() and torch.isinf(ours[5, 11]) and torch.isfinite(ours[5, EOS])


def test_min_tokens_lifts_once_reached_and_bias_decides_greedy():
    logits = torch.zeros(1, 8)
    p = SamplingParams(temperature=0, min_tokens=2, logit_bias={EOS: 100.0})
    assert sample(logits, [p], [[]], outputs=[[5]], eos_ids={EOS}).token_ids != [EOS]  # held back at 1 < 2
    assert sample(logits, [p], [[]], outputs=[[5, 5]], eos_ids={EOS}).token_ids == [EOS]
    banned = SamplingParams(temperature=0, logit_bias={int(logits.argmax()): -100.0})
    forced = SamplingParams(temperature=0.9, seed=1, logit_bias={6: 100.0})
    out = sample(torch.tensor([[3.0, 0.0, 1.0, 0, 0, 0, 0, 0]] * 2), [banned, forced], [[], []])
    assert out.token_ids == [2, 6]  # 3 - 100 loses to 1.0; +100 beats everything even sampling


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {1: 101}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"), ({"guided_json": 7}, "guided_json"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(UsageError, match=f"^{field}"):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def engine(engine_llama_dir):
    return Engine(engine_llama_dir, kv_memory=4 << 20)


def test_engine_min_tokens_and_bias(engine):
    prompt = [40, 41, 42, 43]
    forced_eos = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={EOS: 100.0})
    done = engine.generate([prompt], forced_eos)[0]
    assert done.finish_reason == "stop" and len(done.token_ids) == 6 and done.token_ids[-1] == EOS
    assert EOS not in done.token_ids[:5]
    only = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logit_bias={77: 100.0}))[0]
    assert only.token_ids == [77] * 4
    with pytest.raises(UsageError, match="logit_bias token id"):
        engine.add_request("x", prompt, SamplingParams(logit_bias={10**6: 1.0}))


PENALISED = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={50: 1.5, 51: -3.0}, min_tokens=10),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=-0.5, repetition_penalty=1.2),
]


def test_speculative_with_penalties_equals_plain(engine, engine_llama_dir):
    prompts = [[40, 41, 42, 43, 40, 41, 42, 43], [60, 61, 62, 60, 61, 62, 60], [7, 8, 9, 7, 8, 9, 7, 8]]
    expected = [c.token_ids for c in engine.generate(prompts, PENALISED)]
    # each penalised output differs from the plain greedy one: the knobs really act
    plain = [c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]
    assert all(e != p for e, p in zip(expected, plain))
    spec = Engine(engine_llama_dir, kv_memory=4 << 20, draft="self:int8", num_speculative_tokens=3)
    got = [c.token_ids for c in spec.generate(prompts, PENALISED)]
    assert got == expected
    assert spec.stats().spec_accepted_tokens > 0
