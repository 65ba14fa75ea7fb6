"""Outlier protection: keep the most salient weights in bf16 beside the quantized matrix.

Salience of weight (n, k):
  "act"      |w| · sqrt(E[x_k²])            (its typical contribution to the output)
  "hessian"  w² / [H⁻¹]_kk                  (OBS: the output error of zeroing it, H damped 1%)
`outlier_mask` picks the top `percent` % of a matrix's weights (ties broken by position, so the
choice is deterministic) and optionally whole input channels (`channel_percent` % of the columns,
by E[x_k²]·‖W[:, k]‖²). The kept weights are excluded from the quantized matrix (their code is the
format's zero) and stored as a sparse side matrix S; inference computes x Ŵᵀ + x Sᵀ.

Storage of S (`pack_outliers`): `indices` int32 [nnz] (row * K + column, ascending) and
`values` bf16 [nnz]: 48 bits per kept weight, counted in bits/weight by `outlier_bits`.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.quant.stats import InputStats

BITS_PER_OUTLIER = 48


def salience(w: torch.Tensor, stats: InputStats, kind: str = "act") -> torch.Tensor:
    w = w.float()
    if kind == "act":
        return w.abs() * stats.sq_mean.float().clamp_min(0).sqrt()[None, :]
    if kind == "hessian":
        h = stats.hessian.double()
        h = h + 0.01 * torch.diagonal(h).mean().clamp_min(1e-12) * torch.eye(h.shape[0], dtype=h.dtype)
        inv_diag = torch.diagonal(torch.linalg.inv(h)).float()
        return w.square() / inv_diag[None, :]
    raise UsageError(f"unknown outlier salience '{kind}' (use act or hessian)")


def outlier_mask(
    w: torch.Tensor, stats: InputStats, percent: float, *, channel_percent: float = 0.0, kind: str = "act"
) -> torch.Tensor | None:
    """bool [N, K] of the weights to keep in bf16, or None when nothing is kept."""
    if not 0 <= percent < 100 or not 0 <= channel_percent < 100:
        raise UsageError(f"outlier percentages must be in [0, 100), got {percent} and {channel_percent}")
    n, k = w.shape
    mask = torch.zeros((n, k), dtype=torch.bool)
    count = int(round(n * k * percent / 100.0))
    if count:
        score = salience(w, stats, kind).flatten()
        order = torch.argsort(score, descending=True, stable=True)[:count]
        mask.view(-1)[order] = True
    columns = int(round(k * channel_percent / 100.0))
    if columns:
        channel_score = stats.sq_mean.float() * w.float().square().sum(0)
        mask[:, torch.argsort(channel_score, descending=True, stable=True)[:columns]] = True
    return mask if mask.any() else None


def pack_outliers(kept: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The side matrix as {'indices': int32 [nnz], 'values': bf16 [nnz]}."""
    index = mask.flatten().nonzero().flatten()
    return {"indices": index.to(torch.int32), "values": kept.flatten()[index].to(torch.bfloat16)}


def unpack_outliers(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dense float32 [N, K] side matrix S."""
    dense = torch.zeros(shape[0] * shape[1], dtype=torch.float32)
    dense[parts["indices"].long()] = parts["values"].float()
    return dense.view(shape)


def sparse_outliers(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The side matrix as a float32 sparse COO [N, K] tensor (what QuantLinear.set_outliers takes)."""
    index = parts["indices"].long()
    k = int(shape[1])
    coords = torch.stack([index // k, index % k])
    return torch.sparse_coo_tensor(coords, parts["values"].float(), tuple(int(d) for d in shape),
                                   is_coalesced=True, check_invariants=True)


def outlier_bits(count: int, shape: tuple[int, int]) -> float:
    """Extra bits per weight of `count` kept weights in an [N, K] matrix."""
    return BITS_PER_OUTLIER * count / (shape[0] * shape[1])
