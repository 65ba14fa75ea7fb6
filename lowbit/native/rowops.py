"""ctypes bindings of native/rowops.c: RMSNorm, residual add + RMSNorm and act(gate) * up, one
call per op, and the logit rows' argmax, finiteness and top-k indices, and a draft head's rescoring (kernels/cpu_rowops.py)."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import F32, I64, INT, P

SIGNATURES = {
    "lowbit_rmsnorm": [P, I64, I64, I64, I64, P, F32, INT, INT, P, I64, INT],
    "lowbit_add_rmsnorm": [P, I64, P, I64, P, I64, I64, P, F32, INT, INT, P, I64, P, I64, INT],
    "lowbit_act_mul": [P, I64, P, I64, I64, I64, INT, INT, P, I64, INT],
    "lowbit_logit_rows": [P, I64, I64, I64, P, INT],
    "lowbit_top_rows": [P, I64, I64, I64, I64, P],
    "lowbit_rescore_rows": [P, I64, I64, P, I64, P, P, INT, I64, P, I64, P],
}

library = build.binding("rowops", SIGNATURES)
