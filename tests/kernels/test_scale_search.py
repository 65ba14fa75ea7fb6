"""native/scale_search.c: every candidate's weighted squared error against a float64 torch
computation of the same formula, and the search it drives (quant/intq.py) against torch's
search_best: the same choice in every group but near-ties, where both choices score the same."""

from __future__ import annotations

import pytest
import torch

from lowbit.native import scale_search as cpu_scale_search
from lowbit.quant import get_format, parse_spec


def reference_errors(x, weight, scales, zeros, mid, top):
    s = scales.unsqueeze(-1)
    z = mid if zeros is None else zeros.unsqueeze(-1)
    d = torch.where(s == 0, torch.ones_like(s), s)
    q = (torch.round(x.unsqueeze(0) / d) + z).clamp(0, top)
    diff = (q - z) * s - x.unsqueeze(0)
    t = diff * diff
    if weight is not None:
        t = t * weight.unsqueeze(0)
    return t.double().sum(-1)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("weighted", [False, True], ids=["equal", "weighted"])
@pytest.mark.parametrize("g", [7, 16, 24, 64])
def test_errors_match_a_float64_sum_of_the_same_terms(g, weighted, asymmetric):
    assert cpu_scale_search.available(), "the C library did not build"
    gen = torch.Generator().manual_seed(g)
    x = torch.randn(40, 6, g, generator=gen)
    weight = torch.rand(1, 6, g, generator=gen) if weighted else None
    amax = x.abs().amax(-1)
    scales = torch.stack([amax / 7.5 * r for r in (1.0, 0.9, 0.8, 1.1)])
    scales[0, 0, 0] = 0.0  # an all-zero group's scale: divides as 1
    zeros = torch.randint(0, 16, scales.shape, generator=gen).float() if asymmetric else None
    got = cpu_scale_search.candidate_errors(x, weight, scales, zeros, 8.0, 15.0)
    want = reference_errors(x, weight, scales, zeros, 8.0, 15.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("fmt_name", ["int4-g64", "int4-asym-g32", "int4-g128-dq", "int4-asym-g32-dq", "int3-asym-g32", "int8"])
def test_search_picks_what_torch_picks_but_for_near_ties(fmt_name, monkeypatch):
    spec = parse_spec(fmt_name)
    fmt = get_format(spec)
    w = 0.05 * torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    w[:, 5] *= 20  # an outlier channel
    stats = torch.rand(256, generator=torch.Generator().manual_seed(4)) * 3
    fast = fmt.compute_scales(w, spec, stats=stats)
    monkeypatch.setattr(cpu_scale_search, "available", lambda: False)
    slow = fmt.compute_scales(w, spec, stats=stats)
    same = fast.scale == slow.scale
    if fast.zero is not None:
        same &= fast.zero == slow.zero
    g = fast.group_size

    def group_error(sc, r, j):
        cols = slice(j * g, (j + 1) * g)
        z = None if sc.zero is None else sc.zero[r, j]
        _, q = fmt.quantize_group_values(w[r, cols], sc.scale[r, j], z, spec)
        return float(((q - w[r, cols]) ** 2 * stats[cols]).double().sum())

    if spec.double_quant:
        # a near-tie in the first search can move a row's scale step, and with it the whole row's
        # grid (either way: neither search is optimal for the row as a whole); the rows stay
        # within a percent and the matrix within 0.01 %
        assert same.float().mean() > 0.98
        changed = (~same).any(1).nonzero().flatten().tolist()
        totals = [[sum(group_error(sc, r, j) for j in range(same.shape[1])) for r in changed] for sc in (fast, slow)]
        for a, b in zip(*totals):
            assert a == pytest.approx(b, rel=1e-2)
        whole = [sum(group_error(sc, r, j) for r in range(w.shape[0]) for j in range(same.shape[1])) for sc in (fast, slow)]
        assert whole[0] == pytest.approx(whole[1], rel=1e-4)
        return
    assert same.float().mean() > 0.995
    for r, j in zip(*(t.tolist() for t in (~same).nonzero(as_tuple=True))):
        assert group_error(fast, r, j) == pytest.approx(group_error(slow, r, j), rel=1e-5)  # a near-tie
