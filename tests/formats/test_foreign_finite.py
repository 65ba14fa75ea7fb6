"""NaN/inf in a foreign checkpoint (Hugging Face, compressed-tensors, GPTQ, AWQ) stops every
conversion naming the tensor, --allow-requant or not: before, a NaN norm of an HF directory, or the
NaN weights an act-order layer's damaged scale dequantizes to, were written into a GGUF as they were."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert


def test_nan_norm_of_an_hf_directory_is_refused(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.post_attention_layernorm.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = float("inf")
    save_file(tensors, src / "model.safetensors")
    for target, out in (("gguf", tmp_path / "m.gguf"), ("native", tmp_path / "n")):
        with pytest.raises(LowbitError, match=rf"tensor {name} in .* holds 1 NaN/inf value"):
            convert(src, out, target, allow_requant=True)
        assert not out.exists()


@pytest.mark.parametrize("target", ["gguf", "gptq"])
def test_nan_scale_of_a_compressed_tensors_layer_is_refused(tiny_float_model, tmp_path, target):
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    quantize_model(tiny_float_model("llama"), parse_spec("int4-g32"), out_dir=tmp_path / "q")
    convert(tmp_path / "q", tmp_path / "ct", "compressed-tensors")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(path)
    module = "model.layers.0.self_attn.q_proj"
    k = int(tensors[f"{module}.weight_shape"][1])
    tensors[f"{module}.weight_g_idx"] = (torch.randperm(k, generator=torch.Generator().manual_seed(0)) // 32).int()
    tensors[f"{module}.weight_scale"] = tensors[f"{module}.weight_scale"].clone()
    tensors[f"{module}.weight_scale"][0, 0] = float("nan")
    save_file(tensors, path)
    out = tmp_path / ("m.gguf" if target == "gguf" else "g")
    with pytest.raises(LowbitError, match=rf"tensor {module}\.weight in .* holds \d+ NaN/inf"):
        convert(tmp_path / "ct", out, target, allow_requant=True)
    assert not out.exists()
