"""Weights the CPU kernels stream, placed in memory backed by 2 MB transparent huge pages.

Why: a decode step reads every weight once from DRAM, in runs of 0.2-1 MB per matrix. On 4 KB
pages every new page costs a TLB walk and the hardware prefetchers stop at each page boundary;
torch's allocator gives 4 KB pages wherever the kernel's THP policy is `madvise` (the common
default). Measured on 2 Zen 3 cores (SmolLM2-135M's 120 int4 matrices, 66 MB, called in decode
order from C): 14.8 GB/s on 4 KB pages, 17.0 GB/s on huge pages, alternated four times.

Inside `with arena():` (the engine loads its model so), `place(t)` copies a tensor into a chunk of
anonymous memory advised MADV_HUGEPAGE (chunks of CHUNK_BYTES, 2 MB aligned, filled front to
back; a tensor larger than a chunk gets its own), and the prepare steps of the CPU paths and the
dense kernel's weight swaps call it on what they keep. A copy keeps its chunk alive (torch.frombuffer
holds the mapping) and a chunk is unmapped when its last tensor dies. Outside an arena (quantize,
calibrate, tests: weights made and dropped by the thousand), where the kernel has no THP (`never`,
or not Linux), for CUDA tensors, tensors under MIN_BYTES, and with LOWBIT_HUGEPAGES=0, `place`
returns its argument unchanged.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
MIN_BYTES = 64 << 10  # smaller tensors stay where they are: a huge page would mostly hold other things
ALIGN = 64
_THP_POLICY = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the chunk being filled, uint8
_used = 0
_enabled: bool | None = None
_depth = 0  # open arena() contexts


def enabled() -> bool:
    """Whether `place` copies: Linux with THP `always` or `madvise`, and LOWBIT_HUGEPAGES not 0."""
    global _enabled
    if os.environ.get("LOWBIT_HUGEPAGES", "1") == "0":
        return False
    if _enabled is None:
        try:
            _enabled = "[never]" not in _THP_POLICY.read_text() and hasattr(mmap, "MADV_HUGEPAGE")
        except OSError:
            _enabled = False
    return _enabled


def _new_chunk(size: int) -> torch.Tensor:
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    # private: a shared anonymous mapping (mmap's default) is shmem, which THP's `enabled` does not cover
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE  # a multiple of the 4 KB page size: mmap returns page-aligned memory
    mapping.madvise(mmap.MADV_HUGEPAGE, skip, size)
    return whole[skip : skip + size]


def _take(nbytes: int) -> torch.Tensor:
    global _chunk, _used
    with _lock:
        if nbytes > CHUNK_BYTES:
            return _new_chunk(nbytes)[:nbytes]
        start = -(-_used // ALIGN) * ALIGN
        if _chunk is None or start + nbytes > _chunk.numel():
            _chunk, start = _new_chunk(CHUNK_BYTES), 0
        _used = start + nbytes
        return _chunk[start : start + nbytes]


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """Weights prepared inside go to huge pages (see the module docstring); the chunk being filled
    is let go at the end, so the next model starts a fresh one."""
    global _depth, _chunk, _used
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _chunk, _used = None, 0


def place(t: torch.Tensor) -> torch.Tensor:
    """Inside `arena()`: a contiguous copy of CPU tensor t on huge pages (same dtype, shape and
    values). t itself outside one, where huge pages are off, or for a small t."""
    if (not _depth or t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or t.requires_grad
            or not enabled()):
        return t
    nbytes = t.numel() * t.element_size()
    out = _take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
