"""Gemma-3 text model.

Differs from Llama in: (1 + w) RMSNorms, norms after attention and MLP as well as before, q/k
RMSNorm, GeGLU, embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar,
sliding-window layers with their own RoPE base, and optional logit softcapping.
"""

from __future__ import annotations

from torch import nn

from lowbit.runtime.attention import SelfAttention
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import GatedMLP, RMSNorm
from lowbit.runtime.models.base import CausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config, layer, norm_unit_offset=True)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(self, x, cos, sin, ctx, cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_unit_offset = True
    scale_embeddings = True
