"""CPU decode attention over the paged KV pool with RoPE and the KV write fused (native/paged_decode.c).

`paged_decode` serves steps whose items are all short (decodes, speculative verifies): per row
it rotates q and k, writes k and v at the row's slot and attends over the row's sequence through
its block table; each (row, head) is computed alone, so the result is batch-invariant. Returns
None when the C library is missing, so callers keep their torch path.
"""

from __future__ import annotations

import torch

from lowbit.native import paged_decode as native_paged_decode

MAX_HEAD_DIM = 512
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supported(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in _DTYPES and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0 and native_paged_decode.library() is not None


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 positions: torch.Tensor, slots: torch.Tensor, items: torch.Tensor, tables: torch.Tensor,
                 key_pool: torch.Tensor, value_pool: torch.Tensor, block_size: int, window: int | None,
                 scale: float) -> torch.Tensor:
    """q [T, H*D], k/v [T, kvh*D] (rows may be strided, last dim contiguous), cos/sin [T, D/2] or None,
    positions/slots/items [T] int64, tables [B, blocks] int64; pools [slots, kvh, D] -> out [T, H*D].
    The pools hold q's dtype, or bf16 under float32 q/k/v (k and v rounded to bf16 as written)."""
    t, hd = q.shape
    kvh, d = key_pool.shape[1], key_pool.shape[2]
    out = torch.empty(t, hd, dtype=q.dtype)
    if key_pool.dtype == q.dtype:
        code = _DTYPES[q.dtype]
    elif key_pool.dtype == torch.bfloat16 and q.dtype == torch.float32:
        code = 2  # float32 rows over a bf16 pool
    else:
        raise ValueError(f"a {key_pool.dtype} KV pool under {q.dtype} queries")
    rc = native_paged_decode.library().lowbit_paged_decode(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), code,
        positions.data_ptr(), slots.data_ptr(), items.data_ptr(), tables.data_ptr(), tables.shape[1],
        key_pool.data_ptr(), value_pool.data_ptr(), out.data_ptr(), t, hd // d, kvh, d, block_size,
        window or 0, scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_paged_decode failed with code {rc}")
    return out
