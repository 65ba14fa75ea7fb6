"""Every MoE layout's expert names reach the writers in lowbit's one spelling (formats/moe_names.py).

A hub Mixtral (`block_sparse_moe.experts.E.w1/w3/w2`) in bf16 converts to GGUF (it had stopped at
"has no GGUF counterpart"); llm-compressor's Mixtral exports (transformers 5) name the experts
`block_sparse_moe.experts.E.gate_proj/up_proj/down_proj` and keep the model's bf16 scales, which
Q4_0's float16 holds exactly whenever every value survives the trip: such a checkpoint converts to
GGUF exactly, each expert's Q4_0 blocks decoding to its weights bit for bit. A bf16 scale float16
cannot hold is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.gguf_blocks import exact_gguf_type
from lowbit.formats.moe_names import to_lowbit, to_mixtral
from lowbit.formats.native import NativeReader
from lowbit.quant.spec import parse_spec
from tests.runtime.moe_models import save_moe

LLMC_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def test_names_map_both_ways():
    lowbit = "model.layers.3.mlp.experts.5.down_proj"
    assert to_mixtral(lowbit) == "model.layers.3.block_sparse_moe.experts.5.w2"
    assert to_mixtral("model.layers.3.mlp.gate") == "model.layers.3.block_sparse_moe.gate"
    assert to_lowbit("model.layers.3.block_sparse_moe.experts.5.w2.weight_packed") == lowbit + ".weight_packed"
    assert to_lowbit("model.layers.3.block_sparse_moe.experts.5.down_proj.weight") == lowbit + ".weight"  # llm-compressor
    assert to_lowbit("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    for name in (lowbit, "model.layers.3.mlp.gate", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert to_lowbit(to_mixtral(name)) == name
    assert to_lowbit("model.layers.0.mlp.w1") == "model.layers.0.mlp.w1"  # only experts' w1/w2/w3


def test_hub_mixtral_in_bf16_converts_to_gguf(tmp_path):
    src, _ = save_moe("mixtral", Path(tmp_path) / "src")
    weights = {k: v.bfloat16() for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, src / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in weights
    result = convert(src, tmp_path / "m.gguf", "gguf")
    assert result.exact and not result.changes
    back = read_checkpoint(tmp_path / "m.gguf")
    for name, w in weights.items():
        assert torch.equal(back.dense[to_lowbit(name)], w.float()), name


def _llm_compressor_style(tmp_path: Path, scale_dtype: str) -> tuple[Path, Path]:
    """A Mixtral quantized int4-g32 with `scale_dtype` scales, exported as compressed-tensors and
    renamed to llm-compressor's expert names: (its native checkpoint, the export)."""
    from lowbit.compress.pipeline import quantize_model

    src, _ = save_moe("mixtral", tmp_path / "src")
    quantize_model(src, parse_spec("int4", 32, scale_dtype=scale_dtype), out_dir=tmp_path / "q")
    convert(tmp_path / "q", tmp_path / "ct", "compressed-tensors")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(path)
    renamed = {}
    for name, t in tensors.items():
        for old, new in LLMC_NAMES.items():
            name = name.replace(f".{old}.", f".{new}.")
        renamed[name] = t
    assert any(".block_sparse_moe.experts.0.gate_proj.weight_packed" in n for n in renamed)
    save_file(renamed, path)
    return tmp_path / "q", tmp_path / "ct"


def test_llm_compressor_mixtral_with_bf16_scales_exports_exact_q4_0(tmp_path):
    native_dir, ct_dir = _llm_compressor_style(tmp_path, "bfloat16")
    assert json.loads((native_dir / "config.json").read_text())["quantization_config"]
    native = NativeReader(native_dir)
    ckpt = read_checkpoint(ct_dir)
    experts = [m for m in ckpt.qtensors if ".experts." in m]
    assert len(experts) == 2 * 8 * 3 and all(".mlp.experts." in m for m in experts)
    assert all(ckpt.qtensors[m].scales.dtype == torch.bfloat16 for m in experts)

    result = convert(ct_dir, tmp_path / "m.gguf", "gguf")
    assert result.exact and not result.changes
    back = read_checkpoint(tmp_path / "m.gguf")
    for module in experts:
        assert back.qtensors[module].spec.label.startswith("int4-g32")
        assert torch.equal(back.qtensors[module].dequantize(), native.quantized(module).dequantize()), module


def test_bf16_scales_float16_cannot_hold_are_refused():
    spec = parse_spec("int4", 64, scale_dtype="bfloat16")
    fits = torch.tensor([[0.5, 2.0 ** -10]], dtype=torch.bfloat16)
    tiny = torch.tensor([[0.5, 2.0 ** -30]], dtype=torch.bfloat16)  # below float16's smallest subnormal
    huge = torch.tensor([[0.5, 2.0 ** 20]], dtype=torch.bfloat16)  # beyond float16's 65504
    assert exact_gguf_type(spec, 128, fits) == "Q4_0"
    assert exact_gguf_type(spec, 128, tiny) is None and exact_gguf_type(spec, 128, huge) is None
    assert exact_gguf_type(spec, 128) is None  # without the values, only float16 scales are known to fit
    assert exact_gguf_type(parse_spec("int4", 64, scale_dtype="float16"), 128) == "Q4_0"


def test_a_weight_with_an_unfit_bf16_scale_stops_the_gguf_export(tmp_path):
    native_dir, ct_dir = _llm_compressor_style(tmp_path, "bfloat16")
    path = ct_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.block_sparse_moe.experts.3.down_proj.weight_scale"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = 2.0 ** -30
    save_file(tensors, path)
    with pytest.raises(LowbitError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj.*--allow-requant"):
        convert(ct_dir, tmp_path / "m.gguf", "gguf")
    assert not (tmp_path / "m.gguf").exists()
