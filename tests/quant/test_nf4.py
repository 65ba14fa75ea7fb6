"""NF4: the published code book, nearest-value encoding and double quantization."""

import torch

from lowbit.quant import nf4
from lowbit.quant.registry import parse_spec

# bitsandbytes' NF4 table, as published (functional.py / QLoRA appendix)
PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]


def test_code_book_is_bitsandbytes():
    assert nf4.NF4_VALUES.tolist() == torch.tensor(PUBLISHED, dtype=torch.float32).tolist()


def test_every_code_round_trips_and_nearest_wins():
    spec = parse_spec("nf4")
    scale = torch.ones(16, 1)
    codes, values = nf4.quantize_group_values(nf4.NF4_VALUES.reshape(16, 1), scale, None, spec)
    assert codes.flatten().tolist() == list(range(16))
    x = torch.tensor([[0.03], [0.05], [0.9], [-0.8]])
    codes, _ = nf4.quantize_group_values(x, torch.ones(4, 1), None, spec)
    assert codes.flatten().tolist() == [7, 8, 15, 1]


def test_absmax_blocks_and_packing():
    w = torch.randn(4, 128)
    spec = parse_spec("nf4-absmax")
    qt = nf4.quantize(w, spec)
    assert qt.scales.dtype == torch.float32
    assert torch.equal(qt.scales, w.abs().reshape(4, 2, 64).amax(-1))
    u = nf4.unpack(qt.qweight, spec, 128)
    assert torch.equal(qt.qweight[:, 0], u[:, 0] | (u[:, 1] << 4))  # even element in the low nibble


def test_double_quantization_layout_and_cost():
    w = torch.randn(300, 256)  # 1200 block scales → 5 runs of 256, the last one ragged
    spec = parse_spec("nf4-dq")
    qt = nf4.quantize(w, spec)
    assert qt.scales.dtype == torch.int8 and qt.scales.shape == (300, 4)
    assert qt.scales_scale.shape == (5,) and qt.scales_offset.shape == (1,)
    assert torch.allclose(qt.scales_offset, nf4.quantize(w, parse_spec("nf4")).scales.mean().reshape(1), rtol=1e-5)
    plain = nf4.quantize(w, parse_spec("nf4")).dequantize()
    assert (qt.dequantize() - w).norm() < 1.02 * (plain - w).norm()
