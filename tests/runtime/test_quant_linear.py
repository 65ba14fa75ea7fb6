"""QuantLinear against float64 dequantize-then-matmul; swapping by name; the outlier side matrix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.quant.rtn import quantize_rtn
from lowbit.runtime.quant_linear import QuantLinear, attach_quantized


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-asym-g64", "nf4", "fp8", "mxfp4", "nvfp4", "int8"])
def test_forward_is_dequantize_then_matmul(fmt, reference_kernels):
    w = torch.randn(48, 96) * 0.05
    bias = torch.randn(48)
    qt = quantize_rtn(w, fmt)
    layer = QuantLinear(qt, bias=bias)
    x = torch.randn(3, 5, 96)
    want = x.double() @ qt.dequantize(torch.float64).T + bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert layer(x).shape == (3, 5, 48) and layer(x.bfloat16()).dtype == torch.bfloat16


def test_default_kernel_path_is_close(reference_kernels, monkeypatch):
    qt = quantize_rtn(torch.randn(64, 128) * 0.05, "int4-g32")
    x = torch.randn(4, 128)
    exact = QuantLinear(qt)(x)
    monkeypatch.delenv("LOWBIT_KERNEL")
    fast = QuantLinear(qt)
    assert fast.prepared.path != "reference"
    assert (fast(x) - exact).abs().max() < 0.02 * exact.abs().max()


def test_outliers_are_added_back(reference_kernels):
    qt = quantize_rtn(torch.randn(32, 64) * 0.05, "int4-g32")
    layer = QuantLinear(qt)
    dense = torch.zeros(32, 64)
    dense[3, 7], dense[30, 0], dense[0, 63] = 1.5, -2.0, 0.25
    layer.set_outliers(dense.to_sparse())
    x = torch.randn(2, 3, 64)
    want = x.double() @ (qt.dequantize(torch.float64) + dense.double()).T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(LowbitError, match="does not match"):
        layer.set_outliers(torch.zeros(64, 32).to_sparse())


def test_attach_swaps_by_name_and_checks_shapes(reference_kernels):
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 32, bias=True))
    qt = quantize_rtn(torch.randn(32, 64) * 0.05, "nf4")
    attach_quantized(model, ["proj"], {"proj": qt}.__getitem__)
    assert isinstance(model.proj, QuantLinear)
    assert model.proj.bias.shape == (32,) and model.proj.bias.is_meta  # filled by the state dict later
    assert not [p for p in model.parameters() if p.dim() == 2]  # no dense weight anywhere
    with pytest.raises(LowbitError, match="shape"):
        m2 = nn.Sequential()
        m2.add_module("proj", nn.Linear(32, 32))
        attach_quantized(m2, ["proj"], {"proj": qt}.__getitem__)
    with pytest.raises(LowbitError, match="does not exist"):
        attach_quantized(model, ["nope"], {"nope": qt}.__getitem__)


def test_loaded_checkpoint_holds_no_dense_quantized_weights(tiny_float_model, tmp_path):
    from lowbit.compress.pipeline import quantize_model
    from lowbit.runtime.loader import load_model

    src = tiny_float_model("llama")
    quantize_model(src, "int4-g32", out_dir=tmp_path / "q")
    model = load_model(tmp_path / "q")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 14
    shapes = {tuple(p.shape) for p in model.parameters()}
    # only embeddings (and the untied head), norms: nothing of a projection's shape
    assert (128, 64) not in shapes and (64, 128) not in shapes and (32, 64) not in shapes
