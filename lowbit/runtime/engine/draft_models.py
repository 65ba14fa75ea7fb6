"""Draft models for speculative decoding: another checkpoint sharing the target's tokenizer, or
an in-memory quantized copy of the target (`self:int4`): the quantized model drafts, the
precise model verifies."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import UsageError


# A draft's lm_head is read in full at every draft step (28M weights on SmolLM2, a large share of
# a bf16 draft step), and its precision only moves the acceptance rate, never the output. int8 keeps
# the acceptance: measured on SmolLM2 with a GPTQ int4 draft, mean accepted length 3.37 with a
# bf16, int8 or float head, 2.0 with int4 (RTN g128) and 2.46 with int4 g32.
DRAFT_HEAD_FORMAT = "int8"


class RescoredHead(nn.Module):
    """A draft's int8 lm_head read through the int8-activation kernel (cpu-int8dot: faster than
    torch's int8 op and cpu-lut's float32 kernel on a head as wide as SmolLM2's 49152 x 576;
    figures in docs/benchmarks.md), with each row's TOP best candidates rescored in float32 from
    the int8 weight.

    Why rescore: the int8 activations alone moved the draft's argmax often enough to cut the mean
    accepted length from 3.37 to 2.91; the true argmax is almost always among the approximate
    top few, and rescoring them restores the float32 head's choice at the cost of TOP dot products."""

    TOP = 16

    def __init__(self, qt, bias: torch.Tensor | None, device):
        super().__init__()
        from lowbit.runtime.quant_linear import QuantLinear

        self.fast = QuantLinear(qt, bias, device, "cpu-int8dot")
        from lowbit.kernels import layout

        table = layout.code_table(qt)  # 8-bit integer codes: value = code - 128 (supports_int8 checked it)
        self.q = (layout.codes(qt).to(torch.int16) + int(table[0])).to(torch.int8)  # [N, K] values
        self.scale = layout.group_scales(qt).scale  # [N, 1] float32 (per channel)
        self.bias = bias
        self.label = qt.spec.label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fast(x)
        flat = y.view(-1, y.shape[-1])
        xs = x.reshape(-1, x.shape[-1]).float()
        top = flat.topk(min(self.TOP, flat.shape[-1]), dim=-1).indices  # [M, TOP]
        exact = torch.einsum("mtk,mk->mt", self.q[top].float() * self.scale[top], xs)
        if self.bias is not None:
            exact = exact + self.bias.float()[top]
        flat.scatter_(1, top, exact.to(flat.dtype))
        return y


def _draft_head(qt, bias, device) -> nn.Module:
    from lowbit.kernels import cpu_int4dot
    from lowbit.runtime.quant_linear import QuantLinear

    if torch.device(device).type == "cpu" and cpu_int4dot.supports_int8(qt):
        return RescoredHead(qt, bias, device)
    return QuantLinear(qt, bias, device)


def quantize_linears_(model: nn.Module, fmt: str, device, head_fmt: str | None = None) -> nn.Module:
    """Replace every nn.Linear by its RTN-quantized `fmt` version, in place; lm_head too, in
    `head_fmt` when given."""
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec
    from lowbit.runtime.quant_linear import QuantLinear

    spec = parse_spec(fmt)
    head = getattr(model, "lm_head", None)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                is_head = bool(head_fmt) and child is head
                qt = quantize_rtn(child.weight.detach().float(), parse_spec(head_fmt) if is_head else spec)
                setattr(module, name, _draft_head(qt, child.bias, device) if is_head
                        else QuantLinear(qt, child.bias, device))
    from lowbit.runtime.models.fusion import fuse_projections

    fuse_projections(model)
    return model


def quantize_draft_head_(model: nn.Module, device) -> nn.Module:
    """A draft model's float lm_head, on CPU, as DRAFT_HEAD_FORMAT (quantized heads stay)."""
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec

    head = getattr(model, "lm_head", None)
    if torch.device(device).type == "cpu" and isinstance(head, nn.Linear):
        qt = quantize_rtn(head.weight.detach().float(), parse_spec(DRAFT_HEAD_FORMAT))
        model.lm_head = _draft_head(qt, head.bias, device)
    return model


def quantized_copy(path, fmt: str, dtype: torch.dtype, device) -> nn.Module:
    from lowbit.runtime.loader import load_model

    head = DRAFT_HEAD_FORMAT if torch.device(device).type == "cpu" else None
    return quantize_linears_(load_model(path, dtype, device), fmt, device, head_fmt=head)


def check_same_tokenizer(path, target_tokenizer, what: str, whose: str = "the target's") -> None:
    """A one-line UsageError unless the model at `path` has the target's vocabulary (a draft's or a
    cascade's tokens must mean the same ids)."""
    from lowbit.runtime.tokenizer import load_tokenizer

    if load_tokenizer(path).backend.get_vocab() != target_tokenizer.backend.get_vocab():
        raise UsageError(f"{what} does not share {whose} tokenizer")


def load_draft_model(arg: str, target_tokenizer, dtype: torch.dtype, device, role: str = "draft model") -> nn.Module:
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.loader import load_model

    path = resolve_model(arg)
    check_same_tokenizer(path, target_tokenizer, f"{role} {arg}")
    from lowbit.runtime.models.fusion import fuse_projections

    model = load_model(path, dtype, device)
    fuse_projections(model)
    return quantize_draft_head_(model, device)


def layer_prefix(model: nn.Module, num_layers: int, adapter: nn.Module | None = None, option: str = "--draft") -> nn.Module:
    """A view of `model` that runs only its first `num_layers` decoder layers, then the model's own
    final norm and head: the same module objects (no weight is copied), so it drafts over the
    target's KV cache of those layers (drafter.LayerPrefixDrafter).

    adapter: the hook for a trained exit adapter (lowbit distill): a module applied to the normed
    hidden state before the head; None uses the head as it is. option: the flag named in errors."""
    import copy

    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise UsageError(f"{option} self:layers={num_layers}: the layer count must be between 1 and "
                         f"{total - 1} (the model has {total} layers)")
    inner = copy.copy(model.model)
    inner._modules = dict(inner._modules)  # our own children table: the target's stays untouched
    inner.layers = nn.ModuleList(list(model.model.layers)[:num_layers])
    inner.layer_rotary = model.model.layer_rotary[:num_layers]
    view = copy.copy(model)
    view._modules = dict(view._modules)
    view.model = inner
    if adapter is not None:
        view.lm_head = nn.Sequential(adapter, model.lm_head)
    return view
