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

Attention runs through kernels/causal_attention.py (blocks of queries, or SDPA on AMX cores), so the
stages no longer compute bit for bit what `propagate` computes: a resumed run replays its saved
layers with `replay_staged` (the same stages without statistics) and so reaches the same bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.kernels.causal_attention import BlockCausalAttention
from lowbit.compress.calibrate import DEFAULT_BATCH_TOKENS, LayerwiseModel, _batches, _check_finite
from lowbit.compress.stats import InputStats, ShiftAccumulator, StatsAccumulator

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


class _Stream:
    """One stream of hidden states through the layer's stages (see `run_staged`), with its own
    scratch buffer: one for the model being quantized, one for the float model it is matched to."""

    def __init__(self, fwd: nn.Module, hidden: torch.Tensor, rope, attention_kernel):
        self.fwd, self.hidden, self.rope, self.kernel = fwd, hidden, rope, attention_kernel
        self.post_attn, self.pre_ffn, self.post_ffn = _norms(fwd)
        # One scratch buffer holds, for each batch of samples, first the input norm's output and
        # the attention output side by side, then the pre-FFN norm's output, and last the MLP
        # activation (which needs the most room): each is read before the next one overwrites it,
        # so the norms are computed once (a norm is ~5% of a layer on CPU) and the layer's
        # activations take no more memory than the MLP activation alone.
        self.n_tokens, self.dim = hidden.shape[1], hidden.shape[2]
        self.attn_dim = fwd.self_attn.o_proj.in_features
        self.mlp_dim = fwd.mlp.down_proj.in_features
        self.width = max(self.mlp_dim, self.dim + self.attn_dim)
        self.scratch = torch.empty(hidden.shape[0] * self.n_tokens * self.width, dtype=hidden.dtype)

    def region(self, s, e, offset, size):
        base = s * self.n_tokens * self.width + offset * (e - s) * self.n_tokens
        return self.scratch[base : base + size * (e - s) * self.n_tokens].view(e - s, self.n_tokens, size)

    def input_norm(self, s, e):  # site 1
        normed = self.region(s, e, 0, self.dim)
        normed.copy_(self.fwd.input_layernorm(self.hidden[s:e]))
        return normed

    def attention(self, s, e):  # site 2
        out = self.region(s, e, self.dim, self.attn_dim)
        with _swapped(self.fwd.self_attn, "o_proj", nn.Identity()):
            out.copy_(self.fwd.self_attn(self.region(s, e, 0, self.dim), *self.rope, self.kernel))
        return out

    def residual(self, s, e):  # site 3
        a = self.fwd.self_attn.o_proj(self.region(s, e, self.dim, self.attn_dim))
        if self.post_attn is not None:
            a = self.post_attn(a)
        self.hidden[s:e] = self.hidden[s:e] + a
        normed = self.region(s, e, 0, self.dim)
        normed.copy_(self.pre_ffn(self.hidden[s:e]))
        return normed

    def activation(self, s, e):  # site 4
        # GatedMLP's torch arithmetic, act(gate) * up (its reference path). The fused C row op
        # (kernels/cpu_rowops.py) agrees to the last bits only and at 8192 rows is slower than
        # torch's, so calibration keeps torch.
        # silu in place and the product written straight into the scratch buffer: no fresh
        # [tokens, mlp_dim] tensors to fault in, same bits.
        mlp = self.fwd.mlp
        x = self.region(s, e, 0, self.dim)
        gate = mlp.gate_proj(x)
        gate = F.silu(gate, inplace=True) if mlp.act is F.silu else mlp.act(gate)
        out = self.region(s, e, 0, self.mlp_dim)
        torch.mul(gate, mlp.up_proj(x), out=out)  # up_proj reads x before out overwrites it
        return out

    def output(self, s, e, index):
        m = self.fwd.mlp.down_proj(self.region(s, e, 0, self.mlp_dim))
        if self.post_ffn is not None:
            m = self.post_ffn(m)
        out = self.hidden[s:e] + m
        # One float32 sum is finite when every element is (the exact check runs only if not).
        if not torch.isfinite(out.sum(dtype=torch.float32)):
            _check_finite(out, f"after layer {index}", s)
        self.hidden[s:e] = out


def run_staged(
    lm: LayerwiseModel,
    layer: nn.Module,
    index: int,
    hidden: torch.Tensor,
    quantize: QuantizeSite | None,
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    first_weight: float = 1.0,
    reference: torch.Tensor | None = None,
) -> None:
    """Quantize the layer site by site (see the module docstring); `hidden` becomes its output.
    With quantize=None the layer (already quantized) only moves `hidden`, by the same arithmetic.

    `reference` (float targets, GPTAQ): the float model's hidden states entering this layer. They
    go through the float layer beside `hidden`, and each site's statistics gain `shift`,
    E[(x_float − x) xᵀ], with which GPTQ matches the float model's outputs rather than the
    float layer's on the quantized inputs (quant/gptq.float_target). `reference` becomes the
    float layer's output."""
    fwd = lm.forward_copy(layer)
    batches = list(_batches(hidden.shape[0], hidden.shape[1], batch_tokens))
    rope = lm.rope(index, hidden.shape[1], hidden.dtype)
    attention_kernel = BlockCausalAttention()
    stream = _Stream(fwd, hidden, rope, attention_kernel)
    ref = None
    if reference is not None:
        ref_fwd = lm.forward_copy(layer)
        if ref_fwd is fwd:  # float32 compute: the float stream must not see the quantized weights
            ref_fwd = copy.deepcopy(layer)
        ref = _Stream(ref_fwd, reference, rope, attention_kernel)

    def stage(site: str, modules: tuple[str, ...], step: str) -> None:
        inputs = getattr(stream, step)
        ref_inputs = None if ref is None else getattr(ref, step)
        if quantize is None:
            for start, end in batches:
                inputs(start, end)
            return
        acc = shift = None
        for start, end in batches:
            x = inputs(start, end)
            if acc is None:
                acc = StatsAccumulator(x.shape[-1], moments=False, first_weight=first_weight)  # GPTQ reads only H
                shift = None if ref is None else ShiftAccumulator(x.shape[-1], first_weight=first_weight)
            acc.add(x)
            if not acc.finite():  # the diagonal's K values: find the sample only when it is needed
                _check_finite(x, f"entering {lm.layer_prefix(index)}{site}", start)
            if shift is not None:
                shift.add(ref_inputs(start, end), x)
        stats = acc.finish()
        if shift is not None:
            stats.shift = shift.finish()
        for name, weight in quantize(site, modules, stats).items():
            fwd.get_submodule(name).weight.data = weight.to(fwd.get_submodule(name).weight.dtype)

    with torch.inference_mode():
        stage(*SITES[0], "input_norm")
        stage(*SITES[1], "attention")
        stage(*SITES[2], "residual")
        stage(*SITES[3], "activation")
        for s, e in batches:
            stream.output(s, e, index)
            if ref is not None:
                ref.output(s, e, index)


def replay_staged(lm: LayerwiseModel, layer: nn.Module, index: int, hidden: torch.Tensor, *,
                  batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
    """hidden ← layer(hidden) for a layer that `run_staged` quantized earlier (its weights put back),
    computed exactly as `run_staged` moved `hidden`, so a resumed run reaches the same bytes."""
    run_staged(lm, layer, index, hidden, None, batch_tokens=batch_tokens)
