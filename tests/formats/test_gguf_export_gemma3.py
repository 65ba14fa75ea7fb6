"""Gemma-3 GGUF export: llama.cpp's gemma3 layout (norms stored as 1 + w, sliding layers, the
local rotary base), its SentencePiece vocabulary rebuilt from tokenizer.json, and what llama.cpp
would run differently refused. The real model is checked against the package's own GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowbit.errors import LowbitError
from lowbit.formats.convert import convert
from lowbit.formats.gguf_export_gemma3 import check_llama_cpp_gemma3
from lowbit.formats.gguf_import import convert_gguf
from lowbit.formats.gguf_reader import open_gguf
from lowbit.formats.gguf_tokenizer import build_tokenizer
from tests.formats.test_gguf_tiny import write_tiny

TEXTS = ["ab a abc", " a  b\tc", "cab ▁ab é 🙂", "<bos>ab"]


@pytest.fixture()
def tiny_gemma3(tmp_path):
    write_tiny(tmp_path / "src.gguf", arch="gemma3")
    return tmp_path / "src.gguf", convert_gguf(tmp_path / "src.gguf", tmp_path / "hf", dtype="bf16")


def test_tiny_gemma3_round_trips_through_gguf(tiny_gemma3, tmp_path):
    source, hf = tiny_gemma3
    out = tmp_path / "back.gguf"
    assert convert(hf, out, "gguf").exact
    ours, original = open_gguf(out), open_gguf(source)
    assert ours.architecture == "gemma3"
    for key in ("gemma3.attention.sliding_window", "gemma3.attention.key_length", "gemma3.attention.head_count_kv",
                "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_space_prefix"):
        assert ours.get(key) == original.get(key), key
    # tokenizer.json keeps no UNKNOWN type: its <unk> is a special (CONTROL) token, as in the real Gemma file
    unknown = 2
    assert ours.get("tokenizer.ggml.token_type") == [3 if t == unknown else t for t in original.get("tokenizer.ggml.token_type")]
    assert ours.get("gemma3.rope.freq_base_swa") == 10000.0
    weights = load_file(str(hf / "model.safetensors"))
    # Gemma multiplies by (1 + w): llama.cpp's file holds 1 + w, in float32
    for name, hf_name in (("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
                          ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
                          ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                          ("output_norm.weight", "model.norm.weight")):
        assert torch.equal(ours.tensor(name), weights[hf_name].float() + 1), name
    assert torch.equal(ours.tensor("blk.1.attn_q.weight").bfloat16(), weights["model.layers.1.self_attn.q_proj.weight"])
    # the scores written from the merge list tokenize as the original scores do (byte fallback included)
    theirs, mine = build_tokenizer(original), build_tokenizer(ours)
    for text in TEXTS:
        assert mine.encode(text).ids == theirs.encode(text).ids, text
    # and lowbit's import of the export gives the same model back
    again = convert_gguf(out, tmp_path / "again", dtype="bf16")
    assert json.loads((again / "config.json").read_text())["layer_types"] == json.loads((hf / "config.json").read_text())["layer_types"]
    for name, value in load_file(str(again / "model.safetensors")).items():
        assert torch.equal(value, weights[name]), name


def test_unusual_sliding_layers_are_written_per_layer(tiny_gemma3, tmp_path):
    _, hf = tiny_gemma3
    config = json.loads((hf / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"]
    (hf / "config.json").write_text(json.dumps(config))
    convert(hf, tmp_path / "m.gguf", "gguf")
    assert open_gguf(tmp_path / "m.gguf").get("gemma3.attention.sliding_window_pattern") == [False, True]
    again = convert_gguf(tmp_path / "m.gguf", tmp_path / "again", dtype="bf16")
    assert json.loads((again / "config.json").read_text())["layer_types"] == config["layer_types"]


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("query_pre_attn_scalar", 144, "query_pre_attn_scalar 144"),
    ("hidden_activation", "gelu", "hidden_activation gelu"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_what_llama_cpp_runs_differently_is_refused(tiny_gemma3, tmp_path, field, value, message):
    _, hf = tiny_gemma3
    config = json.loads((hf / "config.json").read_text())
    config[field] = value
    with pytest.raises(LowbitError, match=message):
        check_llama_cpp_gemma3(config)
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(LowbitError, match=message):
        convert(hf, tmp_path / "m.gguf", "gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.demo
def test_gemma3_270m_export_tokenizes_as_llama_cpp(gemma3_dir, tmp_path):
    from tests.formats.test_gguf_real import FIXTURE

    out = tmp_path / "g.gguf"
    assert convert(gemma3_dir, out, "gguf").exact  # bf16 weights → BF16 blocks
    ours = open_gguf(out)  # (the package's own GGUF is not opened here: reading its vocabulary takes ~20 s)
    # the package file's values (gemma-3-270m-q4_k_m.gguf)
    assert {key: ours.get(f"gemma3.{key}") for key in ("context_length", "attention.sliding_window", "attention.key_length",
                                                        "rope.freq_base", "attention.head_count_kv")} == {
        "context_length": 32768, "attention.sliding_window": 512, "attention.key_length": 256,
        "rope.freq_base": 1e6, "attention.head_count_kv": 1}
    assert ours.get("tokenizer.ggml.model") == "llama" and ours.get("tokenizer.ggml.add_space_prefix") is False
    weights = load_file(str(gemma3_dir / "model.safetensors"))
    for name, hf_name in (("blk.5.attn_q_norm.weight", "model.layers.5.self_attn.q_norm.weight"),
                          ("blk.17.post_ffw_norm.weight", "model.layers.17.post_feedforward_layernorm.weight")):
        assert torch.equal(ours.tensor(name), weights[hf_name].float() + 1), name
    tokenizer = build_tokenizer(ours)
    for text, expected in zip(FIXTURE["texts"], FIXTURE["ids"]["gemma3"], strict=True):
        assert tokenizer.encode(text).ids == expected, text[:40]  # llama.cpp's llama-tokenize ids
