import torch

from lowbit.runtime.engine.speculative import (
    AdaptiveK,
    SpecStats,
    emitted_tokens,
    ngram_propose,
    rejection_sample,
    verify_greedy,
)

N_DRAWS = 200_000
# Five sigma of a frequency estimated from N_DRAWS draws is at most 5 * sqrt(0.25 / N) = 0.0056.
TOLERANCE = 0.006


def t(rows):
    return torch.tensor(rows)


def test_greedy_hand_made_cases():
    target = t([
        [5, 6, 7, 8],  # all three drafts agree: 3 accepted + bonus
        [5, 6, 7, 8],  # second draft wrong: 1 accepted, then the target's 6
        [5, 6, 7, 8],  # first wrong: only the target's token
        [5, 6, 7, 8],  # agrees after a disagreement: still stops at the first one
    ])
    draft = t([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 0, 7]])
    tokens, n = verify_greedy(draft, target)
    assert n.tolist() == [3, 1, 0, 1]
    assert emitted_tokens(tokens, n) == [[5, 6, 7, 8], [5, 6], [5], [5, 6]]
    assert tokens[2].tolist() == [5, -1, -1, -1]


def test_greedy_with_shorter_drafts_in_a_padded_batch():
    target = t([[5, 6, 7, 8], [5, 6, 7, 8]])
    draft = t([[5, 6, 0], [5, 6, 7]])
    tokens, n = verify_greedy(draft, target, num_draft=t([2, 2]))
    # Row 0's padding is ignored (2 real drafts both accepted, bonus = target[2]); row 1's third
    # draft would agree but is not a real draft.
    assert n.tolist() == [2, 2]
    assert emitted_tokens(tokens, n) == [[5, 6, 7], [5, 6, 7]]


def test_greedy_with_no_draft():
    tokens, n = verify_greedy(torch.zeros(2, 0, dtype=torch.long), t([[4], [9]]))
    assert n.tolist() == [0, 0] and emitted_tokens(tokens, n) == [[4], [9]]


def _distributions():
    p_target = torch.tensor([[0.30, 0.05, 0.20, 0.02, 0.08, 0.15, 0.10, 0.10],
                             [0.01, 0.40, 0.04, 0.15, 0.10, 0.10, 0.10, 0.10],
                             [0.125] * 8])
    p_draft = torch.tensor([[0.05, 0.40, 0.05, 0.20, 0.10, 0.05, 0.05, 0.10],
                            [0.30, 0.05, 0.05, 0.05, 0.25, 0.10, 0.10, 0.10]])
    return p_target, p_draft


def _frequencies(tokens):
    return torch.bincount(tokens, minlength=8).double() / len(tokens)


def test_rejection_sampling_reproduces_the_target_distribution():
    p_target, p_draft = _distributions()
    g = torch.Generator().manual_seed(0)
    draft = torch.stack([torch.multinomial(p_draft[i], N_DRAWS, replacement=True, generator=g) for i in range(2)], 1)
    tokens, n = rejection_sample(draft, p_target.expand(N_DRAWS, 3, 8), p_draft.expand(N_DRAWS, 2, 8), generator=g)
    first = tokens[:, 0]
    assert (first >= 0).all()
    assert (_frequencies(first) - p_target[0]).abs().max() < TOLERANCE
    # The draft alone would be far off: the test can tell the two apart.
    assert (_frequencies(draft[:, 0]) - p_target[0]).abs().max() > 10 * TOLERANCE
    # The second token exists when the first draft was accepted, and follows p_target[1].
    second = tokens[n >= 1, 1]
    assert (_frequencies(second) - p_target[1]).abs().max() < TOLERANCE
    # The bonus token after two accepted drafts follows p_target[2].
    assert (_frequencies(tokens[n == 2, 2]) - p_target[2]).abs().max() < 3 * TOLERANCE
    # Acceptance probability of one draft = sum(min(p_target, p_draft)) = 1 - total variation.
    accepted_first = (n >= 1).double().mean().item()
    assert abs(accepted_first - torch.minimum(p_target[0], p_draft[0]).sum().item()) < TOLERANCE


def test_rejection_sampling_with_a_deterministic_drafter():
    p_target, _ = _distributions()
    draft = torch.full((N_DRAWS, 1), 0)  # an n-gram drafter always proposes token 0
    g = torch.Generator().manual_seed(1)
    tokens, n = rejection_sample(draft, p_target[:2].expand(N_DRAWS, 2, 8), None, generator=g)
    assert (_frequencies(tokens[:, 0]) - p_target[0]).abs().max() < TOLERANCE
    assert abs((n == 1).double().mean().item() - p_target[0, 0].item()) < TOLERANCE


def test_rejection_sampling_exact_cases():
    # A draft the target gives probability 1 is always accepted; probability 0, never.
    one_hot = torch.zeros(1, 3, 4)
    one_hot[0, 0, 2] = one_hot[0, 1, 1] = one_hot[0, 2, 3] = 1.0
    tokens, n = rejection_sample(t([[2, 1]]), one_hot, torch.full((1, 2, 4), 0.25))
    assert n.tolist() == [2] and tokens.tolist() == [[2, 1, 3]]
    tokens, n = rejection_sample(t([[0, 1]]), one_hot, torch.full((1, 2, 4), 0.25))
    assert n.tolist() == [0] and tokens.tolist() == [[2, -1, -1]]
    # Padding beyond num_draft is never accepted; the bonus comes from the next position.
    tokens, n = rejection_sample(t([[2, 1]]), one_hot, None, num_draft=t([1]))
    assert n.tolist() == [1] and tokens.tolist() == [[2, 1, -1]]


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    # The latest earlier occurrence wins.
    assert ngram_propose([1, 2, 5, 1, 2, 6, 1, 2], k=1) == [6]
    # Longer n-grams take precedence over more recent shorter ones.
    assert ngram_propose([7, 8, 9, 1, 0, 8, 9, 2, 7, 8, 9], k=2) == [1, 0]
    assert ngram_propose([7, 8, 9, 1, 0, 8, 9, 2, 7, 8, 9], k=2, max_ngram=2) == [2, 7]
    # Fewer than k tokens may follow; a continuation can run into the suffix itself.
    assert ngram_propose([4, 5, 6, 4, 5], k=5) == [6, 4, 5]
    assert ngram_propose([3, 3, 3], k=4) == [3]
    assert ngram_propose([1, 2, 3], k=3) == []
    assert ngram_propose([1], k=3) == []
    assert ngram_propose([1, 2, 1], k=3, min_ngram=2) == []


def test_adaptive_k_and_stats():
    ak = AdaptiveK(k=3, k_min=1, k_max=4)
    assert ak.update(3, 3) == 4 and ak.update(4, 4) == 4
    assert ak.update(4, 1) == 3 and ak.update(3, 2) == 3
    stats = SpecStats()
    for drafted, accepted in [(4, 4), (4, 0), (4, 2)]:
        stats.record(drafted, accepted)
    assert stats.mean_accepted_length == (6 + 3) / 3
    assert stats.acceptance_rate == 6 / 12
