"""NF4: bitsandbytes' 4-bit NormalFloat code book with one absmax scale per block.

Element code i in 0..15 stands for NF4_VALUES[i] (the 16 values QLoRA derived from normal
quantiles, exactly as bitsandbytes publishes them: -1 … 0 (code 7) … 1); value = NF4_VALUES[i] * scale.
An element is encoded to the nearest code book value (a tie, which needs an exact midpoint,
goes to the lower code).

Stored parts for W[N, K], block size g (64 by default), G = ceil(K / g):
  qweight   uint8 [N, ceil(K/2)]: byte i holds element 2i in the LOW nibble, 2i+1 in the high
            nibble (bitsandbytes packs the first element in the HIGH nibble — exporters swap)
  scales    without double quantization: [N, G] in the scale dtype (float32 by default, like
            bitsandbytes' absmax); 4 + 32/64 = 4.5 bits per weight
            with double quantization (`nf4-dq`): int8 [N, G] codes c of the scales taken as one
            flat row-major run of N*G values; scale = c * scales_scale[(n*G + j) // 256] + scales_offset
  scales_scale   dq only: float32 [ceil(N*G / 256)], one per run of 256 scales (absmax / 127)
  scales_offset  dq only: float32 [1], the mean of all scales, subtracted before quantizing them
  With dq: 4 + 8/64 + 32/(64*256) ≈ 4.127 bits per weight. bitsandbytes quantizes the nested
  scales with its 8-bit dynamic code instead of lowbit's linear int8, so a bitsandbytes export
  re-encodes them.

Scale choice: absmax (bitsandbytes) or mse (default): the absmax and a grid of clipped scales,
the least (stats-weighted) squared error per block. The element codes are computed with the
scales as finally stored (after double quantization).
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.quant import codec
from lowbit.quant.element_grid import ElementGrid
from lowbit.quant.groups import (
    GroupScales,
    check_weight,
    grouped_weights,
    grouped,
    num_groups,
    round_scale,
    safe_divisor,
    scale_torch_dtype,
    search_best,
)
from lowbit.quant.packing import pack_bits, packed_width, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec

NF4_VALUES = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
_MIDPOINTS = (NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2
DQ_BLOCK = 256
_CLIP_GRID = torch.linspace(0.97, 0.70, 10).tolist()


def part_layout(spec: FormatSpec, shape: tuple[int, int]) -> dict:
    n, k = shape
    g = num_groups(k, spec.group_size)
    layout = {"qweight": ((n, packed_width(k, 4)), torch.uint8)}
    if spec.double_quant:
        layout["scales"] = ((n, g), torch.int8)
        layout["scales_scale"] = ((-(-n * g // DQ_BLOCK),), torch.float32)
        layout["scales_offset"] = ((1,), torch.float32)
    else:
        layout["scales"] = ((n, g), scale_torch_dtype(spec.scale_dtype))
    return layout


def quantize_group_values(x, scale, zero, spec: FormatSpec):
    y = x / safe_divisor(scale)
    codes = torch.bucketize(y, _MIDPOINTS.to(y.device), right=False)
    return codes.to(torch.uint8), NF4_VALUES.to(y.device)[codes] * scale


def element_grid(spec: FormatSpec) -> ElementGrid:
    """quantize_group_values as a table: bucketize's ties (right=False) stay on the lower code."""
    return ElementGrid(values=NF4_VALUES.clone(), codes=torch.arange(16, dtype=torch.uint8),
                             mids=_MIDPOINTS.double(), tie_up=torch.zeros(15, dtype=torch.uint8), sign_bit=0)


def dequantize_codes(codes, scale, zero, spec: FormatSpec):
    return NF4_VALUES.to(codes.device)[codes.long()] * scale


def compute_scales(w, spec: FormatSpec, *, stats=None, global_scale=None) -> GroupScales:
    if global_scale is not None:
        raise UsageError(f"{spec.label} has no global scale")
    w = check_weight(w)
    k = w.shape[1]
    wg = grouped(w, spec.group_size)
    weight = grouped_weights(stats, k, spec.group_size, w.device)
    amax = wg.abs().amax(-1, keepdim=True)
    clips = [1.0] + (_CLIP_GRID if spec.scale_rule == "mse" else [])
    candidates = ((round_scale(amax * c, spec.scale_dtype),) for c in clips)
    (scale,) = search_best(wg, weight, candidates, lambda x, s: quantize_group_values(x, s, None, spec)[1])
    scale = scale.squeeze(-1)
    if spec.double_quant:
        stored = _double_quantize(scale)
        scale = _double_dequantize(stored["scales"], stored["scales_scale"], stored["scales_offset"])
    else:
        stored = {"scales": scale.to(scale_torch_dtype(spec.scale_dtype))}
    return GroupScales(scale=scale, zero=None, group_size=spec.group_size, stored=stored)


def _double_quantize(scale: torch.Tensor) -> dict[str, torch.Tensor]:
    flat = scale.reshape(-1)
    offset = flat.mean().reshape(1)
    centered = flat - offset
    pad = -flat.numel() % DQ_BLOCK
    runs = torch.nn.functional.pad(centered, (0, pad)).reshape(-1, DQ_BLOCK)
    second = runs.abs().amax(-1) / 127
    codes = torch.round(runs / safe_divisor(second).unsqueeze(-1)).clamp(-127, 127)
    codes = codes.reshape(-1)[: flat.numel()].reshape(scale.shape).to(torch.int8)
    return {"scales": codes, "scales_scale": second.float(), "scales_offset": offset.float()}


def _double_dequantize(codes: torch.Tensor, second: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1).float()
    per = second.repeat_interleave(DQ_BLOCK)[: flat.numel()]
    return (flat * per + offset).reshape(codes.shape)


def scales_from_values(scale: torch.Tensor, sc: GroupScales, spec: FormatSpec) -> GroupScales | None:
    """`sc` with new float32 absmax values [N, G] (GPTQ's refit); None with double quantization,
    whose 8-bit codes are fitted to the whole matrix at once."""
    if spec.double_quant:
        return None
    dtype = scale_torch_dtype(spec.scale_dtype)
    s = round_scale(scale.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max), spec.scale_dtype)
    return GroupScales(scale=s, zero=None, group_size=sc.group_size, stored={"scales": s.to(dtype)})


def scales_from_parts(qt: QTensor) -> GroupScales:
    if qt.spec.double_quant:
        scale = _double_dequantize(qt.scales, qt.scales_scale, qt.scales_offset)
    else:
        scale = qt.scales.float()
    return GroupScales(scale=scale, zero=None, group_size=qt.spec.group_size, stored=qt.scale_parts())


def pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return pack_bits(codes, 4)


def unpack(packed: torch.Tensor, spec: FormatSpec, in_features: int) -> torch.Tensor:
    return unpack_bits(packed, 4, in_features)


# The whole-matrix functions are the same for every format (quant/codec.py).
quantize, dequantize, fake_quantize_column, bits_per_weight = codec.public_functions(__name__)
