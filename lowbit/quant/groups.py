"""Groups of columns that share a scale, ragged last groups, and the per-group scale search.

A weight W[N, K] with group size g has G = ceil(K / g) groups per row; group j holds columns
[j*g, min((j+1)*g, K)). When g does not divide K the last group is narrower (SmolLM2: K = 576,
g = 128 → four groups of 128 and one of 64). Stored weights are never padded: scales have G
columns and codes have K. Inside computations a row is padded with zeros to G*g columns; every
format represents 0 exactly and the padded columns carry zero error weight, so a ragged group
gets exactly the scale and codes a group of its true width would get.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from lowbit.errors import LowbitError, UsageError


@dataclass(slots=True)
class GroupScales:
    """Scales chosen for one weight matrix, in the two forms the code needs.

    `scale` (and `zero`) are float32 [N, G], decoded, the multiplier every element of group
    (n, j) is dequantized with: value = element(code, zero) * scale[n, j]. `stored` holds the
    exact tensors the QTensor keeps (e.g. E8M0 codes, FP8 block scales and the global scale),
    so quantizing with these scales reproduces them bit for bit. GPTQ computes a GroupScales
    once and then quantizes column by column with `fake_quantize_column`.
    """

    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int  # columns per group; in_features when there is one scale per row/tensor
    stored: dict[str, torch.Tensor] = field(default_factory=dict)

    def column(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale[N, 1], zero[N, 1] or None) that apply to input column `index`."""
        j = index // self.group_size
        zero = None if self.zero is None else self.zero[:, j : j + 1]
        return self.scale[:, j : j + 1], zero


def check_weight(w: torch.Tensor, what: str = "weight") -> torch.Tensor:
    """Return w as float32 [N, K]; refuse anything else and any NaN/inf with a one-line error."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise UsageError(f"{what} must be a 2-D tensor [out_features, in_features], got {shape}")
    if not (w.is_floating_point()):
        raise UsageError(f"{what} must be a floating-point tensor, got {w.dtype}")
    w = w.detach().float()
    bad = ~torch.isfinite(w)
    if bad.any():
        n, k = (int(i) for i in bad.nonzero()[0])
        kind = "NaN" if torch.isnan(w[n, k]) else "inf"
        raise LowbitError(f"{what} contains {kind} (first at row {n}, column {k}); cannot quantize it")
    return w


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] → [N, G, g], zero-padding the last group (a view when g divides K)."""
    n, k = x.shape
    pad = num_groups(k, group_size) * group_size - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(n, -1, group_size)


def ungrouped(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, G, g] → [N, K], dropping the padding of a ragged last group."""
    return x.reshape(x.shape[0], -1)[:, :in_features]


def expand_groups(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Per-group values [N, G] → per-element [N, K]."""
    return t.repeat_interleave(group_size, dim=1)[:, :in_features]


def column_weights(stats: torch.Tensor | None, in_features: int) -> torch.Tensor | None:
    """Per-input-channel error weights float32 [K] from calibration statistics; None (equal
    weights) when no statistics are given."""
    if stats is None:
        return None
    stats = stats.detach().float().reshape(-1)
    if stats.numel() != in_features:
        raise UsageError(f"statistics have {stats.numel()} channels but the weight has {in_features} input features")
    if not torch.isfinite(stats).all() or (stats < 0).any():
        raise LowbitError("channel statistics must be finite and non-negative")
    return stats


def grouped_weights(
    stats: torch.Tensor | None, in_features: int, group_size: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Column weights laid out like `grouped(w, group_size)`: [1, G, g] on `device`, or None."""
    weights = column_weights(stats, in_features)
    return None if weights is None else grouped(weights.unsqueeze(0).to(device), group_size)


def search_best(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    candidates: Iterable[tuple[torch.Tensor, ...]],
    fake_quant: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Per group, the candidate parameters with the least weighted squared error.

    x: values [R, G, g]; weight: error weights broadcastable to x, or None for equal weights;
    each candidate is a tuple of tensors [R, G, 1] (e.g. scale, zero) that
    `fake_quant(x, *candidate)` turns into dequantized values (a new tensor it may hand over).
    Ties keep the earlier candidate, so list the plain rule first.
    """
    best: tuple[torch.Tensor, ...] | None = None
    best_err = None
    for cand in candidates:
        diff = fake_quant(x, *cand).sub_(x).square_()
        if weight is not None:
            diff.mul_(weight)
        err = diff.sum(-1, keepdim=True)
        if best is None:
            best, best_err = cand, err
            continue
        better = err < best_err
        best = tuple(torch.where(better, c, b) for c, b in zip(cand, best))
        best_err = torch.minimum(err, best_err)
    if best is None:
        raise ValueError("search_best needs at least one candidate")
    return best


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """A scale of 0 (an all-zero group) divides as 1, so its elements encode to code 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


_SCALE_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def scale_torch_dtype(name: str) -> torch.dtype:
    return _SCALE_TORCH_DTYPES[name]


def round_scale(scale: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """The scale as it will be stored (float16/bfloat16/float32), back in float32.

    A scale too large for the dtype is the user's to fix (pick sfp32), not a silent inf.
    """
    rounded = scale.to(_SCALE_TORCH_DTYPES[scale_dtype]).float()
    if not torch.isfinite(rounded).all():
        raise LowbitError(f"a scale overflows {scale_dtype} (weights too large); use 32-bit scales (e.g. 'int4-sfp32')")
    return rounded
