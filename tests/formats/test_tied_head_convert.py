"""A quantized head tied to the embeddings (`quantize --quantize-head` on a tied model) converts to
every target and runs to the native checkpoint's logits: GGUF keeps the one quantized matrix as
token_embd (llama.cpp's tied layout, no output.weight); the other targets get it dequantized into
the embedding table their loaders read dense."""

from __future__ import annotations

import gguf
import pytest
import torch

from lowbit.compress.pipeline import quantize_model
from lowbit.formats.convert import convert
from lowbit.runtime.loader import load_model

IDS = torch.tensor([[256, 5, 77, 130, 9, 200, 41, 41, 3, 250, 17, 88]])


@pytest.fixture(scope="module")
def tied_quantized(tmp_path_factory):
    from tests.conftest import _byte_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("tied_head")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=258, max_position_embeddings=512,
                         bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root / "src")
    _byte_tokenizer(root / "src")
    quantize_model(root / "src", "int4-g32", out_dir=root / "q", quantize_head=True)
    return root


@pytest.mark.parametrize("target", ["gguf", "compressed-tensors", "gptq", "awq", "hf"])
def test_tied_quantized_head_converts_and_runs_the_same(target, tied_quantized, monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")
    out = tied_quantized / (f"out-{target}" + (".gguf" if target == "gguf" else ""))
    result = convert(tied_quantized / "q", out, target)
    # hf holds the dequantized values in bf16 (its default --dtype): int4 code x scale is not always
    # a bf16 number, and the result says so rather than calling it exact
    assert result.exact == (target != "hf")
    assert target != "hf" or result.rounded.tensors > 0
    if target == "gguf":
        tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
        assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
        assert "output.weight" not in tensors
    else:
        assert any("dequantized into the embedding table" in note for note in result.notes)
    with torch.no_grad():
        want = load_model(tied_quantized / "q")(IDS)
        got = load_model(out)(IDS)
    tol = 2e-2 if target == "hf" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
