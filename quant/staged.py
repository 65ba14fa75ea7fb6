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
                acc = StatsAccumulator(x.shape[-1], moments=False)  # GPTQ reads only H
            acc.add(x)
        if not acc.finite():  # only now look for the sample, so the common case pays one check
            for start, end in batches:
                _check_finite(inputs(start, end), f"entering {lm.layer_prefix(index)}{site}", start)
        for name, weight in quantize(site, modules, acc.finish()).items():
            fwd.get_submodule(name).weight.data = weight.to(fwd.get_submodule(name).weight.dtype)

    with torch.inference_mode():
        # Each norm's output is kept for the stage after the one that measured it: a norm costs a
        # tenth of the layer on CPU, and recomputing two of them took ~5 s of a 128x512 run.
        normed = torch.empty_like(hidden)

        def input_norm(s, e):
            normed[s:e] = fwd.input_layernorm(hidden[s:e])
            return normed[s:e]

        stage(*SITES[0], input_norm)

        attn_out = torch.empty(*hidden.shape[:2], fwd.self_attn.o_proj.in_features, dtype=hidden.dtype)

        def attention(s, e):
            with _swapped(fwd.self_attn, "o_proj", nn.Identity()):
                attn_out[s:e] = fwd.self_attn(normed[s:e], cos, sin, ctx, attention_kernel)
            return attn_out[s:e]

        stage(*SITES[1], attention)

        def residual(s, e):
            a = fwd.self_attn.o_proj(attn_out[s:e])
            if post_attn is not None:
                a = post_attn(a)
            hidden[s:e] = hidden[s:e] + a
            normed[s:e] = pre_ffn(hidden[s:e])
            return normed[s:e]

        stage(*SITES[2], residual)
        del attn_out

        mlp_act = torch.empty(*hidden.shape[:2], fwd.mlp.down_proj.in_features, dtype=hidden.dtype)

        mlp = fwd.mlp

        def activation(s, e):
            # GatedMLP's torch arithmetic, act(gate) * up: the same bits as its fused C row op
            # (kernels/cpu_rowops.py), which at 8192 rows takes 17 ms against torch's 5 ms here.
            x = normed[s:e]
            mlp_act[s:e] = mlp.act(mlp.gate_proj(x)).mul_(mlp.up_proj(x))
            return mlp_act[s:e]

        stage(*SITES[3], activation)
        del normed

        for s, e in batches:
            m = fwd.mlp.down_proj(mlp_act[s:e])
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
