"""Outlier protection: which weights are kept, the side matrix round trip and its bit cost, and
that keeping the salient weights lowers the output error of every 4-bit format."""

from __future__ import annotations

import pytest
import torch

from lowbit.quant import get_format, parse_spec
from lowbit.compress.gptq import output_error
from lowbit.compress.outliers import outlier_mask, salience
from lowbit.quant.outlier_matrix import outlier_bits, pack_outliers, unpack_outliers
from lowbit.compress.stats import StatsAccumulator


def _stats(k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, k, generator=gen) * torch.linspace(0.2, 4.0, k)
    acc = StatsAccumulator(k)
    acc.add(x)
    return acc.finish()


def test_mask_keeps_the_most_salient_weights():
    stats = _stats(64)
    w = 0.05 * torch.randn(32, 64)
    w[5, 3] = 2.0  # large weight on a quiet channel: |w|·sqrt(E[x²]) still ranks it first
    mask = outlier_mask(w, stats, 1.0)
    assert int(mask.sum()) == round(32 * 64 * 0.01)
    assert mask[5, 3]
    score = salience(w, stats)
    assert score[mask].min() >= score[~mask].max()


def test_whole_channels():
    stats = _stats(64)
    w = 0.05 * torch.randn(16, 64)
    mask = outlier_mask(w, stats, 0.0, channel_percent=5.0)
    cols = mask.all(0).nonzero().flatten()
    assert len(cols) == 3 and int(mask.sum()) == 3 * 16
    score = stats.sq_mean * w.square().sum(0)
    assert sorted(cols.tolist()) == sorted(score.topk(3).indices.tolist())


def test_side_matrix_round_trip_and_bits():
    w = torch.randn(8, 16)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[1, 2] = mask[7, 15] = True
    parts = pack_outliers(torch.where(mask, w, 0.0), mask)
    assert parts["indices"].tolist() == [1 * 16 + 2, 7 * 16 + 15] and parts["values"].dtype == torch.bfloat16
    dense = unpack_outliers(parts, (8, 16))
    assert torch.equal(dense[mask], w[mask].bfloat16().float()) and (dense[~mask] == 0).all()
    assert outlier_bits(2, (8, 16)) == 48 * 2 / 128


@pytest.mark.parametrize("fmt_name", ["int4-g32", "nf4", "mxfp4", "nvfp4"])
def test_keeping_outliers_lowers_output_error(fmt_name):
    spec = parse_spec(fmt_name)
    stats = _stats(128, seed=1)
    gen = torch.Generator().manual_seed(2)
    w = 0.05 * torch.randn(64, 128, generator=gen)
    w.view(-1)[torch.randperm(w.numel(), generator=gen)[:40]] *= 15  # heavy tail
    fmt = get_format(spec)
    plain = fmt.quantize(w, spec, stats=stats.sq_mean).dequantize()
    mask = outlier_mask(w, stats, 0.5)
    held = fmt.quantize(w.masked_fill(mask, 0.0), spec, stats=stats.sq_mean).dequantize()
    held = held.masked_fill(mask, 0.0) + torch.where(mask, w.bfloat16().float(), 0.0)
    assert output_error(w, held, stats.hessian) < 0.8 * output_error(w, plain, stats.hessian)


def _rtn_error(w, mask, spec, stats):
    base = w.masked_fill(mask, 0.0)
    deq = get_format(spec).quantize(base, spec, stats=stats.sq_mean).dequantize()
    return float(((deq - base).square() * stats.sq_mean).masked_fill(mask, 0.0).sum())


def test_error_salience_takes_the_weight_that_stretches_its_group():
    # Group 1 of row 2 has a large weight whose neighbours are tiny: leaving it out shrinks the
    # group's range ~100×. Elsewhere a larger |w|·sqrt(E[x²]) sits in a group whose range it does
    # not set alone (its neighbour is as large), which "act" prefers and "error" must not.
    stats = _stats(64)
    spec = parse_spec("int4-asym-g32")
    w = 0.001 * torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    w[2, 40] = 0.5
    w[0, 60], w[0, 61] = 1.0, 0.99
    error = outlier_mask(w, stats, 100 / 256, kind="error", spec=spec)  # one weight
    assert error.nonzero().tolist() == [[2, 40]]
    assert outlier_mask(w, stats, 100 / 256, kind="act").nonzero().tolist() in ([[0, 60]], [[0, 61]])
    with pytest.raises(Exception, match="needs the matrix's format"):
        outlier_mask(w, stats, 1.0, kind="error")


def test_error_salience_takes_a_weight_on_a_massive_channel_inside_the_range():
    # Channel 7 carries activations 10⁴× louder than the rest: any weight there costs more error
    # than narrowing a range saves, even though w[1, 7] is neither its group's largest nor smallest.
    from lowbit.compress.stats import InputStats

    sq_mean = torch.ones(64)
    sq_mean[7] = 1e4
    stats = InputStats(hessian=torch.diag(sq_mean), mean_abs=None, sq_mean=sq_mean, max_abs=None, tokens=1)
    w = torch.linspace(-1, 1, 64).repeat(2, 1)
    w[1, 7] = -0.5  # inside its group's range [-1, -0.02]
    w[0, 7] = -1.0  # row 0: the loud weight is also its group's smallest
    mask = outlier_mask(w, stats, 100 * 2 / w.numel(), kind="error", spec=parse_spec("int4-asym-g32"))
    assert sorted(mask.nonzero().tolist()) == [[0, 7], [1, 7]]
    # For GPTQ (own_error=False) only range-setting weights are candidates: [1, 7] is not one.
    gptq = outlier_mask(w, stats, 100 * 2 / w.numel(), kind="error", spec=parse_spec("int4-asym-g32"), own_error=False)
    assert int(gptq.sum()) == 2 and not gptq[1, 7]


@pytest.mark.parametrize("fmt_name", ["int4-asym-g32-dq", "int4-g32", "nf4"])
def test_error_salience_lowers_rounding_error_more_than_act(fmt_name):
    # Heavy-tailed weights, ragged groups (K = 200 is not a multiple of 32): the "error" choice
    # leaves less E[x²]-weighted rounding error than the same number of weights ranked by act.
    spec = parse_spec(fmt_name)
    stats = _stats(200, seed=3)
    gen = torch.Generator().manual_seed(4)
    w = 0.02 * torch.randn(96, 200, generator=gen)
    w.view(-1)[torch.randperm(w.numel(), generator=gen)[:100]] *= 6
    count = 60
    error = outlier_mask(w, stats, 100 * count / w.numel(), kind="error", spec=spec)
    act = outlier_mask(w, stats, 100 * count / w.numel(), kind="act")
    assert int(error.sum()) == int(act.sum()) == count
    none = torch.zeros_like(error)
    assert _rtn_error(w, error, spec, stats) < _rtn_error(w, act, spec, stats) < _rtn_error(w, none, spec, stats)
