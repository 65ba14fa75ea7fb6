"""GPTQ's per-column loop in C (native/gptq_columns.c) for integer grids (`int_block`) and for
formats that describe their element quantizer as an ElementGrid (quant/element_grid.py; `grid_block`: minifloats,
NF4): one call per block of columns instead of 7-16 torch calls per column. The same float32 operations as compress/gptq.py's
torch loop (`int_block_torch`), the same bits except where torch leaves a multiply-add unfused
(see the C file); `available()` is False without the library, and GPTQ keeps torch.
"""

from __future__ import annotations

import torch

from lowbit.native import build
from lowbit.native.build import F32, I64, INT, P

SIGNATURES = {
    "lowbit_gptq_int_block": [P, I64, I64, P, I64, P, P, P, P, F32, F32, P, P, P, P, P, INT],
    "lowbit_gptq_grid_block": [P, I64, I64, P, I64, P, P, I64, P, P, P, P, INT, P, P, P, P, P, INT],
}

library = build.binding("gptq_columns", SIGNATURES)


def available() -> bool:
    return library() is not None


def _rows(t: torch.Tensor, b: int, n: int) -> int:
    """data_ptr of a float32 [b, n] block with row stride n (a slice of rows of a contiguous [K, n])."""
    if t.dtype != torch.float32 or t.shape != (b, n) or t.stride() != (n, 1):
        raise ValueError(f"gptq block: want float32 [{b}, {n}] rows of stride {n}, got {t.dtype} {tuple(t.shape)} {t.stride()}")
    return t.data_ptr()


def _factor(u: torch.Tensor, b: int) -> torch.Tensor:
    if u.dtype != torch.float32 or u.shape != (b, b):
        raise ValueError(f"gptq block: u must be float32 [{b}, {b}], got {u.dtype} {tuple(u.shape)}")
    return u if u.stride(1) == 1 else u.contiguous()


def int_block(block: torch.Tensor, u: torch.Tensor, divisor: torch.Tensor, scale: torch.Tensor,
              lo: torch.Tensor | float, hi: torch.Tensor | float, ints: torch.Tensor, values: torch.Tensor,
              errors: torch.Tensor, keep: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> None:
    """GPTQ over the b columns of `block` [b, n] in place (see gptq_columns.c): writes the clamped
    integers, their values and the scaled errors; u [b, b] is the block of H⁻¹'s Cholesky factor.
    lo/hi: per-element bounds [b, n] or one number each. keep (bool [b, n]) marks weights held in
    bf16 instead (written to kept, with value and integer 0)."""
    b, n = block.shape
    u = _factor(u, b)
    arrays = isinstance(lo, torch.Tensor)
    keep_ptr, kept_ptr = _held(keep, kept, b, n)
    rc = library().lowbit_gptq_int_block(
        _rows(block, b, n), b, n, u.data_ptr(), u.stride(0), _rows(divisor, b, n), _rows(scale, b, n),
        _rows(lo, b, n) if arrays else None, _rows(hi, b, n) if arrays else None,
        0.0 if arrays else lo, 0.0 if arrays else hi,
        _rows(ints, b, n), _rows(values, b, n), _rows(errors, b, n),
        keep_ptr, kept_ptr, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_gptq_int_block failed with code {rc}")


def _held(keep, kept, b: int, n: int):
    if (keep is None) != (kept is None):
        raise ValueError("gptq block: keep and kept go together")
    if keep is None:
        return None, None
    if keep.dtype != torch.bool or keep.shape != (b, n) or keep.stride() != (n, 1):
        raise ValueError(f"gptq block: keep must be bool [{b}, {n}] rows of stride {n}")
    return keep.data_ptr(), _rows(kept, b, n)


def grid_block(block: torch.Tensor, u: torch.Tensor, divisor: torch.Tensor, scale: torch.Tensor, grid,
               codes: torch.Tensor, values: torch.Tensor, errors: torch.Tensor,
               keep: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> None:
    """`int_block` for a grid format: `grid` is the format's ElementGrid, and `codes`
    (uint8 [b, n]) receives the element codes where int_block writes integers."""
    b, n = block.shape
    u = _factor(u, b)
    if codes.dtype != torch.uint8 or codes.shape != (b, n) or codes.stride() != (n, 1):
        raise ValueError(f"gptq block: codes must be uint8 [{b}, {n}] rows of stride {n}")
    g = grid.values.numel()
    tables = (grid.mids.to(torch.float64).contiguous(), grid.tie_up.to(torch.uint8).contiguous(),
              grid.values.to(torch.float32).contiguous(), grid.codes.to(torch.uint8).contiguous())
    if tables[0].numel() != g - 1 or tables[1].numel() != g - 1 or tables[3].numel() != g:
        raise ValueError("gptq block: the grid's tables do not fit together")
    keep_ptr, kept_ptr = _held(keep, kept, b, n)
    rc = library().lowbit_gptq_grid_block(
        _rows(block, b, n), b, n, u.data_ptr(), u.stride(0), _rows(divisor, b, n), _rows(scale, b, n), g,
        *(t.data_ptr() for t in tables), grid.sign_bit, codes.data_ptr(), _rows(values, b, n), _rows(errors, b, n),
        keep_ptr, kept_ptr, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_gptq_grid_block failed with code {rc}")
