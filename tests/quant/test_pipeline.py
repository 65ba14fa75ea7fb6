"""quantize_model end to end on tiny saved checkpoints: every format loads back through the
runtime and gives exactly the logits of a dense model built from the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.native import NativeReader
from lowbit.compress.methods import LayerResult, register_method, rtn_layer
from lowbit.compress.options import MethodOptions
from lowbit.compress.pipeline import quantize_model
from lowbit.compress.recipe import load_recipe, parse_recipe
from lowbit.quant.registry import weight_bytes
from lowbit.quant.rtn import quantize_rtn
from lowbit.runtime.loader import load_model

FORMATS = ["int4", "int4-asym-g32", "int4-asym-g32-dq", "int8", "int8-g64", "int3", "int2-asym", "nf4", "nf4-dq", "fp8", "fp8-block32",
           "fp8-tensor", "mxfp4", "mxfp4-floor", "mxfp4-roundup", "nvfp4"]
IDS = torch.tensor([[256, 5, 77, 130, 9, 200, 41, 41, 3, 250, 17, 88, 101, 64, 2, 199]])


def dequantized_twin(source, quantized, out):
    """A float32 checkpoint: the source's tensors with every quantized weight replaced by dequantize()."""
    reader = NativeReader(quantized)
    tensors = {k: v.float() for k, v in load_file(source / "model.safetensors").items()}
    for module in reader.modules:
        tensors[f"{module}.weight"] = reader.quantized(module).dequantize(torch.float32).contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((source / "config.json").read_text())
    return out


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_matches_dense_dequantized_model(fmt, tiny_float_model, tmp_path, reference_kernels):
    src = tiny_float_model("llama")
    summary = quantize_model(src, fmt, out_dir=tmp_path / "q")
    assert summary.formats == {summary.modules[0].format: 14}
    quantized = load_model(tmp_path / "q")
    dense = load_model(dequantized_twin(src, tmp_path / "q", tmp_path / "dense"))
    with torch.no_grad():
        got, want = quantized(IDS), dense(IDS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # quantization really happened: the logits moved away from the float model's
    assert not torch.allclose(got, load_model(src)(IDS), atol=1e-4)


@pytest.mark.parametrize("fmt", ["int4-g32", "nvfp4", "fp8"])
def test_gemma3_quantizes_and_loads(fmt, tiny_float_model, tmp_path, reference_kernels):
    src = tiny_float_model("gemma3", layers=2)
    quantize_model(src, fmt, out_dir=tmp_path / "q")
    got = load_model(tmp_path / "q")(IDS)
    want = load_model(dequantized_twin(src, tmp_path / "q", tmp_path / "dense"))(IDS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_default_kernels_stay_close_to_reference(tiny_float_model, tmp_path, monkeypatch):
    src = tiny_float_model("llama")
    quantize_model(src, "int4-g32", out_dir=tmp_path / "q")
    fast = load_model(tmp_path / "q")(IDS)
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")
    exact = load_model(tmp_path / "q")(IDS)
    assert (fast - exact).abs().max() < 0.05 * exact.abs().max()


def test_summary_and_checkpoint_contents(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    summary = quantize_model(src, "int4-g32", out_dir=tmp_path / "q")
    out = tmp_path / "q"
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "lowbit" and qc["method"] == "rtn" and len(qc["modules"]) == 14
    assert qc["modules"]["model.layers.0.mlp.down_proj"]["spec"]["group_size"] == 32
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    # every Linear counted at its exact stored size; overall adds embeddings, norms and head in bf16
    linear_bytes = sum(weight_bytes("int4-g32", m.shape) for m in summary.modules)
    assert summary.linear_bits_per_weight == pytest.approx(8 * linear_bytes / summary.linear_params)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert "model.layers.0.mlp.down_proj.weight" not in f.keys()
    assert summary.bytes_after == stored
    assert summary.bytes_before == (src / "model.safetensors").stat().st_size - _header_bytes(src / "model.safetensors")


def _header_bytes(path) -> int:
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_tied_embeddings_stay_tied(tiny_float_model, tmp_path):
    src = tiny_float_model("llama", tie=True)
    quantize_model(src, "nf4", out_dir=tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith("lm_head")]
    model = load_model(tmp_path / "q")
    assert model.lm_head.weight is model.model.embed_tokens.weight


# int8 and int4 cut rows out of the QTensor; nf4-dq and fp8 2-D blocks span rows (a decoded table)
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "nf4-dq", "fp8-block32", "gemma3:int4-asym-g32"])
def test_quantized_tied_head_is_stored_once_and_is_the_embedding(fmt, tiny_float_model, tmp_path, reference_kernels):
    family, _, fmt = fmt.rpartition(":")
    src = tiny_float_model(family or "llama", tie=True)
    plain = quantize_model(src, fmt, out_dir=tmp_path / "plain")
    summary = quantize_model(src, fmt, out_dir=tmp_path / "q", quantize_head=True)
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if n.startswith("model.embed_tokens")] and "lm_head.weight.qweight" in names
    embed_bytes = 258 * 64 * 2
    head = next(m for m in summary.modules if m.name == "lm_head")
    assert head.format == summary.modules[0].format and summary.bytes_after == plain.bytes_after - embed_bytes + head.bytes_after
    assert json.loads((tmp_path / "q" / "config.json").read_text())["tie_word_embeddings"] is True

    model = load_model(tmp_path / "q")
    assert type(model.lm_head).__name__ == "QuantLinear" and type(model.model.embed_tokens).__name__ == "QuantEmbedding"
    # reference: a dense tied model whose one matrix is the dequantized head
    twin = dequantized_twin(src, tmp_path / "q", tmp_path / "dense")
    tensors = load_file(twin / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, twin / "model.safetensors")
    dense = load_model(twin)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), dense(IDS), rtol=1e-5, atol=1e-5)


def test_a_tied_head_kept_dense_by_skip_stays_the_embedding(tiny_float_model, tmp_path):
    src = tiny_float_model("llama", tie=True)
    quantize_model(src, "int8", out_dir=tmp_path / "q", quantize_head=True, skip=["lm_head"])
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "model.embed_tokens.weight" in names and not [n for n in names if n.startswith("lm_head")]
    model = load_model(tmp_path / "q")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_quantize_head_of_untied_model(tiny_float_model, tmp_path, reference_kernels):
    src = tiny_float_model("llama")
    summary = quantize_model(src, "int8", out_dir=tmp_path / "q", quantize_head=True)
    assert "lm_head" in {m.name for m in summary.modules}
    model = load_model(tmp_path / "q")
    assert type(model.lm_head).__name__ == "QuantLinear"
    want = load_model(dequantized_twin(src, tmp_path / "q", tmp_path / "dense"))(IDS)
    torch.testing.assert_close(model(IDS), want, rtol=1e-5, atol=1e-5)


def test_recipe_assigns_formats_first_match_wins(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(
        "rules:\n"
        "  - pattern: 'model.layers.*.mlp.down_proj'\n    format: int8\n"
        "  - pattern: 're:model\\.layers\\.1\\.self_attn\\.[qkv]_proj'\n    format: dense\n"
        "  - pattern: '*.self_attn.*'\n    format: int4\n    group_size: 32\n    options: {scale_rule: absmax}\n"
        "  - pattern: '*'\n    format: nvfp4\n"
    )
    summary = quantize_model(src, load_recipe(recipe_file), out_dir=tmp_path / "q")
    got = {m.name: m.format for m in summary.modules}
    assert got["model.layers.0.mlp.down_proj"] == got["model.layers.1.mlp.down_proj"] == "int8"
    assert got["model.layers.1.self_attn.k_proj"] == "dense"
    assert got["model.layers.1.self_attn.o_proj"] == got["model.layers.0.self_attn.q_proj"] == "int4-g32-absmax"
    assert got["model.layers.0.mlp.gate_proj"] == "nvfp4"
    modules = NativeReader(tmp_path / "q").module_meta
    assert "model.layers.1.self_attn.k_proj" not in modules and modules["model.layers.0.mlp.up_proj"]["format"] == "nvfp4"
    load_model(tmp_path / "q")  # mixed formats and dense Linears load together


def test_recipe_pattern_matching_nothing_is_an_error(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    recipe = parse_recipe([{"pattern": "*.mlp.down_projection", "format": "int8"}, {"pattern": "*", "format": "int4"}])
    with pytest.raises(UsageError, match="down_projection.*matches no"):
        quantize_model(src, recipe, out_dir=tmp_path / "q")
    with pytest.raises(UsageError, match="--skip"):
        quantize_model(src, "int4", skip=["*.mlp.nothing"], out_dir=tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "rules, message",
    [
        ([{"pattern": "*", "format": "int7"}], "unknown format"),
        ([{"pattern": "*", "format": "mxfp4", "group_size": 64}], "blocks of exactly 32"),
        ([{"pattern": "*", "format": "int4", "group_size": 48}], "group size 48"),
        ([{"pattern": "*", "format": "int4", "colour": 3}], "unknown key"),
        ([{"pattern": "re:(", "format": "int4"}], "regular expression"),
        ([], "non-empty"),
    ],
)
def test_bad_recipes(rules, message):
    with pytest.raises(UsageError, match=message):
        parse_recipe(rules)


def test_skip_keeps_modules_dense_and_exact(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    summary = quantize_model(src, "int4", skip=["*.o_proj", "re:.*layers\\.0\\.mlp\\..*"], out_dir=tmp_path / "q")
    dense = {m.name for m in summary.modules if m.format == "dense"}
    assert dense == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                     "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
    original = load_file(src / "model.safetensors")
    written = load_file(tmp_path / "q" / "model.safetensors")
    for module in dense:
        assert torch.equal(written[f"{module}.weight"], original[f"{module}.weight"])
    model = load_model(tmp_path / "q")
    assert type(model.model.layers[0].self_attn.o_proj).__name__ == "Linear"
    assert type(model.model.layers[1].mlp.down_proj).__name__ == "QuantLinear"


def test_fused_modules_share_the_nvfp4_global_scale(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    quantize_model(src, "nvfp4", out_dir=tmp_path / "q")
    original = load_file(src / "model.safetensors")
    reader = NativeReader(tmp_path / "q")
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            amax = max(original[f"{p}{m}.weight"].float().abs().max() for m in group)
            scales = [reader.quantized(p + m).global_scale for m in group]
            for s in scales:
                assert torch.equal(s, scales[0])
            assert scales[0].item() == pytest.approx(float(amax) / (6 * 448), rel=1e-6)
        own = original[f"{p}self_attn.o_proj.weight"].float().abs().max()
        assert reader.quantized(p + "self_attn.o_proj").global_scale.item() == pytest.approx(float(own) / (6 * 448), rel=1e-6)


def test_ragged_last_group_equals_a_narrower_group(tiny_float_model, tmp_path):
    # hidden 96 with g64: every row of q/k/v/gate/up ends in a 32-column group, as SmolLM2's 576 with g128
    src = tiny_float_model("llama", hidden=96, intermediate=160)
    quantize_model(src, "int4-g64", out_dir=tmp_path / "q")
    w = load_file(src / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].float()
    qt = NativeReader(tmp_path / "q").quantized("model.layers.0.mlp.up_proj")
    assert qt.scales.shape == (160, 2)
    head = quantize_rtn(w[:, :64], "int4-g64").dequantize()
    tail = quantize_rtn(w[:, 64:], "int4-g32").dequantize()
    assert torch.equal(qt.dequantize(), torch.cat([head, tail], dim=1))
    load_model(tmp_path / "q")(IDS)


def test_bad_inputs_leave_nothing_behind(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    out = tmp_path / "q"
    with pytest.raises(UsageError, match="unknown format"):
        quantize_model(src, "int7", out_dir=out)
    with pytest.raises(LowbitError, match="model not found"):
        quantize_model(tmp_path / "missing", "int4", out_dir=out)
    with pytest.raises(UsageError, match="would overwrite the model"):
        quantize_model(src, "int4", out_dir=src, overwrite=True)
    with pytest.raises(UsageError, match="unknown method"):
        quantize_model(src, "int4", out_dir=out, method="nope")
    assert not out.exists()
    quantize_model(src, "int4", out_dir=out)
    with pytest.raises(UsageError, match="already exists"):
        quantize_model(src, "int4", out_dir=out)
    with pytest.raises(LowbitError, match="already quantized"):
        quantize_model(out, "int4", out_dir=tmp_path / "again")
    assert not (tmp_path / "again").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary siblings left


def test_a_method_plugs_in_per_layer(tiny_float_model, tmp_path):
    seen = []

    def make(context):
        assert context.num_layers == 2 and context.options.custom == {"alpha": 1}

        def method(work):
            seen.append((work.name, sorted(work.specs), work.fused))
            result = rtn_layer(work)
            norm = f"{work.name}.post_attention_layernorm.weight"
            if norm in work.tensors:  # what AWQ does: fold scales into the preceding norm
                result.dense[norm] = work.tensors[norm] * 2
            return LayerResult(result.qtensors, result.dense, notes=[f"{work.name} done"])

        return method

    register_method("test-double-norm", make)
    src = tiny_float_model("llama")
    summary = quantize_model(src, "int8", out_dir=tmp_path / "q", method="test-double-norm",
                             method_options=MethodOptions(method="test-double-norm", custom={"alpha": 1}))
    assert [s[0] for s in seen] == ["embeddings", "model.layers.0", "model.layers.1", "head"]
    assert set(seen[1][2]) == {("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"),
                               ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")}
    assert "model.layers.1 done" in summary.notes
    written = load_file(tmp_path / "q" / "model.safetensors")
    original = load_file(src / "model.safetensors")
    key = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(written[key], original[key] * 2)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["method"] == "test-double-norm"
