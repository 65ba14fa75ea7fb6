"""Parameter counts from config.json alone, against published sizes and transformers' own models."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.plan.config_source import bundled_names, load_config
from lowbit.plan.model_shape import shape_from_config
from lowbit.plan.report import load_shape

# Sizes the model cards publish (total; Mixtral also active per token).
PUBLISHED = {
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.2e9,
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.7e9,
    "smollm2-135m": 134.5e6,
    "gemma3-270m": 268e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_totals_match_published_sizes(name):
    shape, _ = load_shape(name)
    assert shape.total_params == pytest.approx(PUBLISHED[name], rel=0.01)


def test_every_bundled_config_is_checked():
    assert set(bundled_names()) == set(PUBLISHED)


def test_llama3_8b_exact_count():
    # embeddings 2 × 128256 × 4096, 32 × (attention 41,943,040 + MLP 176,160,768 + 2 norms), final norm
    shape, _ = load_shape("llama-3-8b")
    per_layer = (4096 * 4096 * 2 + 1024 * 4096 * 2) + 3 * 4096 * 14336 + 2 * 4096
    assert shape.total_params == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248


def test_mixtral_total_and_active():
    shape, _ = load_shape("mixtral-8x7b")
    assert shape.total_params == pytest.approx(46.7e9, rel=0.01)
    assert shape.active_params == pytest.approx(12.9e9, rel=0.01)
    expert = 3 * 4096 * 14336
    assert shape.total_params - shape.active_params == 32 * 6 * expert  # 6 of 8 experts idle per token


def test_gemma3_270m_windows():
    shape, _ = load_shape("gemma3-270m")
    assert shape.layer_windows.count(None) == 3 and shape.layer_windows.count(512) == 15
    assert shape.layer_windows[5] is None and shape.layer_windows[0] == 512
    assert shape.tied_embeddings and shape.lm_head_params == 0


# Tiny configs of each family: transformers builds the model on the meta device and counts.
def _tiny(kind: str):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama-bias":
        return tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=32, tie_word_embeddings=False)
    if kind == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=32, sliding_window=16)
    if kind == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
        )
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=16)
    raise AssertionError(kind)


FAMILIES = ["llama", "llama-bias", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_counts_match_transformers(kind):
    from transformers import AutoModelForCausalLM

    config = _tiny(kind)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    shape = shape_from_config(json.loads(config.to_json_string()), kind)
    assert shape.total_params == expected


def test_nested_text_config_is_read():
    outer = {"model_type": "gemma3", "tie_word_embeddings": True, "text_config": json.loads(json.dumps(load_config("gemma3-270m")[0]))}
    assert shape_from_config(outer).total_params == load_shape("gemma3-270m")[0].total_params


def test_missing_key_is_one_line_error():
    with pytest.raises(LowbitError, match="no 'hidden_size'"):
        shape_from_config({"model_type": "llama", "num_hidden_layers": 2})


def test_mla_models_are_refused():
    with pytest.raises(LowbitError, match="latent attention"):
        shape_from_config({"model_type": "deepseek_v3", "hidden_size": 8})


@pytest.mark.demo
def test_demo_checkpoints_match_their_safetensors(smollm2_dir, gemma3_dir):
    from safetensors import safe_open

    for path in (smollm2_dir, gemma3_dir):
        total = 0
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    total += torch.Size(f.get_slice(key).get_shape()).numel()
        shape = shape_from_config(json.loads((path / "config.json").read_text()), path.name)
        assert shape.total_params == total
