"""ctypes bindings of native/int4_vnni.c: integer 4-bit (and 8-bit) codes against int8
activations, the cpu-int4dot path's int8 route and cpu-int8dot (kernels/cpu_int4dot.py);
`lowbit_i4v_available()` is 1 with AVX512-VNNI (4- and 8-bit codes), 2 with AVX2 only (4-bit
codes), 0 in a build with neither."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_i4v_available": [],
    "lowbit_i4v_matmul": [P, P, INT, I64, I64, P, INT, I64, INT],
    "lowbit_i4v_screen8": [P, INT, I64, I64, I64, P, P, P, P, INT],
    "lowbit_i4v_screen_matmul": [P, P, I64, P, INT],
}

library = build.binding("int4_vnni", SIGNATURES)
