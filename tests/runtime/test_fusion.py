"""Post-load fusion (runtime/models/fusion.py): q/k/v and gate/up as one matmul where that is exact."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import cpu_f32
from lowbit.runtime.loader import load_model
from lowbit.runtime.models.fusion import JoinedDense, JoinedLinear, fuse_projections

IDS = torch.tensor([[256, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])


def _shares_memory(part, joined) -> bool:
    return all(t.untyped_storage().data_ptr() == joined.prepared.tensors[name].untyped_storage().data_ptr()
               for name, t in part.prepared.tensors.items())


def _never_joined(model):
    for module in model.modules():
        for name in ("fused_qkv", "fused_gate_up"):
            if name in module.__dict__:
                module.__dict__[name] = None
    return model


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
    separate = _never_joined(quantize_linears_(load_model(src, torch.float32), fmt, "cpu"))  # the same weights
    joined = fused.model.layers[0].self_attn.fused_qkv
    assert isinstance(joined, JoinedLinear) and joined.prepared.path == "cpu-int8f"
    with torch.no_grad():
        for rows in (IDS[:, :1], IDS[:, :5], IDS):
            assert torch.equal(fused(rows), separate(rows))


@pytest.mark.parametrize("fmt", ["int4-g32", "int8-g32"])
def test_separate_projections_become_views_of_the_join(tiny_float_model, fmt):
    # one copy of q/k/v and gate/up in memory: the separate projections read the joined rows,
    # and compute exactly what their own arrays did
    from lowbit.kernels import cpu_int4dot, cpu_int8
    from lowbit.runtime.engine.draft_models import quantize_linears_

    if not (cpu_int4dot.available() if fmt.startswith("int4") else cpu_int8.available()):
        pytest.skip("no kernel for it on this machine")
    src = tiny_float_model(hidden=64, intermediate=192)
    fused = quantize_linears_(load_model(src, torch.float32), fmt, "cpu")
    separate = _never_joined(quantize_linears_(load_model(src, torch.float32), fmt, "cpu"))
    attn, mlp = fused.model.layers[1].self_attn, fused.model.layers[1].mlp
    assert isinstance(mlp.fused_gate_up, JoinedLinear)
    assert _shares_memory(mlp.gate_proj, mlp.fused_gate_up) and _shares_memory(mlp.up_proj, mlp.fused_gate_up)
    # int4 tiles interleave 64 rows: k/v's 32 rows keep their own arrays (int8 rows are plain rows)
    assert _shares_memory(attn.k_proj, attn.fused_qkv) == fmt.startswith("int8")
    x = torch.randn(3, 64)
    other = separate.model.layers[1]
    with torch.no_grad():
        for mine, theirs in ((mlp.gate_proj, other.mlp.gate_proj), (mlp.up_proj, other.mlp.up_proj),
                             (attn.q_proj, other.self_attn.q_proj), (attn.v_proj, other.self_attn.v_proj)):
            assert torch.equal(mine(x), theirs(x))
        assert torch.equal(fused(IDS), separate(IDS))


def test_joining_again_follows_a_swapped_projection(tiny_float_model):
    from lowbit.kernels import cpu_int8
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec
    from lowbit.runtime.engine.draft_models import quantize_linears_
    from lowbit.runtime.quant_linear import QuantLinear

    if not cpu_int8.available():
        pytest.skip("no int8 kernel on this machine")
    model = quantize_linears_(load_model(tiny_float_model(), torch.float32), "int8-g32", "cpu")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = attn.fused_qkv(x)
        assert fuse_projections(model) == 4  # again, from the views of the first join: the same numbers
        assert torch.equal(attn.fused_qkv(x), before)
        attn.k_proj = QuantLinear(quantize_rtn(torch.randn(32, 64), parse_spec("int8-g32")))  # a swapped projection
        assert fuse_projections(model) == 4
        q, k, v = attn.fused_qkv(x).split(attn.fused_qkv.sizes, dim=-1)
        assert torch.equal(k, attn.k_proj(x)) and not torch.equal(k, before.split(attn.fused_qkv.sizes, dim=-1)[1])
        assert torch.equal(q, attn.q_proj(x)) and torch.equal(v, attn.v_proj(x))
