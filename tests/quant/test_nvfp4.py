"""NVFP4: the two-level scale convention and the shared global scale of fused layers."""

import torch

from lowbit.quant import nvfp4
from lowbit.quant.minifloat import round_e2m1, round_fp8
from lowbit.quant.registry import parse_spec
from lowbit.quant.rtn import shared_global_scale


def test_scales_follow_the_documented_convention():
    w = torch.randn(32, 64)
    spec = parse_spec("nvfp4-absmax")
    qt = nvfp4.quantize(w, spec)
    g = w.abs().max() / (6 * 448)
    assert qt.global_scale.dtype == torch.float32 and torch.equal(qt.global_scale, g.reshape(1))
    amax = w.abs().reshape(32, 4, 16).amax(-1)
    assert torch.equal(qt.scales.float(), round_fp8(amax / 6 / g))
    assert qt.scales.float().max() == 448  # the block holding the tensor's amax uses the full range
    block = (qt.scales.float() * g).repeat_interleave(16, 1)
    assert torch.equal(qt.dequantize(), round_e2m1(w / block) * block)


def test_fused_layers_share_one_global_scale():
    q, k = torch.randn(16, 64), torch.randn(8, 64) * 5
    spec = parse_spec("nvfp4")
    g = shared_global_scale([q, k], spec)
    assert torch.equal(g, (k.abs().max() / 2688).reshape(1))
    qq = nvfp4.quantize(q, spec, global_scale=g)
    qk = nvfp4.quantize(k, spec, global_scale=g)
    assert torch.equal(qq.global_scale, qk.global_scale)
    assert (qq.dequantize() - q).norm() / q.norm() < 0.12
