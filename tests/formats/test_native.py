"""lowbit's native checkpoint: save → load gives identical QTensors and dense tensors."""

import json

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.native import NativeReader, NativeWriter, is_native, load_native, save_native
from lowbit.quant.registry import get_format, parse_spec


def make_qtensors():
    g = torch.Generator().manual_seed(3)
    out = {}
    for i, label in enumerate(["int4-g128", "int4-asym-g64", "int8", "nf4-dq", "fp8-block128", "mxfp4", "nvfp4", "int4-asym-g32-dq"]):
        w = torch.randn(40, 576, generator=g)
        spec = parse_spec(label)
        out[f"model.layers.{i}.mlp.up_proj"] = get_format(spec).quantize(w, spec)
    return out


def assert_same(a, b):
    assert a.spec == b.spec and a.shape == b.shape
    assert a.parts().keys() == b.parts().keys()
    for name, t in a.parts().items():
        u = b.parts()[name]
        assert t.dtype == u.dtype and t.shape == u.shape
        assert torch.equal(t.view(torch.uint8), u.view(torch.uint8)), name


@pytest.mark.parametrize("shard_bytes", [2 * 1024**3, 20_000])
def test_save_load_round_trip(tmp_path, shard_bytes):
    qtensors = make_qtensors()
    dense = {"model.embed_tokens.weight": torch.randn(50, 576).bfloat16(), "model.norm.weight": torch.ones(576)}
    config = {"model_type": "llama", "hidden_size": 576}
    out = tmp_path / "ckpt"
    qconfig = save_native(out, qtensors, dense, config=config, max_shard_bytes=shard_bytes)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "llama" and written["quantization_config"] == qconfig
    meta = qconfig["modules"]["model.layers.0.mlp.up_proj"]
    assert meta["format"] == "int4" and meta["shape"] == [40, 576] and meta["spec"]["layout_version"] == 1
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (shard_bytes < 10**6)
    assert is_native(out)

    ckpt = load_native(out)
    assert ckpt.qtensors.keys() == qtensors.keys()
    for name, qt in qtensors.items():
        assert_same(qt, ckpt.qtensors[name])
        assert torch.equal(ckpt.qtensors[name].dequantize(), qt.dequantize())
    assert ckpt.dense.keys() == dense.keys()
    for name, t in dense.items():
        assert ckpt.dense[name].dtype == t.dtype and torch.equal(ckpt.dense[name], t)


def test_tensor_names_follow_the_module(tmp_path):
    from safetensors import safe_open

    qt = make_qtensors()["model.layers.6.mlp.up_proj"]  # nvfp4
    save_native(tmp_path / "c", {"model.layers.0.self_attn.q_proj": qt})
    with safe_open(str(tmp_path / "c" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == [
            "model.layers.0.self_attn.q_proj.weight.global_scale",
            "model.layers.0.self_attn.q_proj.weight.qweight",
            "model.layers.0.self_attn.q_proj.weight.scales",
        ]


def test_writer_streams_into_an_existing_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    writer = NativeWriter(tmp_path, max_shard_bytes=1)
    for name, qt in make_qtensors().items():
        writer.add_quantized(name, qt)
    with pytest.raises(UsageError, match="already written"):
        writer.add_quantized(name, qt)
    writer.close()
    reader = NativeReader(tmp_path)
    assert reader.config["model_type"] == "gemma3_text"
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert_same(reader.quantized(name), qt)


def test_refuses_existing_output_and_foreign_directories(tmp_path):
    save_native(tmp_path / "c", make_qtensors())
    with pytest.raises(UsageError, match="already exists"):
        save_native(tmp_path / "c", {})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert not is_native(tmp_path / "hf")
    with pytest.raises(LowbitError, match="not a lowbit quantized checkpoint"):
        load_native(tmp_path / "hf")


def test_corrupt_part_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    save_native(tmp_path / "c", make_qtensors())
    path = tmp_path / "c" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.up_proj.weight.scales"] = tensors["model.layers.0.mlp.up_proj.weight.scales"][:, :2].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(LowbitError, match=r"model.layers.0.mlp.up_proj.scales: expected"):
        load_native(tmp_path / "c")
