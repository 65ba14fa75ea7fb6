"""MXFP4: the OCP floor rule, the round-up rule, and why mse is the default."""

import math

import torch

from lowbit.quant import mxfp4
from lowbit.quant.registry import parse_spec
from lowbit.quant.rtn import relative_error


def block_amax(w):
    return w.abs().reshape(w.shape[0], -1, 32).amax(-1)


def test_floor_rule_is_ocp():
    w = torch.randn(8, 64) * 0.03
    qt = mxfp4.quantize(w, parse_spec("mxfp4-floor"))
    for n in range(8):
        for j in range(2):
            amax = float(block_amax(w)[n, j])
            assert int(qt.scales[n, j]) == math.floor(math.log2(amax)) - 2 + 127


def test_roundup_rule_never_clips():
    w = torch.randn(8, 64)
    qt = mxfp4.quantize(w, parse_spec("mxfp4-roundup"))
    scale = torch.exp2(qt.scales.float() - 127)
    ratio = block_amax(w) / scale
    assert (ratio <= 6).all() and (ratio * 2 > 6).all()


def test_element_and_scale_layout():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 6.0, -1.5
    qt = mxfp4.quantize(w, parse_spec("mxfp4-floor"))
    assert int(qt.scales[0, 0]) == 127  # 2^(2 - 2) = 1
    assert int(qt.qweight[0, 0]) == 0x7 | (0xB << 4)  # 6.0 = code 7 (low nibble), -1.5 = 0x8|3


def test_mse_default_beats_both_fixed_rules_on_heavy_tailed_weights():
    w = torch.distributions.StudentT(3.0).sample((256, 512)) * 0.02
    errors = {rule: relative_error(w, mxfp4.quantize(w, parse_spec(f"mxfp4-{rule}"))) for rule in ("floor", "roundup", "mse")}
    assert parse_spec("mxfp4").scale_rule == "mse"
    assert errors["mse"] < errors["floor"] and errors["mse"] < errors["roundup"]
