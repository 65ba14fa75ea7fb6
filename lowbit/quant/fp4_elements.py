"""The E2M1 element quantizer shared by the FP4 formats (mxfp4, nvfp4).

The two formats differ only in how they choose and store block scales; given a scale, an element
is encoded, rounded and decoded the same way, so both modules take these functions from here.
"""

from __future__ import annotations

from lowbit.quant.groups import safe_divisor
from lowbit.quant.minifloat import decode_e2m1, element_grid as _minifloat_grid, encode_e2m1, round_e2m1


def quantize_group_values(x, scale, zero, spec):
    codes = encode_e2m1(x / safe_divisor(scale))
    return codes, decode_e2m1(codes) * scale


def fake_quantize(x, scale):
    """The values of quantize_group_values without the codes (the scale search's hot loop)."""
    return round_e2m1(x / safe_divisor(scale)).mul_(scale)


def element_grid(spec):
    return _minifloat_grid("e2m1")


def dequantize_codes(codes, scale, zero, spec):
    return decode_e2m1(codes) * scale
