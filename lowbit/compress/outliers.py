"""Outlier protection: keep the most salient weights in bf16 beside the quantized matrix.

Salience of weight (n, k):
  "act"      |w| · sqrt(E[x_k²])            (its typical contribution to the output)
  "hessian"  w² / [H⁻¹]_kk                  (OBS: the output error of zeroing it, H damped 1%)
  "error"    what keeping it saves: the drop in its group's round-to-nearest error Σ E[x_k²](ŵ − w)²
             when it leaves the group (an extreme weight widens the group's range for all the
             others; any weight takes its own error with it, which counts only without GPTQ),
             chosen greedily in `ERROR_ROUNDS` rounds of at most one weight per group
`outlier_mask` picks the top `percent` % of a matrix's weights (ties broken by position, so the
choice is deterministic) and optionally whole input channels (`channel_percent` % of the columns,
by E[x_k²]·‖W[:, k]‖²). The kept weights are excluded from the quantized matrix (their code is the
format's zero) and stored as a sparse side matrix S; inference computes x Ŵᵀ + x Sᵀ.

The side matrix's storage is a number format of its own: lowbit/quant/outlier_matrix.py.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.compress.stats import InputStats

ERROR_ROUNDS = 4
SALIENCES = ("act", "hessian", "error")
# What `lowbit quantize --keep-outliers` ranks by unless told: "error" scored below "act" and
# "hessian" on SmolLM2 (four statistics files) and Gemma-3 (docs/benchmarks.md).
DEFAULT_SALIENCE = "error"


def salience(w: torch.Tensor, stats: InputStats, kind: str = "act") -> torch.Tensor:
    w = w.float()
    if kind == "act":
        return w.abs() * stats.sq_mean.float().clamp_min(0).sqrt()[None, :]
    if kind == "hessian":
        h = stats.hessian.double()
        h = h + 0.01 * torch.diagonal(h).mean().clamp_min(1e-12) * torch.eye(h.shape[0], dtype=h.dtype)
        inv_diag = torch.diagonal(torch.linalg.inv(h)).float()
        return w.square() / inv_diag[None, :]
    raise UsageError(f"unknown outlier salience '{kind}' (use {', '.join(SALIENCES)})")


def error_mask(w: torch.Tensor, stats: InputStats, count: int, spec, *, own_error: bool = True) -> torch.Tensor:
    """bool [N, K]: `count` weights picked for what leaving them out of their group saves (the
    "error" salience; see the module docstring).

    Round to nearest leaves an error of about step²/12 per weight, and the step is the group's
    range (max − min with a zero point, 2·max|w| without) over the grid's levels, so a group's
    error is ∝ range² · Σ_k E[x_k²]. Only its largest or smallest remaining weight can narrow the
    range; any other weight saves just its own share, range² · E[x_k²], most on the group's loudest
    channel. Each round scores those three candidates in every group and keeps the best
    `count / ERROR_ROUNDS` over all groups, at most one per group.

    own_error=False leaves out the third candidate: GPTQ feeds a weight's own rounding error into
    the columns after it, but cannot undo the coarser step a wide range gives the whole group
    (on SmolLM2's v5 recipe with GPTQ the third candidate cost 0.001 KLD; with RTN it saves a
    quarter of it, docs/benchmarks.md)."""
    w = w.float()
    n, k = w.shape
    group = spec.group_size if spec.granularity == "group" and spec.group_size else k
    groups = -(-k // group)
    weight = torch.zeros(groups * group)
    weight[:k] = stats.sq_mean.float().clamp_min(0)
    weight = weight.view(groups, group)
    mask = torch.zeros(n, groups * group, dtype=torch.bool)
    values = torch.zeros(n, groups * group)
    values[:, :k] = w
    mask[:, k:] = True  # the ragged last group's padding
    values, mask3 = values.view(n, groups, group), mask.view(n, groups, group)
    inf = float("inf")
    chosen, per_round = 0, -(-count // ERROR_ROUNDS)
    while chosen < count:
        hi2 = values.masked_fill(mask3, -inf).topk(2, dim=-1)
        lo2 = (-values).masked_fill(mask3, -inf).topk(2, dim=-1)
        hi, lo = hi2.values, -lo2.values  # [N, G, 2]: largest two, smallest two
        if spec.symmetric:
            span = lambda top, bottom: 2 * torch.maximum(top.abs(), bottom.abs())  # noqa: E731
        else:
            span = lambda top, bottom: top - bottom  # noqa: E731
        live = (~mask3).sum(-1)
        total = (weight[None] * (~mask3)).sum(-1)  # Σ E[x²] over the group's remaining weights
        now = span(hi[..., 0], lo[..., 0]).square() * total
        gain_hi = now - span(hi[..., 1], lo[..., 0]).square() * (total - weight[None].expand(n, -1, -1).gather(-1, hi2.indices[..., :1]).squeeze(-1))
        gain_lo = now - span(hi[..., 0], lo[..., 1]).square() * (total - weight[None].expand(n, -1, -1).gather(-1, lo2.indices[..., :1]).squeeze(-1))
        # A weight inside the range saves only its own error, span² · E[x_k²]: worth it on a channel
        # with massive activations, so the group's loudest remaining channel is the third candidate.
        loud = weight[None].expand(n, -1, -1).masked_fill(mask3, -inf).max(-1)
        gain_loud = span(hi[..., 0], lo[..., 0]).square() * loud.values
        col_loud = loud.indices
        extreme = (col_loud == hi2.indices[..., 0]) | (col_loud == lo2.indices[..., 0])
        gain_loud = gain_loud.masked_fill(extreme | (not own_error), -inf)
        gain = torch.stack([gain_hi, gain_lo, gain_loud], -1)
        cols = torch.stack([hi2.indices[..., 0], lo2.indices[..., 0], col_loud], -1)
        best = gain.argmax(-1, keepdim=True)
        gain = gain.gather(-1, best).squeeze(-1).masked_fill(live < 3, -inf).nan_to_num(nan=-inf)
        col = cols.gather(-1, best).squeeze(-1)
        take = min(count - chosen, per_round)
        order = torch.argsort(gain.flatten(), descending=True, stable=True)[:take]
        order = order[torch.isfinite(gain.flatten()[order])]
        if order.numel() == 0:
            break
        rows, grp = order // groups, order % groups
        mask3[rows, grp, col.flatten()[order]] = True
        chosen += int(order.numel())
    return mask[:, :k].clone()


def outlier_mask(
    w: torch.Tensor, stats: InputStats, percent: float, *, channel_percent: float = 0.0, kind: str = "act", spec=None,
    own_error: bool = True,
) -> torch.Tensor | None:
    """bool [N, K] of the weights to keep in bf16, or None when nothing is kept ("error" needs the
    matrix's FormatSpec; own_error: see `error_mask`, False for GPTQ)."""
    if not 0 <= percent < 100 or not 0 <= channel_percent < 100:
        raise UsageError(f"outlier percentages must be in [0, 100), got {percent} and {channel_percent}")
    n, k = w.shape
    mask = torch.zeros((n, k), dtype=torch.bool)
    count = int(round(n * k * percent / 100.0))
    if count and kind == "error":
        if spec is None:
            raise UsageError("the error outlier salience needs the matrix's format")
        mask = error_mask(w, stats, count, spec, own_error=own_error)
    elif count:
        score = salience(w, stats, kind).flatten()
        order = torch.argsort(score, descending=True, stable=True)[:count]
        mask.view(-1)[order] = True
    columns = int(round(k * channel_percent / 100.0))
    if columns:
        channel_score = stats.sq_mean.float() * w.float().square().sum(0)
        mask[:, torch.argsort(channel_score, descending=True, stable=True)[:columns]] = True
    return mask if mask.any() else None
