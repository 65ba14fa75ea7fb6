"""An MoE router stays dense unless a recipe rule naming routers alone quantizes it (#26): `*` leaves
every router dense; `re:.*mlp\\.gate$` quantizes them (RTN), the runtime routes with the dequantized
weight, and GGUF / compressed-tensors exports write that weight dense (float32: its exact values)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from lowbit.compress.pipeline import quantize_model
from lowbit.compress.recipe import parse_recipe
from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import NativeReader
from lowbit.runtime.loader import load_model
from tests.runtime.moe_models import save_moe

ROUTER_RULE = {"pattern": r"re:.*mlp\.(gate|shared_expert_gate)$", "format": "int8", "group_size": 32}
REST = {"pattern": "*", "format": "int4", "group_size": 32}


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_router_rule_quantizes_routers_and_star_does_not(tmp_path, case):
    # every layer sparse and a shared expert of whole 32-groups: the shapes llama.cpp's qwen2moe takes
    src, _ = save_moe(case, tmp_path / "src",
                      **({"shared_expert_intermediate_size": 64, "decoder_sparse_step": 1} if case == "qwen2_moe" else {}))
    sparse = [0, 1]
    routers = [f"model.layers.{i}.mlp.gate" for i in sparse]
    if case == "qwen2_moe":
        routers += [f"model.layers.{i}.mlp.shared_expert_gate" for i in sparse]

    quantize_model(src, parse_recipe([REST]), out_dir=tmp_path / "star")
    assert not set(routers) & set(NativeReader(tmp_path / "star").modules)  # `*` leaves every router dense

    quantize_model(src, parse_recipe([ROUTER_RULE, REST]), out_dir=tmp_path / "q")
    reader = NativeReader(tmp_path / "q")
    assert set(routers) <= set(reader.modules)
    model = load_model(tmp_path / "q")
    for router in routers:
        qt = reader.quantized(router)
        assert qt.spec.label.startswith("int8")
        assert torch.equal(model.get_submodule(router).weight.float(), qt.dequantize(torch.float32))
    # the same logits as a model whose routers were replaced by their dequantized weights by hand
    ids = torch.randint(0, 258, (1, 20), generator=torch.Generator().manual_seed(0))
    star = load_model(tmp_path / "star")
    for router in routers:
        star.get_submodule(router).weight.data = reader.quantized(router).dequantize(torch.float32)
    with torch.no_grad():
        assert torch.equal(model(ids), star(ids))

    # exports: the router dense in float32, its exact dequantized values
    for target, out in (("compressed-tensors", tmp_path / "ct"), ("gguf", tmp_path / "m.gguf")):
        result = convert(tmp_path / "q", out, target)
        assert result.exact, target
        back = read_checkpoint(out)
        for router in routers:
            assert router not in back.qtensors
            assert torch.equal(back.dense[f"{router}.weight"].float(), reader.quantized(router).dequantize(torch.float32)), (target, router)
    if case == "mixtral":
        with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
            assert f.get_slice("model.layers.0.block_sparse_moe.gate.weight").get_dtype() == "F32"


def test_router_rule_with_calibration_uses_rtn(tmp_path, run_cli):
    src, _ = save_moe("mixtral", tmp_path / "src")
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps([ROUTER_RULE, REST]))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    for method in ("gptq", "awq"):
        code, _, err = run_cli(["quantize", str(src), "--recipe", str(recipe), "--method", method, "--data", str(text),
                                "--samples", "2", "--seqlen", "32", "-o", str(tmp_path / method)])
        assert code == 0, err
        reader = NativeReader(tmp_path / method)
        assert "model.layers.1.mlp.gate" in reader.modules
        load_model(tmp_path / method)
