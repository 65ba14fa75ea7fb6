"""Bad MoE checkpoints (#26): a top-k above the expert count, a missing or misshapen expert tensor, a
router of the wrong width are one line naming the tensor, with nothing written, for `quantize` (RTN
had written them "successfully": its checks skipped MoE models) and `convert` (which had written a
GGUF llama.cpp cannot load, or stopped on a numpy error). And transformers 5's fused expert layout
(`mlp.experts.gate_up_proj` [E, 2I, H]) quantizes like the per-expert one: it had been left dense."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.formats.native import NativeReader
from lowbit.runtime.loader import load_model
from tests.runtime.moe_models import save_moe


def _damaged(tmp_path, how: str):
    src, _ = save_moe("mixtral", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    name = {"missing": "model.layers.1.block_sparse_moe.experts.5.w3.weight",
            "router": "model.layers.0.block_sparse_moe.gate.weight",
            "misshapen": "model.layers.1.block_sparse_moe.experts.2.w2.weight"}.get(how)
    if how == "missing":
        del tensors[name]
    elif how == "router":
        tensors[name] = torch.zeros(8, 60)
    elif how == "misshapen":
        tensors[name] = tensors[name][:, :16].contiguous()
    elif how == "topk":
        config["num_experts_per_tok"] = 9
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(config))
    return src


EXPECTED = {
    "missing": r"lacks 1 weight\(s\) MixtralForCausalLM needs, e\.g\. model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight",
    "router": r"weight model\.layers\.0\.mlp\.gate\.weight in .* has shape \(8, 60\), config\.json implies \(8, 64\)",
    "misshapen": r"weight model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight in .* has shape \(64, 16\), config\.json implies \(64, 32\)",
    "topk": r"num_experts_per_tok 9 exceeds the model's 8 experts",
}


@pytest.mark.parametrize("how", list(EXPECTED))
@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_bad_moe_is_one_line_and_writes_nothing(tmp_path, run_cli, how, command):
    import re

    src = _damaged(tmp_path, how)
    out = tmp_path / ("out.gguf" if command == "convert" else "out")
    args = ["quantize", str(src), "--format", "int4", "-g", "32", "-o", str(out)] if command == "quantize" else \
        ["convert", str(src), "--to", "gguf", "-o", str(out)]
    code, _, err = run_cli(args)
    assert code != 0 and err.count("\n") == 1 and re.search(EXPECTED[how], err), err
    assert not out.exists()


def test_fused_expert_layout_quantizes_like_per_expert(tmp_path, run_cli):
    src, hf = save_moe("mixtral", tmp_path / "src")
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused_dir / f).write_bytes((src / f).read_bytes())
    fused = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}  # transformers 5's in-memory names
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, str(fused_dir / "model.safetensors"))
    for name, directory in (("per-expert", src), ("fused", fused_dir)):
        code, _, err = run_cli(["quantize", str(directory), "--format", "int4", "-g", "32", "-o", str(tmp_path / f"q-{name}")])
        assert code == 0, err
    a, b = NativeReader(tmp_path / "q-per-expert"), NativeReader(tmp_path / "q-fused")
    assert sorted(a.modules) == sorted(b.modules) and "model.layers.1.mlp.experts.7.up_proj" in b.modules
    for module in a.modules:
        assert torch.equal(a.quantized(module).dequantize(), b.quantized(module).dequantize()), module
    ids = torch.randint(0, 258, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "q-per-expert")(ids), load_model(tmp_path / "q-fused")(ids))
    # and converts to GGUF from the float directory as the per-expert one does
    for name, directory in (("per-expert", src), ("fused", fused_dir)):
        code, _, err = run_cli(["convert", str(directory), "--to", "gguf", "--allow-requant", "-o", str(tmp_path / f"{name}.gguf")])
        assert code == 0, err
    from lowbit.formats.foreign import read_checkpoint

    x, y = read_checkpoint(tmp_path / "per-expert.gguf"), read_checkpoint(tmp_path / "fused.gguf")
    assert sorted(x.qtensors) == sorted(y.qtensors) and sorted(x.dense) == sorted(y.dense)
    for module, qt in x.qtensors.items():
        assert torch.equal(qt.dequantize(), y.qtensors[module].dequantize()), module
    for name, t in x.dense.items():
        assert torch.equal(t, y.dense[name]), name
