"""TrainableQuantLinear: the weight it trains with is the QTensor it writes, in every format."""

from __future__ import annotations

import pytest
import torch

from lowbit.compress.distill.trainable import TrainableQuantLinear
from lowbit.quant.rtn import quantize_rtn
from lowbit.quant.spec import parse_spec

FORMATS = ["int4-g32", "int4-asym-g32", "int3-g32", "int8", "nf4", "nf4-dq", "int4-asym-g32-dq", "fp8", "nvfp4", "mxfp4"]


def _layer(fmt: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 96, generator=gen)
    qt = quantize_rtn(w, parse_spec(fmt))
    return qt, TrainableQuantLinear(qt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_starts_at_the_checkpoint_and_exports_it_unchanged(fmt):
    qt, layer = _layer(fmt)
    assert torch.equal(layer.weight(), qt.dequantize())
    back = layer.to_qtensor()
    assert set(back.parts()) == set(qt.parts())
    for name, part in qt.parts().items():
        assert back.parts()[name].dtype == part.dtype
        assert torch.equal(back.parts()[name].view(torch.uint8), part.view(torch.uint8)), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_after_steps_the_trained_weight_is_the_exported_one_and_codes_stay(fmt):
    qt, layer = _layer(fmt, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=gen)
    target = x @ torch.randn(24, 96, generator=gen).mul(0.05).add(qt.dequantize()).T
    params = [p for p in layer.parameters() if p.requires_grad]
    if fmt == "mxfp4":  # E8M0 exponents: nothing in the weight can train
        assert params == []
        return
    opt = torch.optim.Adam(params, lr=1e-2)
    first = None
    for _ in range(30):
        loss = (layer(x) - target).pow(2).mean()
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float((layer(x) - target).pow(2).mean()) < first
        back = layer.to_qtensor()
        assert torch.equal(back.qweight, qt.qweight)  # the codes never move
        assert torch.equal(back.dequantize(), layer.weight())  # what trained is what is written
        assert not torch.equal(back.dequantize(), qt.dequantize())
