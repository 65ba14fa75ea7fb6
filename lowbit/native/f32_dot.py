"""ctypes bindings of native/f32_dot.c: batch-invariant float32 matmul at a few rows, float32 or bfloat16 weights
and bf16 x bf16 for bf16 models (kernels/cpu_f32.py), bf16 weights packed losslessly in 12 bits
(kernels/cpu_bf16pack.py); `lowbit_f32dot_available()` is 0 in a build without
AVX-512, `lowbit_bf16dot_available()` without AVX512-BF16."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_f32dot_available": [],
    "lowbit_f32_matmul": [P, I64, I64, I64, P, P, I64, I64, P, I64, INT],
    "lowbit_bf16w_matmul": [P, I64, I64, I64, P, P, I64, I64, P, I64, INT],
    "lowbit_bf16dot_available": [],
    "lowbit_bf16_matmul": [P, I64, I64, I64, P, P, I64, I64, P, INT, I64, INT],
    "lowbit_bf16xw_matmul": [P, I64, I64, I64, P, P, I64, I64, P, I64, INT],
    "lowbit_bf16pxw_matmul": [P, I64, I64, I64, P, P, I64, I64, P, I64, INT],
    "lowbit_bf16p_escapes": [P, I64, I64, I64, P, INT],
    "lowbit_bf16p_pack": [P, I64, I64, I64, P, P, P, P, P, INT],
}

library = build.binding("f32_dot", SIGNATURES)
