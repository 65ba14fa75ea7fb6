"""MXFP4 (OCP Microscaling Formats v1.0): E2M1 elements in blocks of 32 sharing an E8M0 scale.

value = E2M1(code) * 2^(scale_code - 127). E2M1 codes: bit 3 sign, bits 0-2 magnitude
0, 0.5, 1, 1.5, 2, 3, 4, 6; encoding rounds to nearest, ties to the even code, saturating at 6
(quant/minifloat.py). E8M0 scale codes 0..254 are 2^-127..2^127; 0xFF (NaN) is never written.

Stored parts for W[N, K], G = ceil(K / 32) (a ragged last block when 32 does not divide K):
  qweight  uint8 [N, ceil(K/2)]: byte i = element 2i in the LOW nibble, element 2i+1 in the high
           nibble (GGUF's MXFP4 pairs element j with j+16 instead — exporters reorder)
  scales   uint8 [N, G] E8M0 codes
Bits per weight: 4 + 8/32 = 4.25.

Scale rule (spec.scale_rule), with amax the block's largest magnitude:
  floor    the OCP v1.0 rule: exponent = floor(log2(amax)) - 2 (2 = E2M1's largest exponent).
           amax/scale lands in [4, 8), so values above 6*scale are clipped to 6.
  roundup  the smallest power of two with amax/scale <= 6: nothing is clipped, but small
           values lose resolution (floor's exponent, plus one when amax/2^floor > 6).
  mse      (default) per block the better of floor-1, floor and floor+1 (which covers both
           rules) by (stats-weighted) squared error. Measured relative error ||W-Q||/||W|| on
           random 1024x1024 weights (Gaussian / Student-t nu=5 / nu=3):
             floor 0.1141 / 0.1268 / 0.1303, roundup 0.1185 / 0.1324 / 0.1378, mse 0.1114 / 0.1227 / 0.1260.
           On SmolLM2-135M's 210 Linear weights (pooled): floor 0.1177, roundup 0.1187, mse 0.1132.
           floor beats roundup (clipping one value costs less than coarser steps for all 31
           others), and choosing per block beats both by 2-3%, so mse is the default and
           floor (the OCP rule) is the better fixed rule.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.quant import codec
from lowbit.quant.groups import GroupScales, check_weight, grouped_weights, grouped, num_groups, search_best
from lowbit.quant.minifloat import E2M1_MAX, e8m0_to_float, float_to_e8m0
from lowbit.quant.fp4_elements import dequantize_codes, element_grid, quantize_group_values  # noqa: F401 - part of the format interface
from lowbit.quant.fp4_elements import fake_quantize as _fake_quantize
from lowbit.quant.packing import pack_bits, packed_width, unpack_bits
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec

BLOCK = 32


def part_layout(spec: FormatSpec, shape: tuple[int, int]) -> dict:
    n, k = shape
    return {
        "qweight": ((n, packed_width(k, 4)), torch.uint8),
        "scales": ((n, num_groups(k, BLOCK)), torch.uint8),
    }




def floor_exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) - 2, exactly (frexp, not a float log); -3 for an all-zero block."""
    _, exp = torch.frexp(amax)
    return exp.to(torch.int32) - 1 - 2


def roundup_exponent(amax: torch.Tensor) -> torch.Tensor:
    e = floor_exponent(amax)
    return e + (amax > E2M1_MAX * _pow2(e)).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.clamp(-127, 127))


def compute_scales(w, spec: FormatSpec, *, stats=None, global_scale=None) -> GroupScales:
    if global_scale is not None:
        raise UsageError(f"{spec.label} has no global scale")
    w = check_weight(w)
    k = w.shape[1]
    wg = grouped(w, BLOCK)
    weight = grouped_weights(stats, k, BLOCK, w.device)
    amax = wg.abs().amax(-1, keepdim=True)
    e_floor = floor_exponent(amax)
    if spec.scale_rule == "floor":
        exps = [e_floor]
    elif spec.scale_rule == "roundup":
        exps = [roundup_exponent(amax)]
    else:
        exps = [e_floor, e_floor + 1, e_floor - 1]
    candidates = ((_pow2(e), e) for e in exps)
    scale, e = search_best(wg, weight, candidates, lambda x, s, _e: _fake_quantize(x, s))
    codes = float_to_e8m0(e.squeeze(-1))
    return GroupScales(scale=e8m0_to_float(codes), zero=None, group_size=BLOCK, stored={"scales": codes})


def scales_from_parts(qt: QTensor) -> GroupScales:
    return GroupScales(scale=e8m0_to_float(qt.scales), zero=None, group_size=BLOCK, stored=qt.scale_parts())


def pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return pack_bits(codes, 4)


def unpack(packed: torch.Tensor, spec: FormatSpec, in_features: int) -> torch.Tensor:
    return unpack_bits(packed, 4, in_features)


# The whole-matrix functions are the same for every format (quant/codec.py).
quantize, dequantize, fake_quantize_column, bits_per_weight = codec.public_functions(__name__)
