"""ctypes bindings of native/lut_gemv.c: the LUT matmul and dequantize behind the cpu-lut path
(kernels/cpu_lut.py), for every 4-bit and 8-bit format."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

_WEIGHT = [INT, INT, P, I64, P, P, INT, P, P, I64, I64, I64, I64, I64]  # bits, kind, codes, ... row_div

SIGNATURES = {
    "lowbit_lut_matmul": [*_WEIGHT, P, I64, I64, P, INT],
    "lowbit_lut_dequant": [*_WEIGHT, P, I64, INT],
}

library = build.binding("lut_gemv", SIGNATURES)
