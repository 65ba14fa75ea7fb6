"""AWQ: folding scales leaves a float model's logits unchanged (Llama, Gemma-3's (1 + w) norms,
mixture-of-experts layers with their routers); the search never loses to s = 1 on its own exact score; the clip search never loses."""

from __future__ import annotations

import pytest
import torch

from lowbit.quant import parse_spec
from lowbit.compress.awq import fold_scale, quantized_error, scale_groups, search_scales
from lowbit.compress.stats import StatsAccumulator
from lowbit.runtime.loader import load_model


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_folding_scales_keeps_float_outputs(tiny_model, kind):
    model = load_model(tiny_model(kind), dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 12))
    before = model(ids)
    gen = torch.Generator().manual_seed(1)
    folded = 0
    for layer in model.model.layers:
        for group in scale_groups(layer):
            width = layer.get_submodule(group.linears[0]).weight.shape[1]
            s = torch.exp(torch.randn(width, generator=gen, dtype=torch.float64))  # scales over ~e^±2
            fold_scale(layer, group, s)
            folded += 1
    after = model(ids)
    # Llama here has no GQA, so o_proj folds into v_proj too; Gemma-3's GQA skips that group.
    assert folded == (4 if kind == "llama" else 3) * len(model.model.layers)
    # Gemma's runtime norm computes (1 + w) in float32 even in a float64 model, hence its looser bound;
    # a fold that ignored the unit offset would be off by O(1).
    tol = 1e-9 if kind == "llama" else 1e-5
    torch.testing.assert_close(after, before, rtol=tol, atol=tol)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, load_model(tiny_model(kind), dtype=torch.float64).model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_folding_scales_keeps_moe_outputs(tmp_path, case):
    """A mixture-of-experts layer's groups cover every reader of the folded input: the router and
    (Qwen2-MoE) the shared expert and its gate take the norm's scale too. Leaving one out changes
    the routing or the shared term, and the logits by far more than rounding."""
    from tests.runtime.moe_models import save_moe

    src, _ = save_moe(case, tmp_path / case)
    model = load_model(src, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    gen = torch.Generator().manual_seed(1)
    routers = shared_gates = 0
    for layer in model.model.layers:
        for group in scale_groups(layer):
            routers += "mlp.gate" in group.linears
            shared_gates += "mlp.shared_expert_gate" in group.linears
            width = layer.get_submodule(group.linears[0]).weight.shape[1]
            fold_scale(layer, group, torch.exp(torch.randn(width, generator=gen, dtype=torch.float64)))
    sparse = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert sparse and routers == sparse and shared_gates == (sparse if case == "qwen2_moe" else 0)
    torch.testing.assert_close(model(ids), before, rtol=1e-9, atol=1e-9)


def _stats_with_outlier_channels(k: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, k, generator=gen)
    x[:, :4] *= 20.0  # a few salient channels, as in real LLM activations
    acc = StatsAccumulator(k)
    acc.add(x)
    return acc.finish()


@pytest.mark.parametrize("fmt_name", ["int4-g32", "nf4", "nvfp4", "mxfp4"])
def test_search_never_loses_to_identity(fmt_name):
    spec = parse_spec(fmt_name)
    stats = _stats_with_outlier_channels(64)
    weights = [0.05 * torch.randn(48, 64), 0.05 * torch.randn(32, 64)]
    s, alpha, rel = search_scales(weights, [spec, spec], stats, grid=20)
    base = sum(quantized_error(w, spec, stats, None) for w in weights)
    found = sum(quantized_error(w, spec, stats, s) for w in weights)
    assert found <= base
    assert rel == pytest.approx(found / base)
    if alpha >= 0:
        assert found < base


FAKE_SPECS = ["int4-g32", "int4-asym-g64", "int8", "nf4", "nf4-dq", "int4-asym-g32-dq", "fp8", "fp8-block128", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("label", FAKE_SPECS)
def test_fake_quantize_is_dequantize_of_quantize(label):
    """The searches' unpacked shortcut gives exactly the checkpoint's dequantized weights (ragged K)."""
    from lowbit.compress.awq import fake_quantize
    from lowbit.quant.registry import get_format

    spec = parse_spec(label)
    gen = torch.Generator().manual_seed(2)
    w = 0.05 * torch.randn(160, 200, generator=gen)
    col = torch.rand(200, generator=gen) + 0.1
    expected = get_format(spec).quantize(w, spec, stats=col).dequantize(torch.float32)
    assert torch.equal(fake_quantize(w, spec, stats=col), expected)


def test_score_rows_spread_and_whole_for_blocks():
    from lowbit.compress.awq import score_rows

    rows = score_rows(1000, parse_spec("int4-g64"), limit=256)
    assert rows.numel() == 256 and rows[0] == 0 and rows[-1] == 999
    assert torch.equal(rows, rows.unique())  # sorted, no repeats
    assert score_rows(200, parse_spec("int4-g64"), limit=256) is None
    assert score_rows(1000, parse_spec("fp8-block128"), limit=256) is None
