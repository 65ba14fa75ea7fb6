"""GPTQ: the error-feedback math against an unblocked float64 textbook loop, quality against RTN
for every format, dead columns, static groups under act-order, the RTN fallback, and the scale
refit (a direct least-squares solve; never a worse row)."""

from __future__ import annotations

import pytest
import torch

from lowbit.quant import get_format, parse_spec
from lowbit.compress.gptq import gptq_quantize, output_error, prepare_hessian, refit_scales

FORMATS = ["int4-g32", "int4-asym-g64", "nf4", "mxfp4", "nvfp4", "fp8", "int8"]


def correlated_hessian(k: int, tokens: int = 2048, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.6 * torch.randn(k, k, generator=gen) / k**0.5
    x = torch.randn(tokens, k, generator=gen) @ mix * torch.linspace(0.3, 3.0, k)
    return x.T @ x / tokens


def textbook_gptq(w, spec, h, damp=0.01):
    """Column by column in float64, updating the full inverse Hessian after each column (OBS)."""
    fmt = get_format(spec)
    scales = fmt.compute_scales(w, spec, stats=torch.diagonal(h).float())
    w = w.double().clone()
    h = h.double() + damp * torch.diagonal(h.double()).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    codes, values = [], []
    for j in range(w.shape[1]):
        c, q = fmt.fake_quantize_column(w[:, j].float(), scales, j, spec)
        codes.append(c)
        values.append(q)
        err = (w[:, j] - q.double()) / hinv[j, j]
        w[:, j:] -= err[:, None] * hinv[j, j:][None, :]
        hinv = hinv - hinv[:, j : j + 1] @ hinv[j : j + 1, :] / hinv[j, j]
    return torch.stack(codes, 1), torch.stack(values, 1)


@pytest.mark.parametrize("fmt_name", ["int4-g16", "nvfp4", "fp8"])
def test_error_feedback_matches_textbook_loop(fmt_name):
    spec = parse_spec(fmt_name)
    k = 48
    h = correlated_hessian(k)
    w = 0.05 * torch.randn(24, k)
    codes_ref, values_ref = textbook_gptq(w, spec, h)
    # Blocks of 16 exercise the lazy batch update across block boundaries.
    result = gptq_quantize(w, spec, h, block_size=16, act_order=False, refit=False)
    values = result.values
    assert torch.equal(result.qtensor.dequantize(), values)
    same = (values == values_ref).float().mean().item()
    assert same > 0.99, same
    assert abs(output_error(w, values, h) / output_error(w, values_ref, h) - 1) < 0.02


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_gptq_beats_rtn_on_correlated_inputs(fmt_name):
    spec = parse_spec(fmt_name)
    k = 128
    h = correlated_hessian(k, seed=1)
    w = 0.05 * torch.randn(64, k)
    rtn = get_format(spec).quantize(w, spec, stats=torch.diagonal(h)).dequantize()
    gptq = gptq_quantize(w, spec, h).values
    assert output_error(w, gptq, h) < 0.85 * output_error(w, rtn, h)


def test_act_order_keeps_static_group_scales():
    spec = parse_spec("int4-g32")
    h = correlated_hessian(96, seed=2)
    w = 0.05 * torch.randn(16, 96)
    result = gptq_quantize(w, spec, h, act_order=True, refit=False)
    scales = get_format(spec).compute_scales(w, spec, stats=torch.diagonal(h))
    assert torch.equal(result.qtensor.scales, scales.stored["scales"])
    assert not torch.equal(prepare_hessian(h).perm, torch.arange(96))


def test_dead_columns_are_zero_and_finite():
    spec = parse_spec("int4-g32")
    h = correlated_hessian(64, seed=3)
    dead = torch.tensor([3, 40])
    h[dead, :] = 0
    h[:, dead] = 0
    w = 0.05 * torch.randn(8, 64)
    result = gptq_quantize(w, spec, h)
    assert torch.isfinite(result.values).all()
    assert (result.values[:, dead] == 0).all()


def test_cholesky_failure_falls_back_to_rtn():
    spec = parse_spec("int4-g32")
    h = -torch.eye(32)  # no dampening makes it positive definite
    w = 0.05 * torch.randn(8, 32)
    result = gptq_quantize(w, spec, h)
    assert result.fallback and result.damp is None
    assert torch.equal(result.values, get_format(spec).quantize(w, spec).dequantize())


def test_dampening_is_raised_when_needed():
    # Rank-deficient H (fewer tokens than channels) with tiny dampening: it must grow, not fail.
    x = torch.randn(4, 32)
    h = x.T @ x
    prepared = prepare_hessian(h, damp=1e-12)
    assert prepared is not None and prepared.damp > 1e-12


def test_kept_weights_are_exact_and_excluded():
    spec = parse_spec("int4-g32")
    h = correlated_hessian(64, seed=4)
    w = 0.05 * torch.randn(8, 64)
    w[2, 5], w[7, 60] = 0.6, -0.4  # outliers that stretch their groups' scales
    keep = torch.zeros_like(w, dtype=torch.bool)
    keep[2, 5] = keep[7, 60] = True
    result = gptq_quantize(w, spec, h, keep=keep)
    assert (result.values[keep] == 0).all()
    # Kept weights absorb the error fed back from earlier columns, so they are the updated
    # weights rounded to bf16, not the originals; with them the output error drops.
    assert torch.equal(result.kept, result.kept.bfloat16().float())
    assert (result.kept[~keep] == 0).all() and (result.kept[keep] != 0).all()
    plain = gptq_quantize(w, spec, h).values
    assert output_error(w, result.values + result.kept, h) < 0.9 * output_error(w, plain, h)


@pytest.mark.parametrize("kept", [False, True], ids=["all-coded", "kept-weights"])
@pytest.mark.parametrize("native", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("fmt_name", ["int4-g16", "int4-asym-g16", "int3-g32", "int5-g16", "int6-asym-g32", "int8", "int2-asym"])
def test_integer_loop_is_the_generic_loop_bit_for_bit(fmt_name, native, kept, monkeypatch):
    """The integer-grid column loop (gptq._integer_loop), in C (native/gptq_columns.c) and in
    torch, against the format-generic one, with and without weights kept in bf16 (outliers);
    600 rows so the C loop splits them over threads."""
    from lowbit.native import gptq_columns as cpu_gptq
    from lowbit.compress import gptq

    if native:
        assert cpu_gptq.available(), "the C library did not build"
        calls = []
        monkeypatch.setattr(cpu_gptq, "int_block", lambda *a, _f=cpu_gptq.int_block: calls.append(1) or _f(*a))
    else:
        monkeypatch.setattr(cpu_gptq, "available", lambda: False)
    spec = parse_spec(fmt_name)
    h = correlated_hessian(80, seed=3)
    w = 0.05 * torch.randn(600, 80, generator=torch.Generator().manual_seed(1))
    w[3, :16] = 0.0  # an all-zero group: scale 0, the safe divisor
    keep = None
    if kept:
        keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(2)) < 0.02
        keep[5, :16] = True  # a group held whole
    fast = gptq.gptq_quantize(w, spec, h, block_size=32, keep=keep)
    if native:
        assert len(calls) == 3 * 2  # 80 columns in blocks of 32, GPTQ and its refit pass

    class Generic:  # the same element quantizer under another name: the identity check fails
        quantize_group_values = staticmethod(lambda *a: gptq.intq.quantize_group_values(*a))

    monkeypatch.setattr(gptq, "intq", Generic)
    slow = gptq.gptq_quantize(w, spec, h, block_size=32, keep=keep)
    assert torch.equal(fast.qtensor.qweight, slow.qtensor.qweight)
    assert torch.equal(fast.values, slow.values)
    assert torch.equal(fast.qtensor.dequantize(), fast.values)  # kept weights' codes stand for 0
    if kept:
        assert torch.equal(fast.kept, slow.kept)
        # held in bf16 as GPTQ had moved them, in place of a code (which stands for 0)
        assert torch.equal(fast.kept, fast.kept.to(torch.bfloat16).float()) and not fast.values[keep].any()
        assert fast.kept[keep].abs().min() > 0 and not fast.kept[~keep].any()


@pytest.mark.parametrize("kept", [False, True], ids=["all-coded", "kept-weights"])
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4", "fp8", "fp8-block128", "nf4"])
def test_grid_loop_is_the_generic_loop_bit_for_bit(fmt_name, kept, monkeypatch):
    """The C column loop for element-grid formats (gptq._grid_loop) against the format-generic
    torch loop: the same codes, values and kept weights; 600 rows so the C loop splits them."""
    from lowbit.native import gptq_columns as cpu_gptq
    from lowbit.compress import gptq

    assert cpu_gptq.available(), "the C library did not build"
    spec = parse_spec(fmt_name)
    h = correlated_hessian(256, seed=4)
    w = 0.05 * torch.randn(600, 256, generator=torch.Generator().manual_seed(1))
    w[3, :64] = 0.0  # an all-zero group
    keep = None
    if kept:
        keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(2)) < 0.02
    calls = []
    monkeypatch.setattr(cpu_gptq, "grid_block", lambda *a, _f=cpu_gptq.grid_block: calls.append(1) or _f(*a))
    fast = gptq.gptq_quantize(w, spec, h, block_size=64, keep=keep)
    assert calls, "the grid loop did not run"
    monkeypatch.setattr(cpu_gptq, "available", lambda: False)
    slow = gptq.gptq_quantize(w, spec, h, block_size=64, keep=keep)
    assert torch.equal(fast.qtensor.qweight, slow.qtensor.qweight)
    assert torch.equal(fast.values, slow.values)
    if kept:
        assert torch.equal(fast.kept, slow.kept)


def test_refit_scales_is_the_direct_least_squares_solve():
    gen = torch.Generator().manual_seed(5)
    n, k, g = 6, 40, 16  # a ragged last group of 8
    h = correlated_hessian(k, seed=5).double()
    target = 0.05 * torch.randn(n, k, generator=gen)
    unit = torch.randint(-8, 8, (n, k), generator=gen).float()
    unit[1, 16:32] = 0.0  # a group with no non-zero code keeps its fallback scale
    fallback = torch.full((n, 3), 0.123)
    got = refit_scales(target, unit, g, h.float(), fallback=fallback)
    for r in range(n):
        b = torch.zeros(k, 3, dtype=torch.float64)
        for j in range(k):
            b[j, j // g] = unit[r, j]
        used = [a for a in range(3) if b[:, a].abs().sum() > 0]
        bu = b[:, used]
        want = torch.linalg.solve(bu.T @ h @ bu, bu.T @ h @ target[r].double())
        assert torch.allclose(got[r, used].double(), want, rtol=1e-4, atol=1e-7)
        for a in set(range(3)) - set(used):
            assert got[r, a] == fallback[r, a]


def _row_errors(w, values, h):
    e = (w - values).double()
    return ((e @ h.double()) * e).sum(1)


@pytest.mark.parametrize("fmt_name", ["int4-g32", "int4-asym-g64", "int8", "nf4", "nvfp4", "fp8"])
def test_refit_never_makes_a_row_worse(fmt_name):
    spec = parse_spec(fmt_name)
    k = 128
    h = correlated_hessian(k, seed=6)
    w = 0.05 * torch.randn(48, k, generator=torch.Generator().manual_seed(6))
    metric = prepare_hessian(h).hessian  # the damped H GPTQ and the refit work in
    plain = gptq_quantize(w, spec, h, refit=False)
    refit = gptq_quantize(w, spec, h)
    assert torch.equal(refit.qtensor.dequantize(), refit.values)
    before, after = _row_errors(w, plain.values, metric), _row_errors(w, refit.values, metric)
    assert (after <= before * (1 + 1e-5)).all()
    assert after.sum() < 0.995 * before.sum(), (after.sum() / before.sum()).item()


def test_refit_with_kept_weights_and_where_it_does_not_apply():
    spec = parse_spec("int4-asym-g32")
    h = correlated_hessian(64, seed=7)
    w = 0.05 * torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    w[2, 5] = 0.6
    keep = torch.zeros_like(w, dtype=torch.bool)
    keep[2, 5] = True
    plain = gptq_quantize(w, spec, h, keep=keep, refit=False)
    refit = gptq_quantize(w, spec, h, keep=keep)
    assert (refit.values[keep] == 0).all() and torch.equal(refit.qtensor.dequantize(), refit.values)
    assert output_error(w, refit.values + refit.kept, h) < output_error(w, plain.values + plain.kept, h)
    # mxfp4's power-of-two scales and nf4's double-quantized ones are not refitted.
    for name in ("mxfp4", "nf4-dq"):
        a = gptq_quantize(w, parse_spec(name), h)
        b = gptq_quantize(w, parse_spec(name), h, refit=False)
        assert torch.equal(a.values, b.values)


def test_float_target_is_the_ridge_solution_and_leaves_equal_inputs_alone():
    # W' = argmin E‖W' x − W x_float‖² + λ‖W' − W‖², solved directly in float64 as one least squares
    # over stacked rows [X; sqrt(λ) I] against [X_float Wᵀ; sqrt(λ) Wᵀ].
    from lowbit.compress.gptq import float_target
    from lowbit.compress.stats import ShiftAccumulator, StatsAccumulator

    g = torch.Generator().manual_seed(3)
    n_tok, k, n = 400, 24, 10
    x_float = torch.randn(1, n_tok, k, generator=g, dtype=torch.float64)
    x = x_float + 0.2 * torch.randn(1, n_tok, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g)
    acc, shift = StatsAccumulator(k), ShiftAccumulator(k)
    acc.add(x)
    shift.add(x_float, x)
    h, s = acc.finish().hessian, shift.finish()
    lam = 0.05 * float(torch.diagonal(h).mean())
    damped = h + lam * torch.eye(k)
    got = float_target(w, s, damped).double()

    xs, xf = x[0], x_float[0]
    a = torch.cat([xs / n_tok**0.5, lam**0.5 * torch.eye(k, dtype=torch.float64)])
    b = torch.cat([xf @ w.double().T / n_tok**0.5, lam**0.5 * w.double().T])
    want = torch.linalg.lstsq(a, b).solution.T
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # The correction is real (the inputs differ) and vanishes when they agree.
    assert (got - w.double()).abs().max() > 0.05
    same = ShiftAccumulator(k)
    same.add(x, x)
    assert torch.equal(float_target(w, same.finish(), damped), w)


def test_shift_accumulator_weights_the_first_position_like_the_hessian():
    from lowbit.compress.stats import ShiftAccumulator

    g = torch.Generator().manual_seed(4)
    x_float = torch.randn(3, 5, 4, generator=g)
    x = torch.randn(3, 5, 4, generator=g)
    acc = ShiftAccumulator(4, first_weight=3.0)
    acc.add(x_float[:2], x[:2])
    acc.add(x_float[2:], x[2:])
    weights = torch.ones(3, 5, 1, dtype=torch.float64)
    weights[:, 0] = 3.0
    d = (x_float - x).double()
    want = ((d * weights).reshape(-1, 4).T @ x.double().reshape(-1, 4)) / weights.sum()
    assert torch.allclose(acc.finish().double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt_name", ["int4-g32", "nf4", "fp8"])
@pytest.mark.parametrize("refit", [0, 1])
def test_shared_pass_gives_each_matrix_its_result_alone(fmt_name, refit):
    """Rows never interact, so matrices stacked into one shared pass get bit for bit what they get
    in smaller passes: the layer loop cuts an MoE layer's many experts into passes of SHARED_ROWS
    (compress/sequential.py) without changing a code."""
    from lowbit.compress.gptq import gptq_quantize_shared
    from lowbit.compress.sequential import _row_chunks

    spec = parse_spec(fmt_name)
    h = correlated_hessian(128)
    prepared = prepare_hessian(h)
    gen = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 128, generator=gen) for n in (48, 80, 16, 64)]
    whole = gptq_quantize_shared(ws, spec, prepared, refit=refit)
    parts = [r for chunk in ([ws[0]], ws[1:3], [ws[3]]) for r in gptq_quantize_shared(chunk, spec, prepared, refit=refit)]
    for a, b in zip(whole, parts):
        for name, t in a.qtensor.to_tensors().items():
            assert torch.equal(t, b.qtensor.to_tensors()[name]), name
    jobs = [(f"m{i}", w) for i, w in enumerate(ws)]
    import lowbit.compress.sequential as seq
    old, seq.SHARED_ROWS = seq.SHARED_ROWS, 100
    try:
        assert [[j[0] for j in c] for c in _row_chunks(jobs)] == [["m0"], ["m1", "m2"], ["m3"]]
    finally:
        seq.SHARED_ROWS = old
