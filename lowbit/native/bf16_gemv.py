"""ctypes bindings of native/bf16_gemv.c: the bf16 dot-product matmul behind the cpu-bf16 path
(kernels/cpu_bf16.py); `lowbit_bf16_available()` is 0 in a build without AVX512-BF16."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_bf16_available": [],
    "lowbit_bf16_matmul": [P, P, I64, I64, P, INT, INT],
    "lowbit_bf16_dequant": [P, P, I64, INT, INT],
}

library = build.binding("bf16_gemv", SIGNATURES)
