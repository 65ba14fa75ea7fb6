"""Causal self-attention: the projection module, the KV cache interface, and `attend`, the one attention call.

`attend` is the only place that turns (q, k, v) into attention output; with a cache it hands them
to `cache.attend`, so a cache decides how attention over what it keeps is computed. The model
asks nothing of a cache but `AttentionCache`'s members (no attribute probing):

    attend(q, k, v, layer, scale, window)   store this layer's new k/v, attend over all kept
    rotate_and_attend(q, k, v, cos, sin, ...)  RoPE + KV write + attention fused, or None
    flat_rows                               the model runs steps as rows [T, hidden] of one sequence
    length / check_room / advance           positions kept before this forward (CausalLM's bookkeeping)

The interface lives in kernels/attention_cache.py, below runtime/, so that kernels/causal_attention.py's
`BlockCausalAttention` (calibration, only passed with [B, T, hidden] inputs) implements it too;
`KVCache` (here, contiguous, for `CausalLM.forward`) and the engine's `PagedKVCache`
(runtime/engine/paged_cache.py) are the others. Masks are built at most once per forward and
per window size, and only when SDPA's own `is_causal` cannot express them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kernels import cpu_rowops
from lowbit.kernels.attention_cache import AttentionCache
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import RMSNorm, apply_rotary
from lowbit.runtime.linear import make_linear


class KVCache(AttentionCache):
    """Contiguous per-layer key/value buffers [B, kv_heads, max_len, head_dim] for incremental decoding.

    Layers write at `length`; the model calls `advance` once after all layers saw the new tokens.
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.batch = batch
        self.max_len = max_len
        self.length = 0
        self._ctx: AttentionContext | None = None  # this forward's masks, shared by its layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of `layer` and return all of them so far."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def attend(self, q, k, v, layer, scale, window):
        t = k.shape[2]
        ctx = self._ctx
        if ctx is None or ctx.past != self.length or ctx.length != t or ctx.device != q.device:
            ctx = self._ctx = AttentionContext(self.length, t, q.device)
        k, v = self.update(layer, k, v)
        return causal_attention(q, k, v, ctx, scale, window)

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise LowbitError(
                f"KV cache full: {self.length} + {new_tokens} tokens exceed its {self.max_len} positions"
            )

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens
        self._ctx = None

    def reset(self) -> None:
        self.length = 0
        self._ctx = None


class AttentionContext:
    """What every layer's attention shares within one forward: how many tokens came before, how
    many are new, and the masks for each window size (built lazily, once)."""

    __slots__ = ("past", "length", "device", "_masks")

    def __init__(self, past: int, length: int, device: torch.device):
        self.past = past
        self.length = length
        self.device = device
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean [T, past + T]: query i (at past + i) sees key j when j <= past + i, within the window."""
        if window not in self._masks:
            q_pos = torch.arange(self.past, self.past + self.length, device=self.device)[:, None]
            k_pos = torch.arange(self.past + self.length, device=self.device)[None, :]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._masks[window] = allowed
        return self._masks[window]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    ctx: AttentionContext,
    cache: AttentionCache | None,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [B, H, T, D] over the cached and new k, v [B, kv_heads, T, D]."""
    if cache is not None:
        return cache.attend(q, k, v, layer, scale, window)
    return causal_attention(q, k, v, ctx, scale, window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """SDPA of q [B, H, T, D] (positions ctx.past ..) over k, v [B, kv_heads, ctx.past + T, D]."""
    total = k.shape[2]
    mask = None
    is_causal = False
    if ctx.length == 1:
        # One new token sees every cached key, or the last `window` of them.
        if window is not None and total > window:
            k, v = k[:, :, total - window :], v[:, :, total - window :]
    elif ctx.past == 0 and (window is None or window >= ctx.length):
        is_causal = True
    else:
        mask = ctx.mask(window)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


class SelfAttention(nn.Module):
    """q/k/v/o projections (HF names), optional per-head q/k RMSNorm, RoPE, then `attend`."""

    def __init__(self, config: ModelConfig, layer: int, norm_unit_offset: bool = False):
        super().__init__()
        d = config.head_dim
        self.layer = layer
        self.head_dim = d
        self.scale = config.query_scale
        self.window = config.window(layer)
        self.q_proj = make_linear(config.hidden_size, config.num_attention_heads * d, config.attention_bias)
        self.k_proj = make_linear(config.hidden_size, config.num_key_value_heads * d, config.attention_bias)
        self.v_proj = make_linear(config.hidden_size, config.num_key_value_heads * d, config.attention_bias)
        self.o_proj = make_linear(config.num_attention_heads * d, config.hidden_size, config.o_proj_bias)
        if config.qk_norm:
            # per head (Qwen3, Gemma-3), or over the whole projection (OLMoE)
            full = config.qk_norm_full
            self.q_norm = RMSNorm(config.num_attention_heads * d if full else d, config.rms_norm_eps, norm_unit_offset)
            self.k_norm = RMSNorm(config.num_key_value_heads * d if full else d, config.rms_norm_eps, norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    fused_qkv = None  # set by runtime/models/fusion.py (never a registered child: names stay HF's)

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., heads * head_dim] over each slice of the norm's width (a head, or all)."""
        width = norm.weight.shape[-1]
        if cpu_rowops.usable(x, norm.weight):
            return cpu_rowops.rmsnorm(x, norm.weight, norm.eps, norm.unit_offset, heads=x.shape[-1] // width)
        return norm(x.view(*x.shape[:-1], -1, width)).view(x.shape)

    def forward(self, x, cos, sin, ctx: AttentionContext, cache: AttentionCache | None) -> torch.Tensor:
        """x [B, T, hidden], or rows [T, hidden] of one flattened sequence (the engine's steps over a
        `flat_rows` cache, see DecoderModel.forward): the output has x's shape."""
        rows = x.dim() == 2
        b, t = (1, x.shape[0]) if rows else x.shape[:2]
        d = self.head_dim
        if self.fused_qkv is not None:
            q, k, v = self.fused_qkv.forward(x).split(self.fused_qkv.sizes, dim=-1)  # never hooked: not a child
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        if rows and cache is not None:
            # the engine's CPU decode kernel: RoPE, KV write and attention in one call (None: not this step)
            out = cache.rotate_and_attend(q, k, v, cos, sin, self.layer, self.scale, self.window)
            if out is not None:
                return self.o_proj(out)
        q = apply_rotary(q.view(b, t, -1, d).transpose(1, 2), cos, sin)
        k = apply_rotary(k.view(b, t, -1, d).transpose(1, 2), cos, sin)
        v = v.view(b, t, -1, d).transpose(1, 2)
        out = attend(q, k, v, self.layer, ctx, cache, self.scale, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))
