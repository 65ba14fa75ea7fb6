"""CausalLM: the decoder-only skeleton every family shares (embed, layers, final norm, lm_head).

A family supplies its decoder layer class and a few switches (Gemma's norm offset and embedding
scale). Module names are Hugging Face's, so `state_dict()` keys equal a safetensors checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from lowbit.kernels import cpu_rowops
from lowbit.runtime.attention import AttentionCache, AttentionContext, KVCache
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.layers import RMSNorm, Rotary, add_pending, rowops_norms
from lowbit.runtime.linear import make_linear


class DecoderModel(nn.Module):
    """`model.*` of a HF checkpoint: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module], norm_unit_offset: bool, scale_embeddings: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_unit_offset)
        self.scale_embeddings = scale_embeddings
        self.hidden_size = config.hidden_size
        # One Rotary per distinct RoPE setting; layers index into it.
        ropes = [config.layer_rope(i) for i in range(config.num_hidden_layers)]
        distinct = []
        for rope in ropes:
            if rope not in distinct:
                distinct.append(rope)
        self.rotaries = [Rotary(rope, config.head_dim) for rope in distinct]
        self.layer_rotary = [distinct.index(rope) for rope in ropes]

    def forward(self, input_ids, positions, max_position: int, cache: AttentionCache | None) -> torch.Tensor:
        # The engine's step is one flattened sequence over a `flat_rows` cache: the layers then work
        # on rows [T, hidden], which spares a select/unsqueeze and two reshapes per matmul.
        rows = input_ids.shape[0] == 1 and cache is not None and cache.flat_rows
        h = self.embed_tokens(input_ids[0] if rows else input_ids)
        if h.dtype != self.norm.weight.dtype:
            h = h.to(self.norm.weight.dtype)  # a table kept in bf16 for the tied head (kernels/cpu_f32.py): exact
        if self.scale_embeddings:
            # Gemma scales by sqrt(hidden) rounded to the model dtype, as its checkpoints were trained.
            h = h * torch.tensor(self.hidden_size**0.5, dtype=h.dtype).item()
        ctx = AttentionContext(cache.length if cache is not None else 0, input_ids.shape[1], h.device)
        rotations = [r.cos_sin(positions, max_position, h.dtype) for r in self.rotaries]
        if self._defer_residuals(h):
            # Each layer leaves its last residual add to the next layer's input norm (one C call
            # for add + norm, into h in place); the final norm takes the last one.
            pending = None
            for layer, which in zip(self.layers, self.layer_rotary):
                cos, sin = rotations[which]
                h, pending = layer.forward_deferred(h, pending, cos, sin, ctx, cache)
            h = self._final_norm(h, pending)
        else:
            for layer, which in zip(self.layers, self.layer_rotary):
                cos, sin = rotations[which]
                h = layer(h, cos, sin, ctx, cache)
            h = self.norm(h)
        return h[None] if rows else h

    def _defer_residuals(self, h: torch.Tensor) -> bool:
        """CPU inference with the C row ops, layers that can defer, and no forward hooks that calling
        forward_deferred would skip."""
        if not self.layers or not hasattr(self.layers[0], "forward_deferred") or not cpu_rowops.usable(h, self.norm.weight):
            return False
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        return not any(layer._forward_hooks or layer._forward_pre_hooks for layer in self.layers)

    def _final_norm(self, h: torch.Tensor, pending) -> torch.Tensor:
        if pending is None:
            return self.norm(h)
        r, r_norm = pending
        if not rowops_norms(h, self.norm, *(() if r_norm is None else (r_norm,))):
            return self.norm(add_pending(h, pending))
        norm = self.norm
        return cpu_rowops.add_rmsnorm(h, r, norm.weight, norm.eps, norm.unit_offset,
                                      r_weight=None if r_norm is None else r_norm.weight, inplace=True)[1]


class CausalLM(nn.Module):
    """forward(input_ids[B, T], positions=None, cache=None, logits_start=0) -> logits[B, T - logits_start, V]."""

    layer_cls: type[nn.Module]
    norm_unit_offset = False
    scale_embeddings = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_cls, self.norm_unit_offset, self.scale_embeddings)
        self.lm_head = make_linear(config.hidden_size, config.vocab_size, False)

    def tie_weights(self) -> None:
        if isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight
        # else a quantized tied head: embed_tokens already reads its rows from lm_head's QTensor

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        weight = self.model.norm.weight  # the compute dtype (the embedding table may be kept in bf16)
        return KVCache(self.config, batch, max_len or self.config.max_position_embeddings, weight.dtype, weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        logits_start: int = 0,
    ) -> torch.Tensor:
        t = input_ids.shape[1]
        past = 0
        if cache is not None:
            cache.check_room(t)
            past = cache.length
        if positions is None:
            positions = torch.arange(past, past + t, device=input_ids.device)
            max_position = past + t - 1
        else:
            max_position = int(positions.max())
        h = self.model(input_ids, positions, max_position, cache)
        if cache is not None:
            cache.advance(t)
        if logits_start:
            h = h[:, logits_start:]
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
