"""Weights the CPU kernels stream, placed in memory backed by 2 MB transparent huge pages.

Why: a decode step reads every weight once from DRAM, in runs of 0.2-1 MB per matrix. On 4 KB
pages every new page costs a TLB walk and the hardware prefetchers stop at each page boundary;
torch's allocator gives 4 KB pages wherever the kernel's THP policy is `madvise` (the common
default). Measured on 2 Zen 3 cores (SmolLM2-135M's 120 int4 matrices, 66 MB, called in decode
order from C): 14.8 GB/s on 4 KB pages, 17.0 GB/s on huge pages, alternated four times.

Inside `with arena():` (the engine loads its model so), `place(t)` copies a tensor into a chunk of
anonymous memory advised MADV_HUGEPAGE (chunks of CHUNK_BYTES, 2 MB aligned, filled front to
back; a tensor larger than a chunk gets its own). The quantized paths' prepare steps place what
they keep; the engine then starts a new generation of chunks (`new_generation`), joins q/k/v and
gate/up (the joins place what they make) and moves every other weight a decode streams into the
new chunks (`place_weights`), so the separate projections the joins replaced leave nothing behind:
a chunk gives back nothing until its last tensor dies (torch.frombuffer holds the mapping), and
the load's chunks die whole. Outside an arena (quantize,
calibrate, tests: weights made and dropped by the thousand), where the kernel has no THP (`never`,
or not Linux), for CUDA tensors, tensors under MIN_BYTES, and with LOWBIT_HUGEPAGES=0, `place`
returns its argument unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading
import weakref
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
_chunks: dict[int, int] = {}  # the storage address of each live chunk -> its generation
_generation = 0  # new_generation() counts


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
    _chunks[whole.data_ptr()] = _generation  # what placed() recognizes, until the mapping goes
    weakref.finalize(mapping, _chunks.pop, whole.data_ptr(), None)
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


def placed(t: torch.Tensor) -> bool:
    """Whether t lies in a chunk of huge pages of this generation (placed since the last
    new_generation(), or a view of something that was)."""
    return t.device.type == "cpu" and _chunks.get(t.untyped_storage().data_ptr()) == _generation


def new_generation() -> None:
    """From now on, place() copies into fresh chunks, and what was placed before counts as not
    placed (place() moves it again). The engine calls this between loading and joining: the
    load's prepare steps place as they go (their arrays leave the C heap at once, which otherwise
    fragments: loading the 1.25 B MoE without it held 6.1 GB), the joins then replace the
    separate q/k/v and gate/up, and place_weights moves the rest; nothing references the load's
    chunks after that, so they are unmapped."""
    global _generation, _chunk, _used
    with _lock:
        _generation += 1
        _chunk, _used = None, 0


def place(t: torch.Tensor) -> torch.Tensor:
    """Inside `arena()`: a contiguous copy of CPU tensor t on huge pages (same dtype, shape and
    values). t itself outside one, where huge pages are off, for a small t, and for a t placed
    already or a view of one (the rows of a joined weight), so placing twice copies once."""
    if (not _depth or t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or t.requires_grad
            or not enabled() or placed(t)):
        return t
    nbytes = t.numel() * t.element_size()
    out = _take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, on huge pages inside `arena()` (as place() would put it, without
    the copy): for arrays a prepare step fills itself."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _depth or nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    return _take(nbytes).view(dtype).view(shape)


def place_weights(model: torch.nn.Module) -> None:
    """Every weight a decode step streams onto huge pages of this generation, inside `arena()`:
    the engine calls this once its model is loaded and its projections joined
    (runtime/models/fusion.py), so a joined q/k/v or gate/up is copied by its join alone and the
    separate projections are views of its rows. Covers the dense kernel's weights (InvariantLinear;
    a tied embedding moves along with its head) and the prepared arrays of the quantized kernels
    (KernelPath.place)."""
    from lowbit.kernels.cpu_f32 import InvariantLinear
    from lowbit.kernels.dispatch import place_prepared
    from lowbit.kernels.prepared import PreparedWeight

    for module in model.modules():
        if type(module) is InvariantLinear and not module.weight.requires_grad:
            module.weight.data = place(module.weight.data)  # .data in place: a tied embedding moves along
        prepared = getattr(module, "prepared", None)
        if isinstance(prepared, PreparedWeight):
            module.prepared = place_prepared(prepared)


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).

    Large temporaries freed in sizes glibc serves from its heap (its mmap threshold rises after
    the first large frees) stay resident otherwise: loading SmolLM2's int4 checkpoint left ~390
    MB of freed file tensors and re-tiling buffers in an ~900 MB RSS, and each calibrated layer
    ~20 MB (peak 1.75 → 1.34 GB on SmolLM2)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros that costs nothing until written: an anonymous private mapping, which
    the kernel hands out zeroed page by page on first touch (advised MADV_HUGEPAGE where THP is on,
    as the weights are). torch.zeros writes every byte at once: the engine's default 4 GiB KV
    cache took ~6 s to start (2 Zen 5 cores) and was resident before the first token."""
    count = math.prod(shape)
    nbytes = max(count * dtype.itemsize, 1)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if enabled() and nbytes >= HUGE_PAGE:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # holds the mapping
