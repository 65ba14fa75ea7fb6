"""GGUF Q4_K: llama.cpp's reference quantizer (quantize_row_q4_K_ref), re-implemented with torch.

Block layout (144 bytes per 256 weights of a row; ggml-common.h block_q4_K):
  d     float16   super-block scale of the 6-bit sub-block scales
  dmin  float16   super-block scale of the 6-bit sub-block mins
  scales[12]      eight 6-bit scales sc_j and eight 6-bit mins m_j: for j < 4, byte j holds sc_j
                  and byte j+4 holds m_j in its low 6 bits; for j >= 4, byte j+4 holds the low
                  4 bits of sc_j (low nibble) and m_j (high nibble), and their top 2 bits sit in
                  bits 6-7 of bytes j-4 (sc) and j (m)
  qs[128]         4-bit codes: 32 bytes per pair of sub-blocks, byte l holding element l of the
                  even sub-block in its low nibble and element l of the odd one in its high nibble
  value = d * sc_j * q - dmin * m_j  for sub-block j (32 weights)

The algorithm (ggml-quants.c, make_qkx2_quants with rmin -1, rdelta 0.1, 20 steps):
per sub-block, error weights av + |x| (av = RMS of the sub-block); start from the min/max
affine grid, then try 21 stretched grids, each refitting scale and min by weighted least
squares (min clamped to <= 0), keeping the least weighted squared error; then the sub-block
scales and mins are quantized to 6 bits against the super-block maxima and the codes
recomputed with the rounded scales. All arithmetic is float32 and rounding is half-to-even
like ggml's nearest_int; sums run in torch's order, so a value on a rounding knife-edge may
differ from the C code in the last place.
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256
BLOCK_BYTES = 144


def _seqsum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis left to right in float32, as ggml's loops do."""
    acc = t[..., 0].clone()
    for i in range(1, t.shape[-1]):
        acc += t[..., i]
    return acc


def _make_qkx2(x: torch.Tensor, weights: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20):
    """x, weights [R, 32] → (scale [R], min [R] (the positive offset, -min), codes [R, 32])."""
    mn = x.amin(-1).clamp(max=0.0)
    mx = x.amax(-1)
    sum_w = _seqsum(weights)
    sum_x = _seqsum(weights * x)
    flat = mx == mn
    rng = torch.where(flat, torch.ones_like(mx), mx - mn)
    iscale = nmax / rng
    scale = 1.0 / iscale
    codes = torch.round(iscale[:, None] * (x - mn[:, None])).clamp(0, nmax)
    best = _seqsum(weights * (scale[:, None] * codes + mn[:, None] - x).square())
    best_scale, best_min, best_codes = scale.clone(), mn.clone(), codes.clone()
    for step in range(nstep + 1):
        # ggml keeps searching from the best min found so far, so each step depends on the last
        span = torch.where(flat, torch.ones_like(mx), mx - best_min)
        stretch = np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax)  # float32 like ggml
        iscale = float(stretch) / span
        laux = torch.round(iscale[:, None] * (x - best_min[:, None])).clamp(0, nmax)
        sum_l = _seqsum(weights * laux)
        sum_l2 = _seqsum(weights * laux * laux)
        sum_xl = _seqsum(weights * laux * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), this_scale)
        err = _seqsum(weights * (this_scale[:, None] * laux + this_min[:, None] - x).square())
        better = ok & (err < best)
        best = torch.where(better, err, best)
        best_scale = torch.where(better, this_scale, best_scale)
        best_min = torch.where(better, this_min, best_min)
        best_codes = torch.where(better[:, None], laux, best_codes)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    best_min = torch.where(flat, mn, best_min)
    best_codes = torch.where(flat[:, None], torch.zeros_like(best_codes), best_codes)
    return best_scale, -best_min, best_codes


def quantize_q4_k(w: torch.Tensor) -> np.ndarray:
    """float weights [N, K] (K a multiple of 256) → uint8 [N, K/256 * 144] Q4_K rows."""
    n, k = w.shape
    x = w.detach().float().reshape(-1, 8, 32)  # [B, 8, 32]
    b = x.shape[0]
    av = torch.sqrt(_seqsum(x * x) / 32)
    weights = av[..., None] + x.abs()
    scales, mins, first = _make_qkx2(x.reshape(-1, 32), weights.reshape(-1, 32))
    scales, mins = scales.reshape(b, 8), mins.reshape(b, 8)
    max_scale = scales.amax(-1).clamp(min=0.0)
    max_min = mins.amax(-1).clamp(min=0.0)
    inv_scale = torch.where(max_scale > 0, 63.0 / torch.where(max_scale > 0, max_scale, torch.ones_like(max_scale)), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63.0 / torch.where(max_min > 0, max_min, torch.ones_like(max_min)), torch.zeros_like(max_min))
    # ggml stores nearest_int into a uint8 and then takes MIN(63, ·); the values here are never negative
    ls = torch.round(inv_scale[:, None] * scales).clamp(0, 63).to(torch.int64)
    lm = torch.round(inv_min[:, None] * mins).clamp(0, 63).to(torch.int64)
    d16 = (max_scale / 63.0).to(torch.float16)
    dmin16 = (max_min / 63.0).to(torch.float16)
    d = d16.float()[:, None] * ls.float()
    dm = dmin16.float()[:, None] * lm.float()
    safe_d = torch.where(d != 0, d, torch.ones_like(d))
    codes = torch.round((x + dm[..., None]) / safe_d[..., None]).clamp(0, 15)
    # ggml skips a sub-block whose rounded scale is 0 and keeps the codes of its first search
    codes = torch.where((d != 0)[..., None], codes, first.reshape(b, 8, 32)).to(torch.int64)
    out = torch.zeros(b, BLOCK_BYTES, dtype=torch.uint8)
    out[:, 0:2] = d16.reshape(b, 1).view(torch.uint8)
    out[:, 2:4] = dmin16.reshape(b, 1).view(torch.uint8)
    out[:, 4:16] = _pack_scales(ls, lm)
    c = codes.reshape(b, 4, 2, 32)
    out[:, 16:] = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(b, 128).to(torch.uint8)
    return out.reshape(n, -1).numpy()


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(ls.shape[0], 12, dtype=torch.int64)
    q[:, 0:4] = ls[:, 0:4]
    q[:, 4:8] = lm[:, 0:4]
    q[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    q[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    q[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    return q.to(torch.uint8)


def dequantize_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 weights [N, K] of Q4_K rows (lowbit's own decoder, checked against gguf-py's)."""
    n, k = shape
    blk = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8)).reshape(-1, BLOCK_BYTES)
    d = blk[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blk[:, 2:4].contiguous().view(torch.float16).float()
    q = blk[:, 4:16].to(torch.int64)
    sc = torch.cat([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], dim=1)
    qs = blk[:, 16:].to(torch.int64).reshape(-1, 4, 32)
    codes = torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(-1, 8, 32).float()
    values = d * sc.float()
    values = values[..., None] * codes - (dmin * m.float())[..., None]
    return values.reshape(n, k)
