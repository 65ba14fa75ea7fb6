"""ctypes bindings of native/paged_decode.c: decode attention over the paged KV pool with RoPE and
the KV write fused (kernels/cpu_attention.py)."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import F32, I64, INT, P

_ARGS = [P, I64, P, I64, P, I64, P, P, INT, P, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, I64, F32, INT]
# lowbit_paged_decode = lowbit_paged_write (k and v into the pool), then lowbit_paged_attend: the
# one-region decode step (native/decode_layers.c) calls the halves with a barrier between them
SIGNATURES = {name: _ARGS for name in ("lowbit_paged_decode", "lowbit_paged_write", "lowbit_paged_attend")}

library = build.binding("paged_decode", SIGNATURES)
