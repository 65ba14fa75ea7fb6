"""ctypes bindings of native/int4_dot.c: integer 4-bit codes against bf16 activations, the
cpu-int4dot path's bf16 route (kernels/cpu_int4dot.py); `lowbit_i4_available()` is 0 in a build
without AVX512-BF16."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_i4_available": [],
    "lowbit_i4_matmul": [P, P, INT, I64, I64, P, INT, I64, INT],
}

library = build.binding("int4_dot", SIGNATURES)
