"""The small pieces of `lowbit distill`: which windows a step sees, which layers go, the losses."""

from __future__ import annotations

import pytest
import torch

from lowbit.compress.distill.losses import kl_divergence, normalized_mse
from lowbit.compress.distill.shrink import layers_to_drop, parse_layer_list
from lowbit.compress.distill.windows import step_indices
from lowbit.errors import UsageError


def test_every_window_once_a_pass_in_an_order_fixed_by_seed_and_step():
    count, batch = 7, 3
    seen = [i for step in range(7) for i in step_indices(step, batch, count, seed=4)]  # 3 passes
    for p in range(3):
        assert sorted(seen[p * count:(p + 1) * count]) == list(range(count))
    assert seen[:count] != seen[count:2 * count]  # a fresh order each pass
    assert step_indices(5, batch, count, seed=4) == seen[15:18]  # a function of (seed, step) alone
    assert step_indices(0, batch, count, seed=5) != step_indices(0, batch, count, seed=4)


def test_layer_choice():
    assert parse_layer_list("3, 5,7-9", 12) == [3, 5, 7, 8, 9]
    assert layers_to_drop([0.5, 0.1, 0.9, 0.1, 0.3], keep=3) == [1, 3]
    for text, words in (("1,12", "outside"), ("a", "not a layer"), ("0-11", "all 12")):
        with pytest.raises(UsageError, match=words):
            parse_layer_list(text, 12)
    with pytest.raises(UsageError, match="between 1 and 4"):
        layers_to_drop([0.0] * 5, keep=5)


def test_losses_against_their_definitions():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    p, log_p, log_q = t.softmax(-1).double(), t.log_softmax(-1).double(), s.log_softmax(-1).double()
    reference = (p * (log_p - log_q)).sum(-1).mean()
    torch.testing.assert_close(kl_divergence(s, t, rows=3).double(), reference, atol=1e-6, rtol=1e-6)
    assert float(kl_divergence(t, t)) == pytest.approx(0.0, abs=1e-6)
    assert float(normalized_mse(2 * t, t)) == pytest.approx(1.0, rel=1e-6)
