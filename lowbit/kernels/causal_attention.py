"""Causal self-attention over whole calibration windows, faster on CPU than SDPA's flash kernel.

Calibration runs every window from position 0 with no cache, so attention is a plain causal
(optionally sliding-window) product over [T, T]. On CPUs without AMX, SDPA's bf16 flash kernel
is the slower of the two on SmolLM2's shapes; this module computes the scores block by block of
64 queries, each block only against the keys it can see (5/8 of the full product at T = 512), the
query heads of a group stacked against their shared key head, the softmax in float32 and the
products in bf16 (HF's eager arithmetic). The softmax writes bf16 directly, not a float32 output
plus a cast, which would move twice the bytes of the largest tensor.

On cores with AMX (Intel's bf16 tile unit, Sapphire Rapids and later) torch's SDPA flash kernel
runs its products on the tiles and wins for full causal attention (SmolLM2's windows and Gemma-3's
global layers). It still loses on sliding windows (it visits the keys outside the window), which
therefore keep the blocks; the timings behind both choices are in the git history of
docs/benchmarks.md. Without AMX the blocks win everywhere, so the choice is made from the CPU's
flags, once per process: the same machine always takes the same path, which the
byte-identical resume relies on.

`BlockCausalAttention` is an AttentionCache (kernels/attention_cache.py): runtime.attention.attend
hands it (q, k, v) through `attend(q, k, v, layer, scale, window)`; it keeps nothing between calls
but the masks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lowbit.kernels.attention_cache import AttentionCache

QUERY_BLOCK = 64
SAMPLE_CHUNK = 4  # windows per product: the scores of 4 x 512 keys stay in the caches


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU advertises AMX bf16 tiles (Linux's /proc/cpuinfo; False where it cannot tell)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_bf16" in line.split()
    except OSError:
        pass
    return False


class BlockCausalAttention(AttentionCache):
    """Pass as the `cache` of SelfAttention.forward for windows that start at position 0.

    sdpa: run full causal attention through torch's SDPA (None: where the CPU has AMX)."""

    def __init__(self, sdpa: bool | None = None):
        self.sdpa = cpu_has_amx() if sdpa is None else sdpa
        self._masks: dict[tuple[int, int, int | None], tuple[int, int, int, torch.Tensor | None]] = {}

    def _block(self, j0: int, j1: int, window: int | None):
        """(first key, first masked key, end of masked keys, mask [j1-j0, masked keys] or None) of queries j0..j1."""
        key = (j0, j1, window)
        if key not in self._masks:
            k0 = 0 if window is None else max(0, j0 - window + 1)
            q_pos = torch.arange(j0, j1)[:, None]
            k_pos = torch.arange(k0, j1)[None, :]
            hidden = k_pos > q_pos
            if window is not None:
                hidden |= k_pos <= q_pos - window
            cols = hidden.any(0).nonzero().flatten()
            if cols.numel() == 0:
                self._masks[key] = (k0, 0, 0, None)
            else:
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                self._masks[key] = (k0, c0, c1, hidden[:, c0:c1].contiguous())
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
               window: int | None) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, kv_heads, T, D] from position 0 → out [B, H, T, D]."""
        if self.sdpa and window is None and q.device.type == "cpu":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        b, h, t, d = q.shape
        kv = k.shape[1]
        group = h // kv
        qs = (q * scale).view(b, kv, group, t, d)
        out = torch.empty(b, kv, group, t, d, dtype=q.dtype)
        for s0 in range(0, b, SAMPLE_CHUNK):
            s1 = min(b, s0 + SAMPLE_CHUNK)
            n = s1 - s0
            keys_t = k[s0:s1].transpose(-1, -2)  # [n, kv, D, T]
            for j0 in range(0, t, QUERY_BLOCK):
                j1 = min(t, j0 + QUERY_BLOCK)
                k0, c0, c1, mask = self._block(j0, j1, window)
                # The group's query rows of this block stacked (a small copy), so each key head is
                # read once by one product instead of broadcast over the group.
                rows = qs[s0:s1, :, :, j0:j1].reshape(n, kv, group * (j1 - j0), d)
                scores = torch.matmul(rows, keys_t[..., k0:j1])  # [n, kv, group * block, keys]
                if mask is not None:
                    scores.view(n, kv, group, j1 - j0, -1)[..., c0:c1].masked_fill_(mask, float("-inf"))
                # torch's bf16 softmax computes in float32 and rounds once, like a float32 softmax
                # rounded to bf16 but without the two float32 copies of the scores (40% of this
                # attention at T = 2048). Same bits for rows of a multiple of 64 keys (every row
                # without a sliding window); other lengths sum in another order, and ~1e-5 of the
                # probabilities land one bf16 ulp apart (tested).
                probs = torch.softmax(scores, -1)
                out[s0:s1, :, :, j0:j1] = torch.matmul(probs, v[s0:s1, :, k0:j1]).view(n, kv, group, j1 - j0, d)
        return out.view(b, h, t, d)
