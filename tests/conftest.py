"""Shared fixtures. Tests marked `demo` need `lowbit assets` to have run (.ci/run does it)."""

from __future__ import annotations

import os

import pytest
import torch

from lowbit.paths import data_asset_path, model_asset_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _float32_dense_activations(monkeypatch):
    """bf16 dense Linears keep float32 x in tests unless a test asks otherwise: most compare a bf16
    checkpoint against a float32 reference (transformers, dequantize-then-matmul) bit for bit or
    at tight tolerances, while the default on an AVX512-BF16 CPU rounds x to bf16. The bf16 path
    has its own tests (they set LOWBIT_DENSE_ACTIVATIONS=bf16 or the setting), and the default
    itself is tested with the variable removed (tests/kernels/test_dispatch.py)."""
    if "LOWBIT_DENSE_ACTIVATIONS" not in os.environ:
        monkeypatch.setenv("LOWBIT_DENSE_ACTIVATIONS", "f32")


@pytest.fixture(autouse=True)
def _float32_int8_activations(monkeypatch):
    """8-bit integer weights keep float32 x in tests unless a test asks otherwise, for the same
    reason (their references are float64/float32 dequantize-then-matmul at tight tolerances); the
    int8-activation path (cpu-int8dot) has its own tests, and the default is tested with the
    variable removed (tests/kernels/test_dispatch.py)."""
    if "LOWBIT_INT8_ACTIVATIONS" not in os.environ:
        monkeypatch.setenv("LOWBIT_INT8_ACTIVATIONS", "f32")


def _require(path):
    if not path.exists():
        # In CI the assets are installed first, so a missing one is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail(f"demo asset missing in CI: {path}")
        pytest.skip(f"demo asset missing: {path} (run `lowbit assets`)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    return _require(model_asset_path("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma3_dir():
    return _require(model_asset_path("gemma3-270m"))


@pytest.fixture(scope="session")
def wiki_eval_path():
    return _require(data_asset_path("wiki-eval"))


def _byte_tokenizer(directory, add_bos: bool = True, chars: list[str] | None = None) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE without merges, 256 <s>, 257 </s>; ids 0-255
    are `chars` in order (default: the byte-level alphabet sorted; the byte → character map makes
    id b byte b)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(pre_tokenizers.ByteLevel.alphabet()) if chars is None else chars
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab.update({"<s>": 256, "</s>": 257})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def tiny_float_model(tmp_path):
    """Factory: a tiny random float checkpoint (transformers' save_pretrained, byte tokenizer, vocab 258)
    saved under tmp_path. make(family="llama"|"gemma3", tie=False, hidden=64, intermediate=128,
    layers=2, dtype=torch.bfloat16, name=...) -> directory."""

    def make(family="llama", tie=False, hidden=64, intermediate=128, layers=2, dtype=torch.bfloat16, name=None):
        from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

        common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=258, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=tie)
        if family == "llama":
            config = LlamaConfig(**common)
        else:
            config = Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                      layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2))
        gen = torch.Generator().manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                if "norm" in pname:
                    p.add_(0.1 * noise)  # around the neutral scale (1 for Llama, 0 for Gemma's 1 + w)
                else:
                    p.copy_(0.15 * noise)
        model = model.to(dtype)
        directory = tmp_path / (name or f"{family}-{'tied' if tie else 'untied'}-{hidden}")
        model.save_pretrained(directory)
        _byte_tokenizer(directory)
        return directory

    return make
