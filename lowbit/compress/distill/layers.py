"""Running a CausalLM one decoder layer at a time (the block-wise stage) and its head alone."""

from __future__ import annotations

import torch

from lowbit.runtime.attention import AttentionContext


def embed(model, ids: torch.Tensor) -> torch.Tensor:
    """The hidden states entering layer 0, as DecoderModel.forward makes them (float32 here)."""
    dm = model.model
    h = dm.embed_tokens(ids).float()
    if dm.scale_embeddings:
        h = h * torch.tensor(dm.hidden_size**0.5, dtype=h.dtype).item()
    return h


def run_layer(model, index: int, x: torch.Tensor) -> torch.Tensor:
    """Decoder layer `index` on windows x [B, T, D] that start at position 0."""
    dm = model.model
    t = x.shape[1]
    cos, sin = dm.rotaries[dm.layer_rotary[index]].cos_sin(torch.arange(t, device=x.device), t - 1, x.dtype)
    return dm.layers[index](x, cos, sin, AttentionContext(0, t, x.device), None)


def head_logits(model, h: torch.Tensor) -> torch.Tensor:
    """Logits from the last layer's output: final norm, lm_head, Gemma's soft cap."""
    return head_only(model, model.model.norm(h))


def head_only(model, x: torch.Tensor) -> torch.Tensor:
    """Logits from a final-normed hidden state: lm_head, Gemma's soft cap."""
    logits = model.lm_head(x)
    cap = model.config.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def propagate(model, index: int, x: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Layer `index` over all windows, `batch` windows at a time, into a new tensor."""
    out = torch.empty_like(x)
    for lo in range(0, x.shape[0], batch):
        out[lo:lo + batch] = run_layer(model, index, x[lo:lo + batch])
    return out
