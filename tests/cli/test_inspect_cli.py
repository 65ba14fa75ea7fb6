"""`lowbit inspect`: per-layer sizes from the stored tensors, errors against the base, worst first."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.formats.native import NativeReader
from lowbit.compress.pipeline import quantize_model
from lowbit.compress.recipe import parse_recipe


@pytest.fixture
def mixed(tiny_float_model, tmp_path):
    src = tiny_float_model("llama")
    recipe = parse_recipe([{"pattern": "*.down_proj", "format": "int8"}, {"pattern": "*.o_proj", "format": "dense"},
                           {"pattern": "*", "format": "int4", "group_size": 32}])
    quantize_model(src, recipe, out_dir=tmp_path / "q")
    return src, tmp_path / "q"


def test_inspect_json_with_base(mixed, run_cli):
    src, ckpt = mixed
    code, out, _ = run_cli(["inspect", str(ckpt), "--base", str(src), "--json"])
    assert code == 0
    report = json.loads(out)
    layers = report["layers"]
    assert report["formats"] == {"int8": 2, "int4-g32": 10} and len(layers) == 12
    errors = [layer["rel_error"] for layer in layers]
    assert errors == sorted(errors, reverse=True)  # worst first
    assert all(e < 0.02 for e in errors[-2:]) and errors[0] > 0.05  # int8 far better than int4
    # each error recomputed directly in float64
    reader = NativeReader(ckpt)
    original = load_file(src / "model.safetensors")
    for layer in layers[:3]:
        w = original[layer["name"] + ".weight"].double()
        err = (reader.quantized(layer["name"]).dequantize(torch.float64) - w).norm() / w.norm()
        assert layer["rel_error"] == pytest.approx(float(err), rel=1e-9)
    first = next(layer for layer in layers if layer["format"] == "int4-g32")
    assert first["group"] == "g32" and first["bits_per_weight"] == pytest.approx(4.5)
    assert first["bytes"] == first["shape"][0] * first["shape"][1] // 2 + first["shape"][0] * first["shape"][1] // 32 * 2
    stored = sum(t.numel() * t.element_size() for t in load_file(ckpt / "model.safetensors").values())
    assert report["total"]["bytes"] == stored
    params = sum(t.numel() for t in original.values())
    assert report["total"]["params"] == params and report["total"]["bf16_bytes"] == 2 * params


def test_inspect_table_without_base(mixed, run_cli):
    _, ckpt = mixed
    code, out, err = run_cli(["inspect", str(ckpt)])
    assert code == 0 and out == ""
    assert "down_proj" in err and "int8" in err and "int4-g32 ×10" in err
    assert "bf16 would be" in err and "rel. error" not in err


def test_inspect_errors(mixed, tmp_path, run_cli):
    src, ckpt = mixed
    code, _, err = run_cli(["inspect", str(src)])
    assert code == 1 and "is a float checkpoint: no quantized layers" in err and err.count("\n") == 1
    code, _, err = run_cli(["inspect", str(tmp_path / "nothing")])
    assert code == 1 and "not found" in err
    code, _, err = run_cli(["inspect", str(ckpt), "--base", str(ckpt)])
    assert code == 1 and "itself quantized" in err


@pytest.mark.parametrize("target", ["compressed-tensors", "gptq", "awq"])
def test_inspect_reads_exported_formats(tiny_float_model, tmp_path, run_cli, target):
    """A GPTQ / AWQ / compressed-tensors directory is inspected as the layers lowbit runs (it had been
    called a float checkpoint): the same rows, sizes and errors as the lowbit checkpoint it came from."""
    from lowbit.formats.convert import convert
    from lowbit.quant.spec import parse_spec

    src = tiny_float_model("llama")
    spec = parse_spec("int4-asym", 32, scale_dtype="float16") if target == "awq" else parse_spec("int4", 32)
    quantize_model(src, spec, out_dir=tmp_path / "q")
    convert(tmp_path / "q", tmp_path / "x", target)
    reports = []
    for ckpt in (tmp_path / "q", tmp_path / "x"):
        code, out, _ = run_cli(["inspect", str(ckpt), "--base", str(src), "--json"])
        assert code == 0
        reports.append(json.loads(out))
    native, foreign = reports
    assert native["kind"] == "native" and foreign["kind"] == target and foreign["read_as_float"] == {}
    assert len(foreign["layers"]) == len(native["layers"]) == 14
    by_name = {layer["name"]: layer for layer in native["layers"]}
    for layer in foreign["layers"]:
        mine = by_name[layer["name"]]
        assert (layer["shape"], layer["group"], layer["bits_per_weight"]) == (mine["shape"], mine["group"], mine["bits_per_weight"])
        assert layer["rel_error"] == pytest.approx(mine["rel_error"], rel=1e-12)
    assert foreign["quantized"] == native["quantized"]


def test_inspect_reads_a_gguf_file(tiny_float_model, tmp_path, run_cli):
    """A GGUF file: each projection under its GGUF type with the file's bytes (Q4_0: 18 bytes per 32
    weights), the same weight error as the checkpoint it was exported from, and the totals the sum of
    the file's tensors."""
    from lowbit.formats.convert import convert
    from lowbit.formats.gguf_reader import open_gguf
    from lowbit.quant.spec import parse_spec

    src = tiny_float_model("llama")
    quantize_model(src, parse_spec("int4", 32), out_dir=tmp_path / "q")
    convert(tmp_path / "q", tmp_path / "m.gguf", "gguf")
    reports = []
    for ckpt in (tmp_path / "q", tmp_path / "m.gguf"):
        code, out, err = run_cli(["inspect", str(ckpt), "--base", str(src), "--json"])
        assert code == 0, err
        reports.append(json.loads(out))
    native, gguf = reports
    assert gguf["kind"] == "gguf" and gguf["formats"] == {"Q4_0": 14}
    mine = {layer["name"]: layer for layer in native["layers"]}
    for layer in gguf["layers"]:
        n, k = layer["shape"]
        assert layer["bytes"] == n * k // 32 * 18 and layer["bits_per_weight"] == 4.5 and layer["group"] == "g32"
        assert layer["rel_error"] == pytest.approx(mine[layer["name"]]["rel_error"], rel=1e-12)
    file = open_gguf(tmp_path / "m.gguf")
    infos = [file.info(name) for name in file.tensor_names()]
    assert gguf["total"]["bytes"] == sum(i.n_bytes for i in infos)
    assert gguf["total"]["params"] == native["total"]["params"]
