"""ctypes bindings of native/paged_decode.c: decode attention over the paged KV pool with RoPE and
the KV write fused (kernels/cpu_attention.py)."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import F32, I64, INT, P

SIGNATURES = {
    "lowbit_paged_decode": [P, I64, P, I64, P, I64, P, P, INT, P, P, P, P, I64, P, P, P,
                            I64, I64, I64, I64, I64, I64, F32, INT],
}

library = build.binding("paged_decode", SIGNATURES)
