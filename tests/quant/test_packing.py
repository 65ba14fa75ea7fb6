"""Bit packing along the input dimension: documented order and exact inverse."""

import pytest
import torch

from lowbit.quant.packing import pack_bits, packed_width, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", [1, 7, 64, 99])
def test_pack_unpack_identity(bits, k):
    codes = torch.randint(0, 1 << bits, (5, k), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, packed_width(k, bits))
    assert torch.equal(unpack_bits(packed, bits, k), codes)


def test_documented_bit_order():
    assert pack_bits(torch.tensor([[0x1, 0xA, 0x3]], dtype=torch.uint8), 4).tolist() == [[0xA1, 0x03]]
    assert pack_bits(torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8), 2).tolist() == [[0b00111001, 0b11]]
    # 3 bits: element k at bits [3k, 3k+3) of the little-endian row stream
    codes = torch.tensor([[5, 1, 7, 2, 0, 6, 3, 4]], dtype=torch.uint8)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert pack_bits(codes, 3).tolist() == [[stream & 0xFF, stream >> 8 & 0xFF, stream >> 16 & 0xFF]]


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_byte_paths_equal_the_bit_stream(bits):
    # codes that fill whole bytes take byte arithmetic: the same bytes as the general stream rule
    codes = torch.randint(0, 1 << bits, (3, 37), dtype=torch.uint8)
    stream = [sum(int(c) << (bits * i) for i, c in enumerate(row)) for row in codes]
    width = packed_width(37, bits)
    assert pack_bits(codes, bits).tolist() == [[s >> (8 * j) & 0xFF for j in range(width)] for s in stream]
