"""Tiny random Hugging Face checkpoints for runtime tests.

`hf_checkpoint(config)` builds the transformers model for a config, gives it weights large enough
that logits are O(1) (transformers' init makes them ~0, which would hide errors), saves it with
save_pretrained and returns (directory, hf_model). `tiny_llama_dir` / `tiny_gemma3_dir` are ready
session-wide checkpoints for tests that need any small model; `llama_config(**kw)` and
`gemma3_config(**kw)` make tiny transformers configs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

VOCAB = 256
_counter = itertools.count()


def _llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def _gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    kw = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def randomize_(model, seed: int = 0) -> None:
    """Weights ~N(0, 0.1) and norm scales near their neutral value (1, or 0 for Gemma's 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.add_(0.1 * noise.to(p.dtype))
            else:
                p.copy_(0.1 * noise)


def build_hf(config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize_(model)
    return model


@pytest.fixture
def llama_config():
    """Factory: a tiny transformers LlamaConfig, keyword overrides applied."""
    return _llama_config


@pytest.fixture
def gemma3_config():
    """Factory: a tiny transformers Gemma3TextConfig (window 8), keyword overrides applied."""
    return _gemma3_config


@pytest.fixture
def hf_checkpoint(tmp_path):
    def save(config, **save_kw):
        model = build_hf(config)
        path = tmp_path / f"hf{next(_counter)}"
        model.save_pretrained(path, **save_kw)
        return path, model

    return save


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    build_hf(_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3")
    build_hf(_gemma3_config()).save_pretrained(path)
    return path
