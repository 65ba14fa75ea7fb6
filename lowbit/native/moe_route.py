"""ctypes bindings of native/moe_route.c: mixture-of-experts routing and the shared-expert gate
(kernels/cpu_moe.py), shared by the model's forward and the one-call decode step."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_moe_route": [P, I64, I64, I64, P, I64, I64, INT, P, P, INT],
    "lowbit_moe_shared_gate": [P, I64, I64, I64, P, P],
}

library = build.binding("moe_route", SIGNATURES)
