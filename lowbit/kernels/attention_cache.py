"""AttentionCache: what a model asks of the `cache` it is given (runtime/attention.py explains the
members). It sits in kernels/, below runtime/, so that attention kernels that act as a cache
(kernels/causal_attention.py's BlockCausalAttention) implement the same interface as the runtime's
contiguous and paged KV caches."""

from __future__ import annotations

from typing import ClassVar

import torch


class AttentionCache:
    """The interface the model uses on the `cache` it is given (see the module docstring).

    Subclasses implement `attend`; the rest has defaults for a cache that keeps no positions of
    its own and has no fused path."""

    flat_rows: ClassVar[bool] = False  # True: steps are one flattened sequence, layers get rows [T, hidden]
    length: int = 0  # positions stored before the current forward (CausalLM reads it for positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
               window: int | None) -> torch.Tensor:
        """Store `layer`'s new k, v [B, kv_heads, T, D] and return causal attention of q [B, H, T, D]
        (the queries at positions length .. length + T - 1) over everything kept: [B, H, T, D]."""
        raise NotImplementedError

    def rotate_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor | None:
        """Rows form only (flat_rows): q [T, H*D], k/v [T, kvh*D] before RoPE -> out [T, H*D] with
        RoPE, the KV write and attention in one call; None when this cache or step has no such path
        (the layer then rotates and calls `attend`)."""
        return None

    def check_room(self, new_tokens: int) -> None:
        """Raise a LowbitError if `new_tokens` more positions do not fit."""

    def advance(self, new_tokens: int) -> None:
        """After every layer saw the new tokens: they now count as stored."""
