"""Scratch tensors reused from call to call on one thread: the weight a prefill route decodes to
float32 before torch's GEMM (cpu-int8f's grouped weights, cpu-lut).

Why: a fresh [N, K] float32 tensor per call is a fresh mapping for blocks this large (glibc maps
them on their own), so every call paid a page fault per 4 KB written. Profiled on a 512-token
int8-g32 SmolLM2 prefill (2 Zen 4 cores): the decode's multiply took 3.2 ms per gate|up call for
1.8 M weights, 96 ms of the prefill's 940, where the same multiply into memory already written
takes ~0.1 ms.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat CPU tensor of `numel` elements, valid until this thread's next call: it is the same
    memory every time (grown when a larger one is asked for), so use it and let go of it."""
    held = getattr(_local, "buffers", None)
    if held is None:
        held = _local.buffers = {}
    buf = held.get(dtype)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first asked for under torch.inference_mode (the engine's steps):
        # an inference tensor could not be written in place by a later call outside that mode
        with torch.inference_mode(False):
            buf = held[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
