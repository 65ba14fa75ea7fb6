"""Integer formats: Q4_0's scale rule, code ranges, zero points and int8 storage."""

import torch

from lowbit.quant import intq
from lowbit.quant.registry import parse_spec


def test_absmax_rule_puts_the_largest_weight_on_minus_8():
    w = torch.randn(16, 64)
    w[0, 3] = 5.0  # positive extreme: scale becomes negative and 5.0 → code -8
    spec = parse_spec("int4-g32-absmax")
    qt = intq.quantize(w, spec)
    codes = intq.unpack(qt.qweight, spec, 64).long() - 8
    extreme = w.abs().reshape(16, 2, 32).argmax(-1)
    assert (codes.reshape(16, 2, 32).gather(-1, extreme.unsqueeze(-1)) == -8).all()
    assert qt.scales[0, 0] == torch.tensor(-5.0 / 8, dtype=torch.float16)
    assert qt.dequantize()[0, 3] == -8 * qt.scales[0, 0].float()


def test_symmetric_dequantize_formula_and_code_range():
    w = torch.randn(8, 128)
    spec = parse_spec("int4-g64")
    qt = intq.quantize(w, spec)
    u = intq.unpack(qt.qweight, spec, 128).float()
    expected = (u - 8) * qt.scales.float().repeat_interleave(64, 1)
    assert torch.equal(qt.dequantize(), expected)
    assert qt.zeros is None and qt.scales.dtype == torch.float16


def test_asymmetric_zero_points_and_formula():
    w = torch.rand(8, 128) + 0.5  # all positive: the zero point sits at code 0
    spec = parse_spec("int4-asym-g32")
    qt = intq.quantize(w, spec)
    assert qt.zeros.dtype == torch.uint8 and qt.zeros.shape == (8, 4)
    u = intq.unpack(qt.qweight, spec, 128).float()
    expected = (u - qt.zeros.float().repeat_interleave(32, 1)) * qt.scales.float().repeat_interleave(32, 1)
    assert torch.equal(qt.dequantize(), expected)
    assert (qt.zeros == 0).all()


def test_int8_stores_signed_codes_per_channel():
    w = torch.randn(8, 300)
    spec = parse_spec("int8")
    qt = intq.quantize(w, spec)
    assert qt.qweight.dtype == torch.int8 and qt.qweight.shape == (8, 300)
    assert qt.scales.shape == (8, 1)
    assert torch.equal(qt.dequantize(), qt.qweight.float() * qt.scales.float())


def test_searched_int4_beats_fixed_absmax_over_7_5_rule():
    """The issue's point: a fixed absmax/7.5 scale (llm-compressor) loses to a searched one."""
    w = torch.distributions.StudentT(4.0).sample((128, 512))
    g = w.reshape(128, 16, 32)
    scale = g.abs().amax(-1, keepdim=True) / 7.5
    fixed = ((g / scale).round().clamp(-8, 7) * scale).reshape(128, 512)
    ours = intq.quantize(w, parse_spec("int4-g32")).dequantize()
    assert (ours - w).norm() < 0.97 * (fixed - w).norm()
