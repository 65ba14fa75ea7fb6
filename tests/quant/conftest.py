"""Tiny random checkpoints for the calibration / GPTQ / AWQ tests.

`tiny_model(kind, vocab=256)` writes a Llama- or Gemma-3-shaped transformers checkpoint with
weights ~N(0, 0.1) (norm scales near neutral) and returns its directory. `with_tokenizer=True`
copies SmolLM2's tokenizer beside it (vocab 49152), for tests that draw windows from text.
"""

from __future__ import annotations

import shutil

import pytest
import torch


def _config(kind: str, vocab: int):
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=512,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=512,
                            sliding_window=8, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.add_(0.1 * noise.to(p.dtype))
            else:
                p.copy_(0.1 * noise)


@pytest.fixture
def tiny_model(tmp_path):
    def make(kind: str = "llama", vocab: int = 256, seed: int = 0, with_tokenizer: bool = False):
        from transformers import AutoModelForCausalLM

        if with_tokenizer:
            from lowbit.paths import model_asset_path

            source = model_asset_path("smollm2-135m")
            if not (source / "tokenizer.json").exists():
                pytest.skip("demo tokenizer missing (run `lowbit assets`)")
            vocab = 49152
        model = AutoModelForCausalLM.from_config(_config(kind, vocab), attn_implementation="eager").eval()
        _randomize(model, seed)
        path = tmp_path / f"{kind}-{seed}"
        model.save_pretrained(path)
        if with_tokenizer:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(source / name, path / name)
        return path

    return make
