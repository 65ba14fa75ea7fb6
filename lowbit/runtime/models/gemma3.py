"""Gemma-3 text model.

Differs from Llama in: (1 + w) RMSNorms, norms after attention and MLP as well as before, q/k
RMSNorm, GeGLU, embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar,
sliding-window layers with their own RoPE base, and optional logit softcapping.
"""

from __future__ import annotations

from torch import nn

from lowbit.kernels import cpu_rowops
from lowbit.runtime.attention import SelfAttention
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import GatedMLP, RMSNorm, add_pending, add_pending_and_norm, rowops_norms
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
        a = self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        post_attn, pre_ffn, post_ffn = self.post_attention_layernorm, self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if rowops_norms(x, post_attn, pre_ffn, post_ffn):
            # x + norm(a) and the MLP's pre-norm in one C call, then x + norm(m) into the new x
            x, h = cpu_rowops.add_rmsnorm(x, a, pre_ffn.weight, pre_ffn.eps, pre_ffn.unit_offset, r_weight=post_attn.weight)
            x, _ = cpu_rowops.add_rmsnorm(x, self.mlp(h), None, post_ffn.eps, post_ffn.unit_offset, r_weight=post_ffn.weight,
                                        inplace=True)
            return x
        x = x + post_attn(a)
        return x + post_ffn(self.mlp(pre_ffn(x)))

    def forward_deferred(self, x, pending, cos, sin, ctx, cache):
        """forward(x + norm(r)) for pending = (r, norm), leaving the last residual add (of the
        post-FFN-normed MLP output) to the caller; see LlamaDecoderLayer.forward_deferred."""
        norm_in = self.input_layernorm
        post_attn, pre_ffn, post_ffn = self.post_attention_layernorm, self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        r_norm = pending[1] if pending is not None else None
        if not rowops_norms(x, norm_in, post_attn, pre_ffn, post_ffn, *(() if r_norm is None else (r_norm,))):
            return self.forward(add_pending(x, pending), cos, sin, ctx, cache), None
        x, h = add_pending_and_norm(x, pending, norm_in)
        a = self.self_attn(h, cos, sin, ctx, cache)
        x, h = cpu_rowops.add_rmsnorm(x, a, pre_ffn.weight, pre_ffn.eps, pre_ffn.unit_offset, r_weight=post_attn.weight,
                                      inplace=True)
        return x, (self.mlp(h), post_ffn)


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_unit_offset = True
    scale_embeddings = True
