"""A dense head's greedy argmax read mostly through its int8 copy (native/decode_layers.c
screened_argmax): the exact tokens at 0.56 of the head's bytes.

A several-step greedy call (runtime/engine/multi_step.py) needs each row's first largest logit,
not the logits. The copy (8-bit codes in groups of 32, float16 scales: int4_vnni.c's layout, made
in one C pass by lowbit_i4v_screen8) gives every logit to within a bound the C side computes per
row and vocabulary entry, screened inside the copy's matmul (int4_vnni.c lowbit_i4v_screen_matmul);
only the head rows whose bound reaches the best go through the head's own kernel, so the chosen
token is the one the whole head would give, ties included. Any number of rows, in passes of up to
64; where the screen cannot decide (x not finite, too many candidates) the step reads the whole
head.

`build(weight, x_bf16)` makes the copy of a dense head weight as InvariantLinear runs it (x_bf16:
its rows of x rounded to bf16 first), or returns None where the screen does not apply (no
AVX512-VNNI, K not a multiple of 32, another dtype). The copy lives on huge pages (kernels/
hugepages.py) like the weights a decode streams.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import c_int32, c_int64, c_void_p
from dataclasses import dataclass

import torch

from lowbit.errors import UsageError
from lowbit.kernels import cpu_int4dot, hugepages
from lowbit.kernels.decode_chain import ChainLinear, Linear, entry, int4_linear
from lowbit.kernels.prepared import PreparedWeight
from lowbit.native import decode_layers, int4_vnni

ENV = "LOWBIT_HEAD_SCREEN"  # "0": several-step calls read the whole head (measurements, tests)
AFTER_ENV = "LOWBIT_HEAD_SCREEN_AFTER"  # greedy tokens a decoder takes through the whole head before making the copy
# Making the copy touches ~0.7 of the head's bytes in fresh memory once (Gemma-3: 180 MB, 0.56 s in an
# engine on this VM, mostly the kernel zeroing new huge pages), and it saves ~2.2 ms a greedy token
# there: a decoder makes it once it has taken that many tokens the slow way (so a run at most
# doubles what the copy would have saved or cost: a short `generate` never pays for it).
AFTER_TOKENS = 256
GROUP = 32  # the copy's group along K (x is rounded to int8 per group too)


class ChainScreen(ctypes.Structure):
    _fields_ = [("approx", ChainLinear), ("err2", c_void_p), ("norm2", c_void_p), ("x_bf16", c_int32),
                ("w_bytes", c_int32), ("group", c_int64), ("screen_fn", c_void_p)]


@dataclass(slots=True)
class HeadScreen:
    """The int8 copy of one head weight and its per-row bounds; `struct` is what the C side reads
    (valid while this lives)."""

    struct: ChainScreen
    approx: Linear
    err2: torch.Tensor  # [V] float32 >= ||W_v - W^_v||
    norm2: torch.Tensor  # [V] float32 >= max(||W_v||, ||W^_v||)

    @property
    def nbytes(self) -> int:
        """The bytes the copy adds (codes, scales, the two bound tables)."""
        return self.approx.keep.nbytes + self.err2.numel() * 4 + self.norm2.numel() * 4


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def after_tokens() -> int:
    """Greedy tokens through the whole head before the copy is made (LOWBIT_HEAD_SCREEN_AFTER)."""
    raw = os.environ.get(AFTER_ENV, "").strip()
    if raw == "":
        return AFTER_TOKENS
    if not (raw.isascii() and raw.isdigit()):  # 0 is allowed: the copy at the first greedy token
        raise UsageError(f"{AFTER_ENV} must be a whole number >= 0, got {raw!r}")
    return int(raw)


def build(weight: torch.Tensor, x_bf16: bool) -> HeadScreen | None:
    """The screen of a dense head weight [V, K] (float32 or bf16, contiguous, on the CPU), or None
    where it does not apply."""
    lib = int4_vnni.library()
    if (lib is None or lib.lowbit_i4v_available() != 1 or decode_layers.library() is None or weight.dim() != 2
            or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu"
            or not weight.is_contiguous() or weight.shape[1] % GROUP):
        return None
    v, k = weight.shape
    kp, quads, groups = -(-k // 64) * 64, -(-v // 64), k // GROUP
    with hugepages.arena():
        codes = hugepages.empty((quads, kp * 64), torch.uint8)
        scales = hugepages.empty((quads * 4, groups, 16), torch.float16)
    err2, norm2 = torch.empty(v), torch.empty(v)
    rc = lib.lowbit_i4v_screen8(weight.data_ptr(), int(weight.dtype is torch.bfloat16), v, k, weight.stride(0),
                                codes.data_ptr(), scales.data_ptr(), err2.data_ptr(), norm2.data_ptr(),
                                torch.get_num_threads())
    if rc != 0:
        return None
    tensors = {"codes": codes, "table": torch.arange(256, dtype=torch.float32) - 128, "scales": scales,
               "offset": torch.tensor(128), "bits": torch.tensor(8)}
    params = cpu_int4dot.kernel_params(tensors, v, k, groups, GROUP // 8)
    pw = PreparedWeight(path=cpu_int4dot.INT8_PATH, shape=(v, k), label=f"int8-g{GROUP}", device=torch.device("cpu"),
                        tensors=tensors, params=params)
    approx = int4_linear(pw)
    if approx is None:
        return None
    struct = ChainScreen(approx.struct, err2.data_ptr(), norm2.data_ptr(), int(x_bf16), weight.element_size(), GROUP,
                         entry(lib, "lowbit_i4v_screen_matmul"))
    return HeadScreen(struct, approx, err2, norm2)


def argmax(screen: HeadScreen, head: Linear, x: torch.Tensor) -> torch.Tensor | None:
    """Each row's greedy token of `head` (the dense Linear the screen was built from) at x [M, K]
    float32, through the screen; None where the screen cannot decide (the caller reads the head)."""
    x = x.float().contiguous()
    m = x.shape[0]
    tokens = torch.empty(m, dtype=torch.long)
    rc = decode_layers.library().lowbit_screened_argmax(ctypes.byref(head.struct), ctypes.byref(screen.struct),
                                                        x.data_ptr(), m, tokens.data_ptr(), torch.get_num_threads())
    if rc == 1:
        return None
    if rc != 0:
        raise RuntimeError(f"lowbit_screened_argmax failed with code {rc}")
    return tokens


def row_bound(screen: HeadScreen, x: torch.Tensor) -> tuple[float, float, float] | None:
    """The C side's numbers for one row x [K] (tests): X2 and C of the bound B_v = X2 err2_v +
    C norm2_v, and its absolute slack; None for x that is not finite."""
    x = x.float().contiguous()
    out = torch.empty(3)
    if decode_layers.library().lowbit_screen_row(ctypes.byref(screen.struct), x.data_ptr(), x.numel(), out.data_ptr()):
        return None
    return float(out[0]), float(out[1]), float(out[2])
