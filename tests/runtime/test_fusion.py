"""Post-load fusion (runtime/models/fusion.py): q/k/v and gate/up as one matmul where that is exact."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_f32
from lowbit.runtime.loader import load_model
from lowbit.runtime.models.fusion import JoinedDense, JoinedLinear, fuse_projections

IDS = torch.tensor([[256, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])


@pytest.mark.skipif(not cpu_f32.available(), reason="no AVX-512 build on this machine")
def test_dense_join_is_bit_identical_and_costs_no_memory(tiny_float_model):
    src = tiny_float_model()
    separate = load_model(src, torch.float32)
    cpu_f32.use_invariant_linears(separate)
    fused = load_model(src, torch.float32)
    cpu_f32.use_invariant_linears(fused)
    assert fuse_projections(fused) == 4  # two layers: q/k/v and gate/up each
    attn = fused.model.layers[0].self_attn
    joined = attn.fused_qkv
    assert isinstance(joined, JoinedDense) and joined.sizes == [m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    # the separate projections' weights are views of the joined matrix's rows
    base = joined.linear.weight.data_ptr()
    row = joined.linear.weight.stride(0) * joined.linear.weight.element_size()
    assert attn.q_proj.weight.data_ptr() == base and attn.k_proj.weight.data_ptr() == base + attn.q_proj.out_features * row
    with torch.no_grad():
        for rows in (IDS[:, :1], IDS[:, :5], IDS):  # a decode row, a verify, a prefill
            assert torch.equal(fused(rows), separate(rows))


def test_quantized_weights_off_the_invariant_kernels_are_left_alone(tiny_float_model):
    # fp8 QuantLinears (cpu-lut) have no dense weight to join and no batch-invariant kernel: no join, no error
    from lowbit.runtime.engine.draft_models import quantize_linears_

    model = quantize_linears_(load_model(tiny_float_model(), torch.float32), "fp8", "cpu")
    assert model.model.layers[0].self_attn.q_proj.prepared.path == "cpu-lut"
    assert fuse_projections(model) == 0
    assert model.model.layers[0].self_attn.fused_qkv is None
    with torch.no_grad():
        assert torch.isfinite(model(IDS)).all()


@pytest.mark.parametrize("fmt", ["int8", "int8-g32"])
def test_int8_projections_join_bit_identically(tiny_float_model, fmt):
    from lowbit.kernels import cpu_int8
    from lowbit.runtime.engine.draft_models import quantize_linears_

    if not cpu_int8.available():
        pytest.skip("no int8 kernel on this machine")
    src = tiny_float_model()
    fused = quantize_linears_(load_model(src, torch.float32), fmt, "cpu")  # quantize_linears_ joins
    separate = quantize_linears_(load_model(src, torch.float32), fmt, "cpu")
    for module in separate.modules():  # the same weights, never joined
        for name in ("fused_qkv", "fused_gate_up"):
            if name in module.__dict__:
                module.__dict__[name] = None
    joined = fused.model.layers[0].self_attn.fused_qkv
    assert isinstance(joined, JoinedLinear) and joined.prepared.path == "cpu-int8f"
    with torch.no_grad():
        for rows in (IDS[:, :1], IDS[:, :5], IDS):
            assert torch.equal(fused(rows), separate(rows))


def test_int4_projections_join_on_the_int4_kernel(tiny_float_model):
    from lowbit.kernels import cpu_int4dot
    from lowbit.runtime.engine.draft_models import quantize_linears_

    if not cpu_int4dot.available():
        pytest.skip("no int4 kernel on this machine")
    model = quantize_linears_(load_model(tiny_float_model(), torch.float32), "int4-g32", "cpu")
    assert isinstance(model.model.layers[0].mlp.fused_gate_up, JoinedLinear)
