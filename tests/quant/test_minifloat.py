"""Bit-exact element and scale code tables and their round-to-nearest-even encoders."""

import torch

from lowbit.quant.minifloat import (
    e2m1_values,
    e4m3_values,
    e5m2_values,
    e8m0_to_float,
    encode_e2m1,
    encode_minifloat,
    float_to_e8m0,
    round_e2m1,
    to_fp8,
)


def test_every_e2m1_code():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert e2m1_values().tolist() == expected + [-v for v in expected]
    assert torch.signbit(e2m1_values()[8])  # code 0x8 is -0


def test_e2m1_ties_go_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # codes: 0.25 -> 0 (0.0), 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0), 2.5 -> 4, 3.5 -> 6 (4.0), 5 -> 6
    assert encode_minifloat(ties, "e2m1").tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert encode_minifloat(-ties, "e2m1").tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e2m1_nearest_and_saturation():
    x = torch.tensor([0.26, 0.74, 1.26, 5.01, 6.0, 7.0, 1e9, -100.0])
    assert round_e2m1(x).tolist() == [0.5, 0.5, 1.5, 6.0, 6.0, 6.0, 6.0, -6.0]


def test_fast_e2m1_encoder_agrees_with_the_table_encoder():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([ties, -ties, e2m1_values(), torch.randn(50000) * 3, torch.tensor([1e30, -7.0, -0.0, 0.0])])
    assert torch.equal(encode_e2m1(x), encode_minifloat(x, "e2m1"))
    assert torch.equal(round_e2m1(x), e2m1_values()[encode_minifloat(x, "e2m1").long()])


def test_every_e4m3_code_matches_torch():
    ours = e4m3_values()
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    nan = torch.isnan(ours)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(theirs), nan)
    assert torch.equal(ours[~nan], theirs[~nan])
    assert ours[0x7E] == 448 and ours[0x01] == 2.0**-9 and ours[0x08] == 2.0**-6


def test_every_e5m2_code_matches_torch():
    ours = e5m2_values()
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs))
    assert torch.equal(ours[finite], theirs[finite])
    assert ours[0x7B] == 57344 and ours[0x7C] == float("inf")


def test_torch_fp8_cast_rounds_to_nearest_even_like_our_table():
    grid = e4m3_values()[:0x7F].double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # every tie point, exact in float32
    x = torch.cat([mids, -mids, torch.randn(20000) * 30, torch.rand(2000) * 2.0**-6, torch.tensor([500.0, -1e6])])
    ours = encode_minifloat(x, "e4m3")
    theirs = to_fp8(x).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_e5m2_cast_agrees_with_table_encoder():
    x = torch.randn(20000) * 1000
    assert torch.equal(encode_minifloat(x, "e5m2"), to_fp8(x, "e5m2").view(torch.uint8))


def test_e8m0_bias_127():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    values = e8m0_to_float(codes)
    assert values[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(values[6])
    assert float_to_e8m0(torch.tensor([-200, -127, 0, 3, 127, 500])).tolist() == [0, 0, 127, 130, 254, 254]
