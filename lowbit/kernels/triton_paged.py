"""Triton paged attention for decode: one query token per sequence, K/V read in place from the
paged pool through the block table (no gather), online softmax over blocks.

One program per (sequence, kv head) handles the `group` query heads that share the kv head, so
each K/V block is loaded once for all of them. Sliding windows skip the blocks wholly before
the window and mask the rest. Quantized pools (int8 / fp8 bytes with a float32 scale per token
and head) are dequantized as they are loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, lens_ptr,
    scale, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_sh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, KV_MODE: tl.constexpr,  # 0 plain, 1 int8, 2 fp8 bytes
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    ctx = tl.load(lens_ptr + b)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for blk in range(first // BLOCK_SIZE, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(tables_ptr + b * stride_bt + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + t
        ok = (pos < ctx) & (pos >= first)
        slot = block * BLOCK_SIZE + t
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0)
        if KV_MODE == 2:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if KV_MODE != 0:
            s_off = slot * stride_ss + kvh * stride_sh
            k = k * tl.load(ks_ptr + s_off, mask=ok, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + s_off, mask=ok, other=0.0)[:, None]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None])


def paged_decode(q: torch.Tensor, cache, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, window: int | None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence) -> out [B, H, D] over the cache's pool of `layer`."""
    B, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    k, v = cache.keys[layer], cache.values[layer]
    group = H // cache.kv_heads
    mode = {None: 0, "bf16": 0, "int8": 1, "fp8": 2}[cache.kv_dtype]  # bf16: loaded and widened as a plain pool
    ks = cache.key_scales[layer] if mode else k
    vs = cache.value_scales[layer] if mode else v
    _paged_decode_kernel[(B, cache.kv_heads)](
        q, k, v, ks, vs, out, block_tables, context_lens,
        scale, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), ks.stride(0), ks.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(2, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_SIZE=cache.block_size,
        HAS_WINDOW=window is not None, KV_MODE=mode,
    )
    return out
