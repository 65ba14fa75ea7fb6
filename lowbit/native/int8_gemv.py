"""ctypes bindings of native/int8_gemv.c: symmetric int8 weights times float32 activations, batch-invariant
(kernels/cpu_int8.py, the cpu-int8f path); `lowbit_int8f_available()` is 1 with AVX-512, 2 with AVX2 only, 0 in a build with neither."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_int8f_available": [],
    # q, N, K, ldw, scales, G, group, x, ldx, M, y, ldy, threads
    "lowbit_int8f_matmul": [P, I64, I64, I64, P, I64, I64, P, I64, I64, P, I64, INT],
}

library = build.binding("int8_gemv", SIGNATURES)
