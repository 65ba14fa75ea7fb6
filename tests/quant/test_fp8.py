"""FP8: scale granularities and the saturating nearest-even cast."""

import torch

from lowbit.quant import fp8
from lowbit.quant.registry import parse_spec


def test_channel_scales_map_row_amax_to_448():
    w = torch.randn(6, 100)
    spec = parse_spec("fp8-absmax")
    qt = fp8.quantize(w, spec)
    assert qt.qweight.dtype == torch.float8_e4m3fn and qt.scales.shape == (6, 1)
    assert torch.allclose(qt.scales.flatten(), w.abs().amax(1) / 448)
    assert torch.equal(qt.dequantize(), qt.qweight.float() * qt.scales)


def test_block_scales_cover_128_by_128_tiles_with_ragged_edges():
    w = torch.randn(200, 300)
    w[130:, 260:] *= 100  # the bottom-right tile gets its own large scale
    spec = parse_spec("fp8-block128-absmax")
    qt = fp8.quantize(w, spec)
    assert qt.scales.shape == (2, 3)
    assert torch.allclose(qt.scales[1, 2], w[128:, 256:].abs().max() / 448)
    assert torch.allclose(qt.scales[0, 0], w[:128, :128].abs().max() / 448)
    expected = qt.qweight.float() * qt.scales.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(qt.dequantize(), expected)


def test_tensor_scale():
    w = torch.randn(10, 10)
    qt = fp8.quantize(w, parse_spec("fp8-tensor-absmax"))
    assert qt.scales.shape == (1,) and torch.allclose(qt.scales, w.abs().max() / 448)
