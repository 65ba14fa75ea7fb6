"""Sub-byte integer codes packed into int32 words, as GPTQ, AWQ and compressed-tensors store them.

All three put `32 // bits` codes in one word, the first code in the lowest bits; they differ in
the axis they pack along and, for AWQ, in the order of the codes inside a word:
  compressed-tensors  along the input dimension (weights [N, K] → [N, ceil(K*b/32)]); its zero
                      points along the output dimension (dim 0)
  GPTQ                qweight [K, N] packed along K → [K*b/32, N]; qzeros [G, N] along N
  AWQ (GEMM)          qweight [K, N] and qzeros [G, N] packed along N, word slot i holding
                      output column 8j + AWQ_ORDER[i] for 4-bit codes
Only widths that divide 32 (2, 4, 8) are handled here; compressed-tensors' 3-bit stream, whose
codes straddle words, is lowbit's little-endian byte stream read as int32 (see `bytes_to_int32`).
"""

from __future__ import annotations

import torch

from lowbit.errors import LowbitError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word slot i holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in slot AWQ_REVERSE[j]


def pack_last(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes [..., M] (M a multiple of 32/bits) → int32 [..., M*bits/32] along the last axis."""
    per = 32 // bits
    m = codes.shape[-1]
    if 32 % bits or m % per:
        raise LowbitError(f"cannot pack {m} {bits}-bit codes into whole int32 words")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], m // per, per)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    return _to_int32(words)


def unpack_last(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., W] → unsigned codes uint8 [..., W*32/bits]; the inverse of `pack_last`."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    c = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        c = c[..., [order.index(j) for j in range(per)]]
    return c.reshape(*words.shape[:-1], -1).to(torch.uint8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # Words above 2^31 are negative int32s with the same bits.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bytes_to_int32(packed: torch.Tensor) -> torch.Tensor:
    """A little-endian byte stream uint8 [N, B] as int32 words [N, ceil(B/4)] (zero-padded)."""
    n, b = packed.shape
    pad = -b % 4
    p = torch.nn.functional.pad(packed.to(torch.int64), (0, pad)).reshape(n, -1, 4)
    words = (p << torch.tensor([0, 8, 16, 24])).sum(-1)
    return _to_int32(words)


def int32_to_bytes(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """int32 words [N, W] → the little-endian byte stream uint8 [N, nbytes]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = (w.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24])) & 0xFF
    return b.reshape(words.shape[0], -1)[:, :nbytes].to(torch.uint8)
