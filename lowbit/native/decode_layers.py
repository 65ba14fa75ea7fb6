"""ctypes bindings of native/decode_layers.c: the Llama-family decoder layers of an engine step of
short items in one call, through the other kernels' entry points (kernels/decode_chain.py builds
its structs), and a dense head's greedy argmax through its int8 copy (kernels/screened_head.py)."""

from __future__ import annotations

from lowbit.native import build
from lowbit.native.build import I64, INT, P

SIGNATURES = {
    "lowbit_decode_layers": [P, P, I64, I64, P, P, P, INT],
    "lowbit_decode_steps": [P, P, P, P, P, P, I64, P, P, P, P, P, P, P, P, INT],
    "lowbit_screened_argmax": [P, P, P, I64, P, INT],
    "lowbit_screen_row": [P, P, I64, P],
}

library = build.binding("decode_layers", SIGNATURES)
