"""NVFP4: E2M1 elements in blocks of 16 with an FP8-E4M3 block scale and an FP32 tensor scale.

value = E2M1(code) * E4M3(block_scale) * global_scale      (both scales MULTIPLY)

global_scale = amax(W) / (6 * 448): chosen so the largest block scale uses E4M3's full range.
The block scale is stored as e4m3(block_amax / 6 / global_scale). This is the convention of
NVIDIA's ModelOpt checkpoints (`weight_scale_2` = global_scale). compressed-tensors stores the
reciprocal instead (`weight_global_scale` = 6*448 / amax) and DIVIDES by it; an exporter writes
1 / global_scale (equal to within one float32 rounding).

Layers that run fused (q/k/v, gate/up) must share one global scale: compute it with
`global_scale_for(wq, wk, wv)` and pass it to `quantize(..., global_scale=g)` for each.

Stored parts for W[N, K], G = ceil(K / 16) (a ragged last block when 16 does not divide K):
  qweight       uint8 [N, ceil(K/2)], E2M1 codes, element 2i in the LOW nibble of byte i
  scales        torch.float8_e4m3fn [N, G]
  global_scale  float32 [1]
Bits per weight: 4 + 8/16 = 4.5 (+ 32 bits per matrix).

E2M1 rounding: nearest, ties to the even code, saturating at 6 (quant/minifloat.py).
Scale rule: absmax (the block scale above) or mse (default): that E4M3 code and its neighbours
one up and up to four down, the least (stats-weighted) squared error per block.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.quant import codec
from lowbit.quant.groups import GroupScales, check_weight, grouped_weights, grouped, num_groups, search_best
from lowbit.quant.minifloat import E2M1_MAX, E4M3_MAX, to_fp8
from lowbit.quant.fp4_elements import dequantize_codes, element_grid, quantize_group_values  # noqa: F401 - part of the format interface
from lowbit.quant.fp4_elements import fake_quantize as _fake_quantize
from lowbit.quant.packing import pack_bits, packed_width, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec

BLOCK = 16
_MAX_CODE = 0x7E  # largest finite positive E4M3 code (448)
_CODE_STEPS = (0, 1, -1, -2, -3, -4)


def part_layout(spec: FormatSpec, shape: tuple[int, int]) -> dict:
    n, k = shape
    return {
        "qweight": ((n, packed_width(k, 4)), torch.uint8),
        "scales": ((n, num_groups(k, BLOCK)), torch.float8_e4m3fn),
        "global_scale": ((1,), torch.float32),
    }




def global_scale_for(*weights: torch.Tensor) -> torch.Tensor:
    """The float32 [1] global scale shared by weights that run fused: amax / (6 * 448)."""
    amax = max(float(check_weight(w).abs().max()) for w in weights)
    if amax == 0.0:
        return torch.ones(1)  # all-zero weights: any scale works, the block scales are all 0
    return (torch.tensor([amax], dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)).float()


def compute_scales(w, spec: FormatSpec, *, stats=None, global_scale=None) -> GroupScales:
    w = check_weight(w)
    k = w.shape[1]
    if global_scale is None:
        global_scale = global_scale_for(w)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).to(w.device)
    if not (torch.isfinite(global_scale).all() and global_scale.item() > 0):
        raise UsageError(f"nvfp4 global scale must be a positive finite number, got {global_scale.item()}")
    wg = grouped(w, BLOCK)
    weight = grouped_weights(stats, k, BLOCK, w.device)
    amax = wg.abs().amax(-1, keepdim=True)
    base = to_fp8(amax / E2M1_MAX / global_scale).view(torch.uint8).to(torch.int32)
    steps = _CODE_STEPS if spec.scale_rule == "mse" else (0,)

    def candidates():
        for d in steps:
            code = (base + d).clamp(0, _MAX_CODE)
            yield _decode_scale(code, global_scale), code

    _, code = search_best(wg, weight, candidates(), lambda x, s, _c: _fake_quantize(x, s))
    block = code.squeeze(-1).to(torch.uint8).view(torch.float8_e4m3fn)
    stored = {"scales": block, "global_scale": global_scale.clone()}
    return GroupScales(scale=block.float() * global_scale, zero=None, group_size=BLOCK, stored=stored)


def _decode_scale(code: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(torch.float8_e4m3fn).float() * global_scale


def scales_from_values(scale: torch.Tensor, sc: GroupScales, spec: FormatSpec) -> GroupScales:
    """`sc` with new block scales [N, G] (GPTQ's refit), rounded to E4M3 codes of the same global scale."""
    global_scale = sc.stored["global_scale"]
    code = to_fp8(scale.clamp(min=0) / global_scale).view(torch.uint8).clamp(max=_MAX_CODE)
    block = code.view(torch.float8_e4m3fn)
    stored = {"scales": block, "global_scale": global_scale.clone()}
    return GroupScales(scale=block.float() * global_scale, zero=None, group_size=BLOCK, stored=stored)


def scales_from_parts(qt: QTensor) -> GroupScales:
    return GroupScales(scale=qt.scales.float() * qt.global_scale.float(), zero=None, group_size=BLOCK, stored=qt.scale_parts())


def pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return pack_bits(codes, 4)


def unpack(packed: torch.Tensor, spec: FormatSpec, in_features: int) -> torch.Tensor:
    return unpack_bits(packed, 4, in_features)


# The whole-matrix functions are the same for every format (quant/codec.py).
quantize, dequantize, fake_quantize_column, bits_per_weight = codec.public_functions(__name__)
