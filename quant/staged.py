"""True-sequential GPTQ inside one decoder layer, in a single forward pass over the samples.

A pre-norm decoder layer (Llama family, Gemma-3) reads four inputs, in order:
    site 1  input norm(h)                  → q_proj, k_proj, v_proj
    site 2  attention(q, k, v)             → o_proj
    site 3  pre-FFN norm(h + attn out)     → gate_proj, up_proj
    site 4  act(gate) * up                 → down_proj
The statistics of site n are gathered over all samples with the Linears of the sites before it
already quantized, then site n is quantized: every Linear is calibrated on what the quantized
model feeds it ("true sequential"), and each part of the layer is computed once — the attention
output and the MLP activations are kept between stages instead of recomputed. The two-pass
scheme (float pass for statistics, quantized pass to move on) costs a whole extra forward.

Attention runs through quant/causal_attention.py (a third faster than SDPA on CPU here), so the
stages no longer compute bit for bit what `propagate` computes: a resumed run replays its saved
layers with `replay_staged` (the same stages without statistics) and so reaches the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lowbit.quant.causal_attention import BlockCausalAttention
from lowbit.quant.calibrate import DEFAULT_BATCH_TOKENS, LayerwiseModel, _batches, _check_finite
from lowbit.quant.stats import InputStats, StatsAccumulator

SITES = (
    ("self_attn.q_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.o_proj", ("self_attn.o_proj",)),
    ("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.down_proj", ("mlp.down_proj",)),
)

# quantize(site, modules, stats) -> {local module name: float32 weight to compute with from now on}
QuantizeSite = Callable[[str, tuple[str, ...], InputStats], dict[str, torch.Tensor]]


def stageable(layer: nn.Module) -> bool:
    """Whether `layer` has the pre-norm attention + gated-MLP shape the stages assume."""
    try:
        for _, modules in SITES:
            for name in modules:
                if not isinstance(layer.get_submodule(name), nn.Linear):
                    return False
        layer.get_submodule("input_layernorm")
        layer.get_submodule("post_attention_layernorm")
    except AttributeError:
        return False
    return getattr(layer.self_attn, "fused_qkv", None) is None and getattr(layer.mlp, "fused_gate_up", None) is None


def _norms(layer: nn.Module):
    """(post-attention norm or None, pre-FFN norm, post-FFN norm or None) of a Llama or Gemma-3 layer."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma-3: sandwich norms
        return layer.post_attention_layernorm, layer.pre_feedforward_layernorm, getattr(layer, "post_feedforward_layernorm", None)
    return None, layer.post_attention_layernorm, None


def _swapped(module: nn.Module, name: str, replacement: nn.Module):
    class Swap:
        def __enter__(self):
            self.old = getattr(module, name)
            setattr(module, name, replacement)

        def __exit__(self, *exc):
            setattr(module, name, self.old)

    return Swap()


def run_staged(
    lm: LayerwiseModel,
    layer: nn.Module,
    index: int,
    hidden: torch.Tensor,
    quantize: QuantizeSite | None,
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    first_weight: float = 1.0,
) -> None:
    """Quantize the layer site by site (see the module docstring); `hidden` becomes its output.
    With quantize=None the layer (already quantized) only moves `hidden`, by the same arithmetic."""
    fwd = lm.forward_copy(layer)
    post_attn, pre_ffn, post_ffn = _norms(fwd)
    batches = list(_batches(hidden.shape[0], hidden.shape[1], batch_tokens))
    cos, sin, ctx = lm.rope(index, hidden.shape[1], hidden.dtype)
    attention_kernel = BlockCausalAttention()

    def stage(site: str, modules: tuple[str, ...], inputs: Callable[[int, int], torch.Tensor]) -> None:
        if quantize is None:
            for start, end in batches:
                inputs(start, end)
            return
        acc = None
        for start, end in batches:
            x = inputs(start, end)
            if acc is None:
                acc = StatsAccumulator(x.shape[-1], moments=False, first_weight=first_weight)  # GPTQ reads only H
            acc.add(x)
            if not acc.finite():  # the diagonal's K values: find the sample only when it is needed
                _check_finite(x, f"entering {lm.layer_prefix(index)}{site}", start)
        for name, weight in quantize(site, modules, acc.finish()).items():
            fwd.get_submodule(name).weight.data = weight.to(fwd.get_submodule(name).weight.dtype)

    with torch.inference_mode():
        # One scratch buffer holds, for each batch of samples, first the input norm's output and
        # the attention output side by side, then the pre-FFN norm's output, and last the MLP
        # activation (which needs the most room): each is read before the next one overwrites it,
        # so the norms are computed once (a norm is ~5% of a layer on CPU) and the layer's
        # activations take no more memory than the MLP activation alone.
        n_tokens, dim = hidden.shape[1], hidden.shape[2]
        attn_dim = fwd.self_attn.o_proj.in_features
        mlp_dim = fwd.mlp.down_proj.in_features
        width = max(mlp_dim, dim + attn_dim)
        scratch = torch.empty(hidden.shape[0] * n_tokens * width, dtype=hidden.dtype)

        def region(s, e, offset, size):
            base = s * n_tokens * width + offset * (e - s) * n_tokens
            return scratch[base : base + size * (e - s) * n_tokens].view(e - s, n_tokens, size)

        def input_norm(s, e):
            normed = region(s, e, 0, dim)
            normed.copy_(fwd.input_layernorm(hidden[s:e]))
            return normed

        stage(*SITES[0], input_norm)

        def attention(s, e):
            out = region(s, e, dim, attn_dim)
            with _swapped(fwd.self_attn, "o_proj", nn.Identity()):
                out.copy_(fwd.self_attn(region(s, e, 0, dim), cos, sin, ctx, attention_kernel))
            return out

        stage(*SITES[1], attention)

        def residual(s, e):
            a = fwd.self_attn.o_proj(region(s, e, dim, attn_dim))
            if post_attn is not None:
                a = post_attn(a)
            hidden[s:e] = hidden[s:e] + a
            normed = region(s, e, 0, dim)
            normed.copy_(pre_ffn(hidden[s:e]))
            return normed

        stage(*SITES[2], residual)

        mlp = fwd.mlp

        def activation(s, e):
            # GatedMLP's torch arithmetic, act(gate) * up (its reference path). The fused C row op
            # (kernels/cpu_rowops.py) agrees to the last bits only and at 8192 rows takes 17 ms
            # against torch's 5 ms, so calibration keeps torch.
            x = region(s, e, 0, dim)
            act = mlp.act(mlp.gate_proj(x)).mul_(mlp.up_proj(x))  # x is read before it is overwritten
            out = region(s, e, 0, mlp_dim)
            out.copy_(act)
            return out

        stage(*SITES[3], activation)

        for s, e in batches:
            m = fwd.mlp.down_proj(region(s, e, 0, mlp_dim))
            if post_ffn is not None:
                m = post_ffn(m)
            out = hidden[s:e] + m
            # One float32 sum is finite when every element is (the exact check runs only if not).
            if not torch.isfinite(out.sum(dtype=torch.float32)):
                _check_finite(out, f"after layer {index}", s)
            hidden[s:e] = out


def replay_staged(lm: LayerwiseModel, layer: nn.Module, index: int, hidden: torch.Tensor, *,
                  batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
    """hidden ← layer(hidden) for a layer that `run_staged` quantized earlier (its weights put back),
    computed exactly as `run_staged` moved `hidden`, so a resumed run reaches the same bytes."""
    run_staged(lm, layer, index, hidden, None, batch_tokens=batch_tokens)
