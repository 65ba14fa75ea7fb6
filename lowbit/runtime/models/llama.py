"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2, and the MoE
members Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (their sparse MLP is models/moe.py).

Pre-norm blocks: x + attn(norm(x)), then x + SwiGLU(norm(x)). Differences between members are
flags on ModelConfig (biases, q/k norm, windows, RoPE scaling), not separate classes.
"""

from __future__ import annotations

from torch import nn

from lowbit.kernels import cpu_rowops
from lowbit.runtime.attention import SelfAttention
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import GatedMLP, RMSNorm, add_pending, add_pending_and_norm, rowops_norms
from lowbit.runtime.models.base import CausalLM
from lowbit.runtime.models.moe import SparseMoE


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        moe = config.moe
        if moe is not None and moe.sparse_layers[layer]:
            self.mlp = SparseMoE(config)  # Mixtral, Qwen2/3-MoE, OLMoE (dense layers of Qwen-MoE below)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx, cache):
        a = self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        norm = self.post_attention_layernorm
        if rowops_norms(x, norm):
            # residual add and the MLP's norm in one C call; the new x is ours to add into
            x, h = cpu_rowops.add_rmsnorm(x, a, norm.weight, norm.eps, norm.unit_offset)
            return x.add_(self.mlp(h))
        x = x + a
        return x + self.mlp(norm(x))

    def forward_deferred(self, x, pending, cos, sin, ctx, cache):
        """forward(x + r) for pending = (r, None), leaving the last residual add to the caller:
        returns (x', pending') whose sum is the layer's output. x is a tensor the model made and is
        updated in place; both adds ride in the C norm calls (DecoderModel's CPU inference path)."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        r_norm = pending[1] if pending is not None else None
        if not rowops_norms(x, norm_in, norm_post, *(() if r_norm is None else (r_norm,))):
            return self.forward(add_pending(x, pending), cos, sin, ctx, cache), None
        x, h = add_pending_and_norm(x, pending, norm_in)
        a = self.self_attn(h, cos, sin, ctx, cache)
        x, h = cpu_rowops.add_rmsnorm(x, a, norm_post.weight, norm_post.eps, norm_post.unit_offset, inplace=True)
        return x, (self.mlp(h), None)


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
