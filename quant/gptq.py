"""GPTQ for every format: quantize one column at a time and push each column's error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

With H = E[x xᵀ] of the Linear's input, the output error of a weight error E is tr(E H Eᵀ).
GPTQ visits the columns in order; after rounding column j it spreads the error e_j over the
remaining columns through row j of the upper Cholesky factor U of H⁻¹ (U = chol(H⁻¹)ᵀ):
    err = (w_j − q_j) / U[j, j];   W[:, j+1:] −= err ⊗ U[j, j+1:]
Columns go in blocks of 128: inside a block the update is applied column by column, the rest of
the matrix gets the block's errors in one product (lazy batch updates).

Format independence: the format computes the group scales once, up front, from the original
weight (weighted by diag H), and `fake_quantize_column` rounds one column with those scales.
With act-order the columns are visited by decreasing diag H, but every column keeps the scale of
its own group in the original order ("static groups"), so the stored checkpoint has the usual
layout and needs no permutation at run time.

Dampening: λ = 1% of mean(diag H) is added to the diagonal; when the Cholesky fails λ grows
tenfold up to `max_damp`; if it still fails the layer falls back to RTN (result.fallback).
Dead columns (diag H = 0: an input that is always zero) get H_jj = 1 and weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quant.groups import GroupScales, check_weight
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import as_spec, get_format
from lowbit.quant.spec import FormatSpec

DEFAULT_BLOCK = 128
DEFAULT_DAMP = 0.01
MAX_DAMP = 10.0


@dataclass(slots=True)
class PreparedHessian:
    """What GPTQ needs from H, computed once per input site and shared by its Linears."""

    upper: torch.Tensor  # U: upper Cholesky factor of (H + λI)⁻¹ in visiting order, float32 [K, K]
    perm: torch.Tensor  # visiting order of the columns (long [K])
    dead: torch.Tensor  # bool [K]: inputs that never fire
    diag: torch.Tensor  # diag H (float32 [K]), the per-column weights for the scale search
    damp: float  # the λ / mean(diag H) that worked


def prepare_hessian(
    hessian: torch.Tensor, *, damp: float = DEFAULT_DAMP, act_order: bool = True, max_damp: float = MAX_DAMP
) -> PreparedHessian | None:
    """Factor H for GPTQ; None when no dampening up to `max_damp` makes it positive definite."""
    h = hessian.detach().double().clone()
    k = h.shape[0]
    diag = torch.diagonal(h)
    dead = diag == 0
    h[dead, dead] = 1.0
    weights = torch.diagonal(h).clone()
    weights[dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k)
    h = h[perm][:, perm]
    mean_diag = torch.diagonal(h).mean()
    eye = torch.eye(k, dtype=h.dtype)
    lam = damp
    while torch.isfinite(mean_diag) and lam <= max_damp * (1 + 1e-9):
        lower, info = torch.linalg.cholesky_ex(h + lam * mean_diag * eye)
        if int(info) == 0:
            # H⁻¹ = L⁻ᵀ L⁻¹; a triangular solve is several times faster than cholesky_inverse on CPU
            lower_inv = torch.linalg.solve_triangular(lower, eye, upper=False)
            upper, info = torch.linalg.cholesky_ex(lower_inv.T @ lower_inv, upper=True)
            if int(info) == 0 and torch.isfinite(upper).all():
                return PreparedHessian(upper=upper.float(), perm=perm, dead=dead, diag=weights.float(), damp=lam)
        lam *= 10.0
    return None


@dataclass(slots=True)
class GPTQResult:
    qtensor: QTensor
    values: torch.Tensor  # the dequantized weight float32 [N, K] (kept weights excluded: 0 there)
    kept: torch.Tensor | None  # float32 [N, K], the bf16 values of the kept weights (0 elsewhere), or None
    damp: float | None  # dampening used; None when the layer fell back to RTN
    fallback: bool


def gptq_quantize(
    w: torch.Tensor,
    spec: FormatSpec | str,
    hessian: torch.Tensor | None = None,
    *,
    prepared: PreparedHessian | None = None,
    block_size: int = DEFAULT_BLOCK,
    damp: float = DEFAULT_DAMP,
    act_order: bool = True,
    global_scale: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    scales: GroupScales | None = None,
) -> GPTQResult:
    """Quantize W[N, K] with GPTQ against H [K, K] (or an already `prepared` one).

    keep: optional bool mask [N, K] of weights held exactly (rounded to bf16) as outliers; they
    are not quantized (their code is the format's zero) but do take part in the error feedback.
    """
    spec = as_spec(spec)
    fmt = get_format(spec)
    w = check_weight(w).clone()
    n, k = w.shape
    if prepared is None:
        prepared = prepare_hessian(hessian, damp=damp, act_order=act_order)
    if prepared is None:
        return _rtn_fallback(w, spec, hessian, global_scale, keep)
    w[:, prepared.dead] = 0.0
    if scales is None:
        base = w if keep is None else w.masked_fill(keep, 0.0)
        scales = fmt.compute_scales(base, spec, stats=prepared.diag, global_scale=global_scale)

    perm = prepared.perm
    upper = prepared.upper
    work = w[:, perm].contiguous()
    keep_p = None if keep is None else keep[:, perm]
    values = torch.zeros_like(work)
    kept = torch.zeros_like(work) if keep is not None else None
    codes = None
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block = work[:, b0:b1].clone()
        errors = torch.zeros_like(block)
        u = upper[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = b0 + i
            col = block[:, i]
            column = int(perm[j])
            if keep_p is None:
                c, q = fmt.fake_quantize_column(col, scales, column, spec)
                effective = q
            else:
                mask = keep_p[:, j]
                c, q = fmt.fake_quantize_column(col.masked_fill(mask, 0.0), scales, column, spec)
                held = col.to(torch.bfloat16).float()
                q = q.masked_fill(mask, 0.0)
                kept[:, j] = torch.where(mask, held, 0.0)
                effective = torch.where(mask, held, q)
            if codes is None:
                codes = torch.empty((n, k), dtype=c.dtype)
            codes[:, j] = c
            values[:, j] = q
            err = (col - effective) / u[i, i]
            if i + 1 < b1 - b0:
                block[:, i + 1 :].addr_(err, u[i, i + 1 :], alpha=-1.0)
            errors[:, i] = err
        if b1 < k:
            work[:, b1:].addmm_(errors, upper[b0:b1, b1:], alpha=-1.0)

    inverse = torch.argsort(perm)
    codes = codes[:, inverse]
    qt = QTensor(spec=spec, shape=(n, k), qweight=fmt.pack(codes, spec), **scales.stored)
    return GPTQResult(
        qtensor=qt,
        values=values[:, inverse].contiguous(),
        kept=None if kept is None else kept[:, inverse].contiguous(),
        damp=prepared.damp,
        fallback=False,
    )


def _rtn_fallback(w, spec, hessian, global_scale, keep) -> GPTQResult:
    fmt = get_format(spec)
    stats = None
    if hessian is not None:
        diag = torch.diagonal(hessian).float()
        if torch.isfinite(diag).all() and (diag >= 0).all():
            stats = diag
    base = w if keep is None else w.masked_fill(keep, 0.0)
    qt = fmt.quantize(base, spec, stats=stats, global_scale=global_scale)
    values = qt.dequantize(torch.float32)
    kept = None
    if keep is not None:
        values = values.masked_fill(keep, 0.0)
        kept = torch.where(keep, w.to(torch.bfloat16).float(), 0.0)
    return GPTQResult(qtensor=qt, values=values, kept=kept, damp=None, fallback=True)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(E H Eᵀ) for E = Ŵ − W: the mean squared output error over the calibration tokens, summed over outputs."""
    e = (w_hat.double() - w.double())
    return float(((e @ hessian.double()) * e).sum())


def make_layer_method(context):
    """quant/pipeline.py's entry for --method gptq: sequential calibration (quant/sequential.py)."""
    from lowbit.quant.sequential import make_layer_method as sequential_method

    return sequential_method(context)
