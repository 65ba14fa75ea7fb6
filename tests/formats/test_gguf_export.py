"""GGUF export: the gguf package reads lowbit's files and dequantizes them to the expected values;
the metadata llama.cpp needs is there; Q4_K follows llama.cpp's reference quantizer."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf.quants import dequantize

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.gguf_arch import permute_qk
from lowbit.formats.gguf_q4k import dequantize_q4_k, quantize_q4_k

DATA = Path(__file__).parents[1] / "data"

# keys llama.cpp's llama loader reads without a default (llama-model.cpp / llama-vocab.cpp)
REQUIRED_KEYS = [
    "general.architecture", "llama.context_length", "llama.embedding_length", "llama.block_count",
    "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
    "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
    "llama.vocab_size", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "general.quantization_version",
]


def _read(path):
    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def _values(t) -> np.ndarray:
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))


@pytest.mark.parametrize("label, gtype", [("int4-g32", "Q4_0"), ("int8-g32", "Q8_0"), ("mxfp4", "MXFP4"),
                                         ("int4-g64", "Q4_0"), ("int4-g128", "Q4_0"), ("int8-g64", "Q8_0")])
def test_gguf_package_dequantizes_exact_exports(make_native, add_tiny_tokenizer, tmp_path, label, gtype):
    src, qtensors = make_native(label)
    add_tiny_tokenizer(src)
    out = tmp_path / "m.gguf"
    assert convert(src, out, "gguf").exact
    reader, tensors = _read(out)
    assert reader.fields["general.architecture"].contents() == "llama"
    for module, qt in qtensors.items():
        layer, rest = module.split(".")[2], module.split(".", 3)[3]
        part = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}[rest]
        t = tensors[f"blk.{layer}.{part}.weight"]
        assert t.tensor_type.name == gtype
        want = qt.dequantize()
        if part in ("attn_q", "attn_k"):  # llama.cpp's interleaved rotary order
            want = permute_qk(want, 4 if part == "attn_q" else 2)
        assert np.array_equal(_values(t), want.numpy()), module
    assert tensors["token_embd.weight"].tensor_type.name == "F32"  # the fixture's dense dtype
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert "output.weight" not in tensors  # tied embeddings


def test_metadata_llama_cpp_needs(make_native, add_tiny_tokenizer, tmp_path):
    src, _ = make_native("int4-g32")
    add_tiny_tokenizer(src)
    convert(src, tmp_path / "m.gguf", "gguf")
    reader, _ = _read(tmp_path / "m.gguf")
    fields = reader.fields
    missing = [k for k in REQUIRED_KEYS if k not in fields]
    assert not missing
    assert fields["llama.rope.dimension_count"].contents() == 16 and fields["llama.attention.head_count_kv"].contents() == 2
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"  # digits split one by one, then GPT-2's regex
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 96 and tokens[1] == "<|im_start|>"
    assert fields["tokenizer.ggml.token_type"].contents()[:4] == [3, 3, 3, 1]  # control, control, control, normal
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1 and fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert fields["tokenizer.chat_template"].contents() == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    assert fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0


def test_q4_k_matches_llama_cpps_reference_quantizer():
    ref = np.load(DATA / "q4k_reference.npz")
    x, want = torch.from_numpy(ref["x"]), ref["blocks"]
    got = quantize_q4_k(x)
    same = (got.reshape(-1, 144) == want.reshape(-1, 144)).all(1)
    # bit-identical except where float32 summation order (or the C compiler's fused multiply-adds)
    # tips a rounding knife-edge; measured 62/64 identical blocks
    assert same.mean() >= 0.9
    ref_values = dequantize(want, gguf.GGMLQuantizationType.Q4_K)
    our_values = dequantize(got, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(our_values, dequantize_q4_k(got, tuple(x.shape)).numpy())
    err = lambda v: np.linalg.norm(v - ref["x"]) / np.linalg.norm(ref["x"])  # noqa: E731
    assert err(our_values) == pytest.approx(err(ref_values), rel=0.01)
    assert np.array_equal(our_values[5, :256], np.zeros(256, dtype=np.float32))  # the all-zero super-block


def test_requantized_gguf_reports_error_per_layer(make_native, add_tiny_tokenizer, tmp_path):
    src, qtensors = make_native("nf4")
    add_tiny_tokenizer(src)
    with pytest.raises(LowbitError, match="nf4 is not Q4_K"):
        convert(src, tmp_path / "m.gguf", "gguf")
    result = convert(src, tmp_path / "m.gguf", "gguf", allow_requant=True)
    _, tensors = _read(tmp_path / "m.gguf")
    kinds = {c.module: c.target for c in result.changes}
    assert kinds["model.layers.0.mlp.down_proj"] == "Q4_K"  # 256 inputs
    assert kinds["model.layers.0.mlp.up_proj"] == "Q4_0"  # 64 inputs: llama-quantize's fallback
    for change in result.changes:
        layer, rest = change.module.split(".")[2], change.module.rsplit(".", 1)[1]
        part = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[rest]
        got = torch.from_numpy(_values(tensors[f"blk.{layer}.{part}.weight"]))
        want = qtensors[change.module].dequantize()
        if part in ("attn_q", "attn_k"):
            want = permute_qk(want, 4 if part == "attn_q" else 2)
        measured = float((got.double() - want.double()).norm() / want.double().norm())
        assert change.rel_error == pytest.approx(measured, rel=1e-4)
        assert 0 < change.rel_error < 0.15


def test_gguf_type_bf16_is_exact_only_when_values_fit(make_native, tmp_path):
    src, _ = make_native("mxfp4")  # E2M1 × 2^e values are all bf16 numbers
    assert convert(src, tmp_path / "a.gguf", "gguf", gguf_type="bf16").exact
    src, _ = make_native("int4-g32")  # (q − 8) × fp16 scale needs up to 15 significant bits
    with pytest.raises(LowbitError, match="bf16"):
        convert(src, tmp_path / "b.gguf", "gguf", gguf_type="bf16")


@pytest.mark.demo
def test_smollm2_bf16_export_round_trips_with_llama_cpps_tokenizer(smollm2_dir, tmp_path):
    from lowbit.data.assets import smollm2_gguf
    from lowbit.formats.gguf_reader import open_gguf

    out = tmp_path / "smol.gguf"
    assert convert(smollm2_dir, out, "gguf").exact  # bf16 weights → BF16 blocks
    ours, original = open_gguf(out), open_gguf(smollm2_gguf())
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
                "llama.rope.dimension_count", "llama.context_length", "llama.attention.head_count_kv"):
        assert ours.get(key) == original.get(key), key
    # lowbit's GGUF reader and un-permutation (checked against transformers) give back the exact bf16 weights
    from safetensors import safe_open

    from lowbit.formats.gguf_arch import unpermute_qk

    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        for gguf_name, hf_name, heads in (("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),
                                          ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight", 3),
                                          ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight", 0)):
            assert ours.info(gguf_name).type_name == "BF16"
            got = ours.tensor(gguf_name)
            if heads:
                got = unpermute_qk(got, heads)
            assert torch.equal(got.bfloat16(), f.get_tensor(hf_name)), hf_name


def test_mixtral_experts_export_stacked_as_llama_cpp_reads_them(tmp_path):
    """A quantized Mixtral → GGUF: each kind of expert projection stacked into blk.L.ffn_*_exps
    [experts, rows, columns] holding every expert's exact Q4_0 blocks; the router as ffn_gate_inp;
    expert_count / expert_used_count set. (llama.cpp loaded SmolLM2-as-4-expert-Mixtral exported
    this way and its perplexity matched lowbit's within 0.12 %: docs/engine.md.)"""
    from lowbit.compress.pipeline import quantize_model
    from lowbit.formats.native import NativeReader
    from lowbit.quant.spec import parse_spec
    from tests.formats.conftest import _add_tiny_tokenizer
    from tests.runtime.moe_models import save_moe

    src, _ = save_moe("mixtral", tmp_path / "mixtral")
    _add_tiny_tokenizer(src)  # a vocabulary GGUF can carry (merges included)
    quantize_model(src, parse_spec("int4-g32"), out_dir=tmp_path / "q")
    assert convert(tmp_path / "q", tmp_path / "m.gguf", "gguf").exact
    reader, tensors = _read(tmp_path / "m.gguf")
    assert reader.fields["llama.expert_count"].contents() == 8
    assert reader.fields["llama.expert_used_count"].contents() == 2
    native = NativeReader(tmp_path / "q")
    for layer in range(2):
        for kind in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type.name == "Q4_0"
            stacked = _values(t)  # [experts, rows, columns]
            assert stacked.shape[0] == 8
            for e in range(8):
                want = native.quantized(f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj").dequantize()
                assert np.array_equal(stacked[e], want.numpy()), (layer, kind, e)
        assert f"blk.{layer}.ffn_gate_inp.weight" in tensors and f"blk.{layer}.ffn_gate.weight" not in tensors
