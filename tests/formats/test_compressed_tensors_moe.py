"""compressed-tensors export of mixture-of-experts checkpoints, in the layout vLLM loads: one
quantized Linear per expert under the hub names (Mixtral: block_sparse_moe.experts.E.w1/w3/w2;
Qwen2/3-MoE: mlp.experts.E.gate_proj/up_proj/down_proj), routers dense and in `ignore`. The
compressed-tensors package decompresses every expert to lowbit's weights; lowbit reads the export
back to the same QTensors under its own names, and the logits are the original's exactly. An
act-order layer (weight_g_idx) is read by its g_idx, never as contiguous groups."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import NativeReader
from lowbit.runtime.loader import load_model
from tests.runtime.moe_models import save_moe

ct = pytest.importorskip("compressed_tensors")

MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _hub_name(case: str, module: str) -> str:
    """The name vLLM's model code loads for a lowbit module name."""
    if case != "mixtral":
        return module
    head, _, kind = module.replace(".mlp.", ".block_sparse_moe.").rpartition(".")
    return f"{head}.{MIXTRAL_NAMES.get(kind, kind)}"


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_moe_compressed_tensors_layout_and_round_trip(tmp_path, case):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    # a shared expert 64 wide: its down_proj's rows are whole groups of 32 (48 would be ragged)
    src, _ = save_moe(case, tmp_path / "src", **({"shared_expert_intermediate_size": 64} if case == "qwen2_moe" else {}))
    quantize_model(src, parse_spec("int4-g32"), out_dir=tmp_path / "q")
    result = convert(tmp_path / "q", tmp_path / "ct", "compressed-tensors")
    assert result.exact and not result.changes
    native = NativeReader(tmp_path / "q")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    (group,) = qc.config_groups.values()
    assert group.targets == ["Linear"]

    # routers (and Qwen2-MoE's shared-expert gate) dense under their hub names, and ignored
    sparse = [0, 1] if case == "mixtral" else [1]  # qwen2_moe fixture: layer 0 dense (decoder_sparse_step 2)
    routers = [_hub_name(case, f"model.layers.{layer}.mlp.gate") for layer in sparse]
    if case == "qwen2_moe":
        routers += [f"model.layers.{layer}.mlp.shared_expert_gate" for layer in sparse]
    for router in routers:
        assert router in qc.ignore and f"{router}.weight" in tensors and f"{router}.weight_packed" not in tensors
    assert "lm_head" in qc.ignore
    if case == "mixtral":
        assert not any(".mlp." in n for n in tensors)  # nothing left under lowbit's own spelling

    # every expert: the package's decompressor gives lowbit's weights (in the scale dtype, exactly)
    compressor = BaseCompressor.load_from_registry(group.format or qc.format)
    experts = [f"model.layers.{layer}.mlp.experts.{e}.{kind}" for layer in sparse for e in range(8)
               for kind in ("gate_proj", "up_proj", "down_proj")]
    for module in experts:
        hub = _hub_name(case, module)
        local = {n[len(hub) + 1:]: t for n, t in tensors.items() if n.startswith(hub + ".")}
        assert set(local) == {"weight_packed", "weight_scale", "weight_shape"}, hub
        qt = native.quantized(module)
        assert torch.equal(compressor.decompress(local, group)["weight"], qt.dequantize(torch.float16)), hub

    # lowbit reads it back under its own names: the same QTensors, the same logits
    back = read_checkpoint(tmp_path / "ct")
    for module in experts:
        assert torch.equal(back.qtensors[module].dequantize(), native.quantized(module).dequantize()), module
    assert f"model.layers.{sparse[0]}.mlp.gate.weight" in back.dense
    ids = torch.randint(0, 258, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "ct")(ids), load_model(tmp_path / "q")(ids))


def test_act_order_g_idx_is_honoured(tmp_path):
    """A GPTQ act-order checkpoint (llm-compressor's actorder "group") carries weight_g_idx: column j
    is in group g_idx[j]. lowbit had read such groups as j // G, silently wrong weights; it now
    imports the layer as its exact float32 values and names it unexpressed."""
    from safetensors.torch import save_file

    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    src, _ = save_moe("mixtral", tmp_path / "src")
    quantize_model(src, parse_spec("int4-g32"), out_dir=tmp_path / "q")
    convert(tmp_path / "q", tmp_path / "ct", "compressed-tensors")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(path)
    module = "model.layers.0.self_attn.q_proj"
    n, k = (int(v) for v in tensors[f"{module}.weight_shape"])
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(1)) // 32  # act-order: groups scattered
    scales = torch.stack([w[:, g_idx == g].abs().amax(1) / 7 for g in range(k // 32)], 1).half()
    q = torch.clamp(torch.round(w / scales.float()[:, g_idx]), -8, 7)
    codes = (q + 8).to(torch.uint8)
    packed = codes[:, 0::8].int()
    for i in range(1, 8):  # eight 4-bit codes per int32, element 0 in the lowest bits
        packed |= codes[:, i::8].int() << (4 * i)
    tensors[f"{module}.weight_packed"] = packed
    tensors[f"{module}.weight_scale"] = scales
    tensors[f"{module}.weight_g_idx"] = g_idx.int()
    save_file(tensors, path)
    expected = q * scales.float()[:, g_idx]

    back = read_checkpoint(tmp_path / "ct")
    assert module not in back.qtensors and "act-order" in back.unexpressed[module][0]
    assert torch.equal(back.dense[f"{module}.weight"], expected)
    # a trivial g_idx (j // G) changes nothing: the layer stays int4
    tensors[f"{module}.weight_g_idx"] = (torch.arange(k) // 32).int()
    save_file(tensors, path)
    back = read_checkpoint(tmp_path / "ct")
    assert torch.equal(back.qtensors[module].dequantize(), (((codes.float() - 8) * scales.float().repeat_interleave(32, 1))))
