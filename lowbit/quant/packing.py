"""Bit packing of sub-byte codes along the input dimension.

Each row of codes [N, K] (values < 2**bits) becomes a little-endian bit stream: element k
occupies bits [k*bits, (k+1)*bits) of the row, counting from bit 0 of byte 0. So for 4 bits
byte i holds element 2i in its LOW nibble and element 2i+1 in its high nibble; for 2 bits byte i
holds elements 4i..4i+3 from the lowest bit pair up; for 3 bits every 3 bytes hold 8 elements.
A row takes ceil(K*bits/8) bytes; when K*bits is not a multiple of 8 the unused high bits of the
last byte are 0 (that padding lives only in the packing, never in the weights or scales).
Rows are independent, so a kernel finds row n at byte n*ceil(K*bits/8).
"""

from __future__ import annotations

import math

import torch


def packed_width(in_features: int, bits: int) -> int:
    return -(-in_features * bits // 8)


def _chunk(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte chunk of the stream."""
    lcm = math.lcm(bits, 8)
    return lcm // bits, lcm // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] → uint8 [N, ceil(K*bits/8)]."""
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n, k = codes.shape
    if 8 % bits == 0:  # whole codes per byte: byte arithmetic (the general path works in int64)
        per = 8 // bits
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, -k % per)).reshape(n, -1, per)
        out = c[..., 0].clone()
        for i in range(1, per):
            out |= c[..., i] << (i * bits)
        return out
    per, nbytes = _chunk(bits)
    pad = -k % per
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).reshape(n, -1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1)  # one integer per chunk, at most 24 bits for 3-bit codes
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(n, -1)
    return out[:, : packed_width(k, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """uint8 [N, ceil(K*bits/8)] → uint8 codes [N, K]; the inverse of `pack_bits`."""
    if bits == 8:
        return packed.to(torch.uint8)
    n = packed.shape[0]
    if 8 % bits == 0:  # whole codes per byte: byte arithmetic, ~10x faster than the int64 words below
        mask = (1 << bits) - 1
        b = packed.to(torch.uint8)
        codes = torch.stack([(b >> (i * bits)) & mask for i in range(8 // bits)], dim=-1).reshape(n, -1)
        return codes[:, :in_features]
    per, nbytes = _chunk(bits)
    pad = -packed.shape[1] % nbytes
    b = torch.nn.functional.pad(packed.to(torch.int64), (0, pad)).reshape(n, -1, nbytes)
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
    codes = ((word >> shifts) & ((1 << bits) - 1)).reshape(n, -1)
    return codes[:, :in_features].to(torch.uint8)
