"""Mixture-of-experts GGUF, both ways, for every MoE family llama.cpp has: Mixtral (its llama
architecture with experts), qwen2moe (shared expert), qwen3moe (q/k norms, expert width key), olmoe
(q/k norms over the whole projection).

A tiny random model of each, quantized int4-g32 (RTN), exports exactly (every expert's Q4_0 blocks
stacked into ffn_{gate,up,down}_exps); the names written are the ones gguf-py lists for the
architecture, the metadata are llama.cpp's keys; imported back (lowbit eval/generate on the .gguf,
and `convert` to an hf directory) the logits equal the original checkpoint's exactly and every
expert's QTensor is the original's bit for bit. llama.cpp itself ran these exports (llama-perplexity
beside lowbit eval: docs/convert.md). What llama.cpp would run differently is refused by name.
"""

from __future__ import annotations

import re
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.foreign import read_checkpoint
from lowbit.formats.native import NativeReader
from lowbit.runtime.loader import load_model
from tests.formats.conftest import _add_tiny_tokenizer
from tests.runtime.moe_models import save_moe

# The tiny fixtures of tests/runtime/moe_models.py, changed only where llama.cpp's graph for the
# architecture has no counterpart (every layer sparse; OLMoE without grouped k/v heads; a shared
# expert whose width is a whole number of 32-blocks, so it stays Q4_0).
LLAMA_CPP_SHAPES = {
    "mixtral": {},
    "qwen2_moe": dict(decoder_sparse_step=1, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(mlp_only_layers=[]),
    "olmoe": dict(num_key_value_heads=4),
}
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(case) -> (int4-g32 native checkpoint, its GGUF export, the export's ConvertResult), built once."""
    from lowbit.compress.pipeline import quantize_model
    from lowbit.quant.spec import parse_spec

    done = {}

    def make(case):
        if case not in done:
            root = tmp_path_factory.mktemp(case)
            src, _ = save_moe(case, root / "src", **LLAMA_CPP_SHAPES[case])
            _add_tiny_tokenizer(src)
            quantize_model(src, parse_spec("int4-g32"), out_dir=root / "q")
            done[case] = (root / "q", root / "m.gguf", convert(root / "q", root / "m.gguf", "gguf"))
        return done[case]

    return make


def _names_gguf_py_lists(arch: str) -> set[str]:
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_id]}


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_gguf_round_trip_is_exact(tmp_path, exported, case):
    q, path, result = exported(case)
    assert result.exact and not result.changes
    reader = gguf.GGUFReader(str(path))
    arch = ARCH[case]
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_count"] == 8
    assert fields[f"{arch}.expert_used_count"] == {"qwen2_moe": 3}.get(case, 2)
    width = {"qwen2_moe": 32, "qwen3_moe": 32}.get(case)
    assert fields.get(f"{arch}.expert_feed_forward_length") == width
    assert fields.get(f"{arch}.expert_shared_feed_forward_length") == (64 if case == "qwen2_moe" else None)

    tensors = {t.name: t for t in reader.tensors}
    allowed = _names_gguf_py_lists(arch)
    for name in tensors:  # every name written is one gguf-py lists for this architecture
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rpartition(".")[0]) in allowed, name
    layers = 3 if case == "qwen3_moe" else 2
    for layer in range(layers):
        for kind in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type.name == "Q4_0" and int(t.shape[2]) == 8  # ne = [columns, rows, experts]
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].tensor_type.name in ("F32", "BF16")
        if case == "qwen2_moe":
            assert f"blk.{layer}.ffn_gate_inp_shexp.weight" in tensors and f"blk.{layer}.ffn_down_shexp.weight" in tensors
        if case in ("qwen3_moe", "olmoe"):
            assert tensors[f"blk.{layer}.attn_k_norm.weight"].shape[0] == (64 if case == "olmoe" else 16)

    # imported back: every expert's QTensor bit for bit, the router dense, the logits exact
    native, ckpt = NativeReader(q), read_checkpoint(path)
    assert ckpt.config["model_type"] == case
    experts = [m for m in ckpt.qtensors if ".experts." in m]
    assert len(experts) == layers * 8 * 3
    for module in experts:
        assert torch.equal(ckpt.qtensors[module].dequantize(), native.quantized(module).dequantize()), module
    assert "model.layers.0.mlp.gate.weight" in ckpt.dense and "model.layers.0.mlp.gate" not in ckpt.qtensors
    ids = torch.randint(0, 258, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(path)(ids), load_model(q)(ids))

    # and as an hf directory (float32): each expert's weights are the dequantized blocks
    convert(path, tmp_path / "hf", "hf", dtype="float32")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    for module in experts:
        assert torch.equal(hf[f"{module}.weight"], native.quantized(module).dequantize()), module
    load_model(tmp_path / "hf")  # the config.json the import wrote builds the same family


def test_moe_gguf_refuses_what_llama_cpp_runs_differently(tmp_path):
    cases = [
        ("qwen2_moe", dict(decoder_sparse_step=2), "layer 0 has a dense MLP"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "layer 1 has a dense MLP"),
        ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob false"),
        ("olmoe", dict(num_key_value_heads=2), "num_key_value_heads != num_attention_heads"),
    ]
    for i, (case, overrides, message) in enumerate(cases):
        src, _ = save_moe(case, tmp_path / f"src{i}", **{**LLAMA_CPP_SHAPES[case], **overrides})
        _add_tiny_tokenizer(src)
        with pytest.raises(LowbitError, match=message):
            convert(src, tmp_path / f"m{i}.gguf", "gguf", allow_requant=True)
        assert not (tmp_path / f"m{i}.gguf").exists()


def _set_metadata(path, key: str, value: int) -> None:
    """Overwrite one integer metadata value of a GGUF file in place."""
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    del reader


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.expert_count", 4, r"blk\.0\.ffn_gate_inp\.weight has shape \[8, 64\], the metadata implies \[4, 64\]"),
    ("qwen3moe.expert_feed_forward_length", 64, r"ffn_\w+_exps\.weight has shape .*the metadata implies"),
    ("qwen3moe.expert_used_count", 9, "expert_used_count 9 exceeds expert_count 8"),
])
def test_damaged_moe_gguf_is_one_line(tmp_path, exported, key, value, message):
    bad = tmp_path / "bad.gguf"
    shutil.copy(exported("qwen3_moe")[1], bad)
    _set_metadata(bad, key, value)
    with pytest.raises(LowbitError, match=message):
        read_checkpoint(bad)
    with pytest.raises(LowbitError, match=message):
        convert(bad, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()
