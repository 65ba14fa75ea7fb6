"""KV cache bytes: per token, per sequence, paged or reserved up front.

Every layer stores one key and one value vector per KV head per token (grouped-query attention
shares them across query heads, so only num_key_value_heads count). A sliding-window layer
never needs more than its window of tokens, so a sequence longer than the window costs such
a layer only `window` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowbit.errors import UsageError
from lowbit.plan.model_shape import ModelShape

BLOCK_TOKENS = 16  # the paged cache's block size (lowbit's engine default)


@dataclass(slots=True, frozen=True)
class KVDtype:
    name: str
    element_bytes: int
    # bytes of scale stored per (token, KV head) vector, for K and for V each; fp8 uses one scale
    # per layer (per tensor), which is a rounding error per sequence and counted as zero here
    scale_bytes_per_vector: int


KV_DTYPES = {
    "bf16": KVDtype("bf16", 2, 0),
    "fp8": KVDtype("fp8", 1, 0),
    "int8": KVDtype("int8", 1, 4),  # one fp32 scale per token per head (symmetric int8)
}


def kv_dtype(name: str) -> KVDtype:
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown KV cache dtype '{name}' (known: {', '.join(KV_DTYPES)})") from None


def bytes_per_token_per_layer(shape: ModelShape, dtype: KVDtype) -> int:
    """K and V of one token in one layer, scales included."""
    return 2 * shape.num_kv_heads * (shape.head_dim * dtype.element_bytes + dtype.scale_bytes_per_vector)


def kv_bytes_per_token(shape: ModelShape, dtype: KVDtype) -> int:
    """One more token of context, in every layer (before any window is full)."""
    return shape.num_layers * bytes_per_token_per_layer(shape, dtype)


def kv_bytes_per_sequence(shape: ModelShape, dtype: KVDtype, tokens: int) -> int:
    """Exact bytes a sequence of `tokens` holds: full layers keep all, sliding layers their window."""
    per_layer = bytes_per_token_per_layer(shape, dtype)
    return per_layer * sum(_held(tokens, window) for window in shape.layer_windows)


def kv_bytes_paged(shape: ModelShape, dtype: KVDtype, tokens: int, block: int = BLOCK_TOKENS) -> int:
    """Bytes a paged cache allocates: whole blocks; a sliding layer frees blocks that left its window.

    A sliding layer keeps the blocks that overlap the window: at most ceil(window/block) + 1.
    """
    per_layer = bytes_per_token_per_layer(shape, dtype)
    blocks = math.ceil(tokens / block)
    total = 0
    for window in shape.layer_windows:
        held = blocks if window is None else min(blocks, math.ceil(window / block) + 1)
        total += held * block
    return per_layer * total


def attended_tokens(shape: ModelShape, tokens: int) -> int:
    """Σ over layers of the keys one new token at position `tokens` attends to (decode)."""
    return sum(_held(tokens, window) for window in shape.layer_windows)


def causal_attended_pairs(shape: ModelShape, tokens: int) -> int:
    """Σ over layers of (query, key) pairs in a causal prefill of `tokens` tokens."""
    return sum(_causal_pairs(tokens, window) for window in shape.layer_windows)


def _held(tokens: int, window: int | None) -> int:
    return tokens if window is None else min(tokens, window)


def _causal_pairs(tokens: int, window: int | None) -> int:
    # query t (1-based) sees min(t, window) keys
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window
