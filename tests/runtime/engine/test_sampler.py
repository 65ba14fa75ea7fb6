import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lowbit.errors import UsageError
from lowbit.runtime.engine.sampler import Sampler, process_logits, sample
from lowbit.runtime.engine.sequence import SamplingParams, Sequence

# A hand-made distribution, shuffled so rank != token id.
PROBS = {3: 0.40, 0: 0.25, 5: 0.15, 1: 0.10, 4: 0.06, 2: 0.04}
LOGITS = torch.tensor([[math.log(PROBS[i]) for i in range(6)]])


def kept(**kw):
    x = process_logits(LOGITS, [SamplingParams(**kw)], [[]])
    return sorted(torch.isfinite(x[0]).nonzero().flatten().tolist())


def test_greedy_is_argmax():
    logits = torch.randn(7, 300)
    out = sample(logits, [SamplingParams(temperature=0)] * 7, [[]] * 7)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_filters_on_hand_made_distribution():
    assert kept() == [0, 1, 2, 3, 4, 5]
    assert kept(top_k=1) == [3]
    assert kept(top_k=3) == [0, 3, 5]
    # top-p: a token stays while the mass ranked above it is < p (0, 0.40, 0.65, 0.80, ...).
    assert kept(top_p=0.39) == [3]
    assert kept(top_p=0.41) == [0, 3]
    assert kept(top_p=0.64) == [0, 3]
    assert kept(top_p=0.66) == [0, 3, 5]
    assert kept(top_p=0.79) == [0, 3, 5]
    assert kept(top_p=0.81) == [0, 1, 3, 5]
    # min-p: p >= min_p * 0.40.
    assert kept(min_p=0.5) == [0, 3]
    assert kept(min_p=0.2) == [0, 1, 3, 5]
    # top-p runs on the distribution renormalised after top-k: {0.40, 0.25} -> {0.615, 0.385},
    # so p=0.6 keeps one token (over the raw distribution it would keep two).
    assert kept(top_k=2, top_p=0.6) == [3]
    # Temperature changes the ratios min-p compares: T=2 gives sqrt(p) ratios, 0.25 -> 0.79.
    assert kept(min_p=0.6, temperature=2.0) == [0, 3, 5]


def test_processing_matches_transformers_warpers():
    torch.manual_seed(1)
    logits = torch.randn(4, 500) * 3
    histories = [[1, 5, 5, 400], [], [7, 8, 9], [499, 0]]
    params = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=10, min_p=0.05, repetition_penalty=0.8),
        SamplingParams(min_p=0.1, repetition_penalty=2.0),
    ]
    ours = process_logits(logits, params, histories)
    for row, (p, h) in enumerate(zip(params, histories)):
        ids = torch.tensor([h or [0]])
        x = logits[row : row + 1].clone()
        if h and p.repetition_penalty != 1:
            x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
        if p.top_k:
            x = TopKLogitsWarper(p.top_k)(ids, x)
        if p.top_p < 1:
            x = TopPLogitsWarper(p.top_p)(ids, x)
        if p.min_p:
            x = MinPLogitsWarper(p.min_p)(ids, x)
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(x[0])), row
        finite = torch.isfinite(x[0])
        torch.testing.assert_close(ours[row][finite], x[0][finite], rtol=1e-6, atol=1e-6)


def test_repetition_penalty_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    x = process_logits(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1, 1, 4]])
    assert x[0].tolist() == [1.0, -2.0, 0.5, 3.0, -8.0]
    # Greedy rows use the penalised logits too.
    out = sample(torch.tensor([[3.0, 2.0]]), [SamplingParams(temperature=0, repetition_penalty=2.0)], [[0]])
    assert out.token_ids == [1]


def test_sampled_frequencies_follow_the_processed_distribution():
    n = 40_000
    logits = LOGITS.expand(n, 6)
    params = [SamplingParams(temperature=0.5, top_k=4)] * n
    out = sample(logits, params, [[]] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=6).double() / n
    expected = process_logits(LOGITS, params[:1], [[]]).softmax(-1)[0].double()
    assert freq[1].item() > 0.01 and freq[2] == 0 and freq[4] == 0  # 4th kept, 5th/6th cut
    assert (freq - expected).abs().max().item() < 0.01


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(5, 1000) for _ in range(6)]

    def run(rows, seeded_row):
        sampler = Sampler()
        seqs = [Sequence(f"s{i}", [1], SamplingParams(seed=1234 if i == seeded_row else None)) for i in range(rows)]
        tokens = []
        for logits in steps:
            # the seeded sequence always sees the same logits row; its neighbours vary
            batch = torch.randn(rows, 1000)
            batch[seeded_row] = logits[0]
            tokens.append(sampler(batch, seqs).token_ids[seeded_row])
        return tokens

    alone = run(1, 0)
    assert run(4, 2) == alone and run(3, 0) == alone
    assert len(set(alone)) > 1  # really sampling, not collapsing to one token
    # Different seeds give different streams.
    first_tokens = {Sampler()(steps[0][:1], [Sequence("y", [1], SamplingParams(seed=s))]).token_ids[0] for s in range(20)}
    assert len(first_tokens) > 5


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=5.0, top_k=2, logprobs=0),
              SamplingParams(temperature=0)]
    out = sample(logits, params, [[]] * 3)
    raw = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0].max().item(), abs=1e-6)
    assert [t for t, _ in first.top] == raw[0].topk(3).indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(raw[0].topk(3).values.tolist(), abs=1e-6)
    second = out.logprobs[1]
    assert second.top == [] and second.logprob == pytest.approx(raw[1, out.token_ids[1]].item(), abs=1e-6)
    assert out.token_ids[1] in raw[1].topk(2).indices.tolist()
    assert out.logprobs[2] is None


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed=-3), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop strings"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_params_raise_usage_error(bad, message):
    with pytest.raises(UsageError, match=message):
        SamplingParams(**bad)


def test_draw_follows_the_distribution_and_never_picks_a_zero(monkeypatch):
    from lowbit.runtime.engine import sampler as sampler_module

    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    n = 40000
    counts = torch.bincount(sampler_module.draw(p.repeat(n, 1), [None] * n), minlength=6).double() / n
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts, p.double(), atol=0.01), counts
    # a seeded row draws from its own generator: the same token whatever the other rows
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    alone = sampler_module.draw(p[None], [g()])
    assert sampler_module.draw(p.repeat(5, 1), [None, None, g(), None, None])[2] == alone[0]
    # rows without a distribution (NaN, all zero) still give a token id inside the vocabulary
    for row in (torch.full((1, 5), float("nan")), torch.zeros(1, 5)):
        assert 0 <= int(sampler_module.draw(row, [None])[0]) < 5
    # u at its largest, and u * total equal to the total (the guard): the last token of probability > 0
    real_rand = torch.rand
    for u in (1.0 - 2.0**-24, 1.0):
        monkeypatch.setattr(torch, "rand", lambda *a, _u=u, **k: real_rand(*a, **k).fill_(_u))
        assert sampler_module.draw(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), [None]).tolist() == [1]
