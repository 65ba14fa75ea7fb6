"""Fixtures for the conversion tests: tiny Llama checkpoints in lowbit's native format."""

from __future__ import annotations

import json

import pytest
import torch

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu", torch_dtype="float32",
    attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
)
PROJECTIONS = {
    "self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (256, 64), "mlp.up_proj": (256, 64), "mlp.down_proj": (64, 256),
}


def tiny_weights(seed: int = 0, k_scale: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(projection weights by module, dense tensors) of a random 2-layer Llama."""
    g = torch.Generator().manual_seed(seed)
    dense = {
        "model.embed_tokens.weight": torch.randn(96, 64, generator=g) * 0.5,
        "model.norm.weight": 1 + 0.1 * torch.randn(64, generator=g),
    }
    weights = {}
    for i in range(2):
        for name, shape in PROJECTIONS.items():
            weights[f"model.layers.{i}.{name}"] = torch.randn(*shape, generator=g) * 0.05
        dense[f"model.layers.{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(64, generator=g)
        dense[f"model.layers.{i}.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(64, generator=g)
    return weights, dense


TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _add_tiny_tokenizer(directory) -> None:
    """A 96-token byte-level BPE vocabulary (92 byte symbols, one merge, 3 specials) like SmolLM2's."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())[:92]
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{s: i + 3 for i, s in enumerate(symbols)}}
    vocab[symbols[0] + symbols[1]] = 95
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(symbols[0], symbols[1])]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": TINY_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def add_tiny_tokenizer():
    """add_tiny_tokenizer(directory): write a 96-token tokenizer.json + tokenizer_config.json there."""
    return _add_tiny_tokenizer


@pytest.fixture
def make_native(tmp_path):
    """make_native(label) → (directory, {module: QTensor}) of a tiny native checkpoint quantized with RTN."""
    from lowbit.formats.native import save_native
    from lowbit.quant.rtn import quantize_rtn

    def make(label: str, name: str | None = None, config: dict | None = None, weights=None):
        w, dense = tiny_weights()
        if weights is not None:
            w = weights
        qtensors = {m: quantize_rtn(t, label) for m, t in w.items()}
        out = tmp_path / (name or f"native-{label}")
        save_native(out, qtensors, dense, config={**TINY_CONFIG, **(config or {})})
        return out, qtensors

    return make
