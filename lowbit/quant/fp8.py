"""FP8 weights: E4M3 (`fp8`, max 448, no inf, NaN = 0x7F/0xFF) or E5M2 (`fp8-e5m2`, max 57344).

Each weight is stored as one fp8 number; value = fp8 * scale. The fp8 cast is torch's
(round to nearest, ties to even; checked against lowbit's own tables in the tests) after a
clamp to the largest finite value, so out-of-range values saturate.

Stored parts for W[N, K]:
  qweight  torch.float8_e4m3fn (or float8_e5m2) [N, K], row-major, no packing
  scales   in the scale dtype (float32 default):
             fp8-channel (default)  [N, 1]   one per output row
             fp8-tensor             [1]      one for the matrix
             fp8-block128           [ceil(N/128), ceil(K/128)]: tile (i, j) covers rows
                                    128i..128i+127 and columns 128j..128j+127 (ragged at the edges)
Bits per weight: 8 + scale bits / (K | N*K | 128*128).

Scale choice: absmax (scale = amax / fp8 max) or mse (default): absmax and a few slightly
clipped candidates, least (stats-weighted) squared error per row/tile/tensor.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.quant import codec
from lowbit.quant.groups import (
    GroupScales,
    check_weight,
    column_weights,
    num_groups,
    round_scale,
    safe_divisor,
    scale_torch_dtype,
    search_best,
)
from lowbit.quant.minifloat import E4M3_MAX, E5M2_MAX, to_fp8
from lowbit.quant.minifloat import element_grid as minifloat_grid
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec

_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
_CLIP_GRID = torch.linspace(0.98, 0.80, 10).tolist()


def part_layout(spec: FormatSpec, shape: tuple[int, int]) -> dict:
    n, k = shape
    sdt = scale_torch_dtype(spec.scale_dtype)
    if spec.granularity == "channel":
        scales = ((n, 1), sdt)
    elif spec.granularity == "tensor":
        scales = ((1,), sdt)
    else:
        b = spec.group_size
        scales = ((num_groups(n, b), num_groups(k, b)), sdt)
    return {"qweight": ((n, k), _TORCH[spec.element]), "scales": scales}


def quantize_group_values(x, scale, zero, spec: FormatSpec):
    f8 = to_fp8(x / safe_divisor(scale), spec.element)
    return f8.view(torch.uint8), f8.float() * scale


def element_grid(spec: FormatSpec):
    return minifloat_grid(spec.element)


def dequantize_codes(codes, scale, zero, spec: FormatSpec):
    return codes.view(_TORCH[spec.element]).float() * scale


def _tiles(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """[N, K] → [R, G, E]: the elements sharing each scale along the last axis."""
    n, k = x.shape
    if spec.granularity == "channel":
        return x.unsqueeze(1)
    if spec.granularity == "tensor":
        return x.reshape(1, 1, -1)
    b = spec.group_size
    nb, kb = num_groups(n, b), num_groups(k, b)
    x = torch.nn.functional.pad(x, (0, kb * b - k, 0, nb * b - n))
    return x.reshape(nb, b, kb, b).permute(0, 2, 1, 3).reshape(nb, kb, b * b)


def compute_scales(w, spec: FormatSpec, *, stats=None, global_scale=None) -> GroupScales:
    if global_scale is not None:
        raise UsageError(f"{spec.label} has no global scale")
    w = check_weight(w)
    n, k = w.shape
    x = _tiles(w, spec)
    columns = column_weights(stats, k)
    weight = None if columns is None else _tiles(columns.to(w.device).unsqueeze(0).expand(n, k), spec)
    amax = x.abs().amax(-1, keepdim=True)
    limit = _MAX[spec.element]
    clips = [1.0] + (_CLIP_GRID if spec.scale_rule == "mse" else [])
    candidates = ((round_scale(amax / (limit * c), spec.scale_dtype),) for c in clips)
    (scale,) = search_best(x, weight, candidates, lambda v, s: quantize_group_values(v, s, None, spec)[1])
    scale = scale.squeeze(-1)  # [R, G]
    if spec.granularity == "tensor":
        scale = scale.reshape(1)
    stored = {"scales": scale.to(scale_torch_dtype(spec.scale_dtype))}
    return _per_row(stored["scales"].float(), spec, (n, k), stored)


def _per_row(scales: torch.Tensor, spec: FormatSpec, shape: tuple[int, int], stored: dict) -> GroupScales:
    n, k = shape
    if spec.granularity == "channel":
        return GroupScales(scale=scales.reshape(n, 1), zero=None, group_size=k, stored=stored)
    if spec.granularity == "tensor":
        return GroupScales(scale=scales.reshape(1, 1).expand(n, 1), zero=None, group_size=k, stored=stored)
    rows = scales.repeat_interleave(spec.group_size, dim=0)[:n]
    return GroupScales(scale=rows, zero=None, group_size=spec.group_size, stored=stored)


def scales_from_values(scale: torch.Tensor, sc: GroupScales, spec: FormatSpec) -> GroupScales | None:
    """`sc` with new per-row float32 scales [N, 1] (GPTQ's refit); None for tensor and block scales,
    which rows do not own."""
    if spec.granularity != "channel":
        return None
    dtype = scale_torch_dtype(spec.scale_dtype)
    s = round_scale(scale.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max), spec.scale_dtype)
    stored = {"scales": s.reshape(sc.stored["scales"].shape).to(dtype)}
    return _per_row(stored["scales"].float(), spec, (s.shape[0], sc.group_size), stored)


def scales_from_parts(qt: QTensor) -> GroupScales:
    return _per_row(qt.scales.float(), qt.spec, qt.shape, qt.scale_parts())


def pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return codes.to(torch.uint8).contiguous().view(_TORCH[spec.element])


def unpack(packed: torch.Tensor, spec: FormatSpec, in_features: int) -> torch.Tensor:
    return packed.view(torch.uint8)


# The whole-matrix functions are the same for every format (quant/codec.py).
quantize, dequantize, fake_quantize_column, bits_per_weight = codec.public_functions(__name__)
