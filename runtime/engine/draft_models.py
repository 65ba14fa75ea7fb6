"""Draft models for speculative decoding: another checkpoint sharing the target's tokenizer, or
an in-memory quantized copy of the target (`self:int4`): the quantized model drafts, the
precise model verifies."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import UsageError


class PreparedLinear(nn.Module):
    """A Linear whose weight is a quantized, kernel-prepared matrix (kernels.prepare)."""

    def __init__(self, prepared, bias: torch.Tensor | None):
        super().__init__()
        self.prepared = prepared
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lowbit.kernels import qmatmul

        return qmatmul(x, self.prepared, self.bias)


# A draft's lm_head is read in full at every draft step (28M weights on SmolLM2, 4 ms of an 8 ms
# step in bf16), and its precision only moves the acceptance rate, never the output. int8 keeps
# the acceptance: measured on SmolLM2 with a GPTQ int4 draft, mean accepted length 3.37 with a
# bf16, int8 or float head, 2.0 with int4 (RTN g128) and 2.46 with int4 g32. The head keeps
# its activations in bf16: the int8-activation kernel (path cpu-int8dot) reads it in 1.0 ms
# instead of torch's 2.1, but the mean accepted length fell from 3.37 to 2.91 (bench/decode.py).
DRAFT_HEAD_FORMAT = "int8"


def quantize_linears_(model: nn.Module, fmt: str, device, head_fmt: str | None = None) -> nn.Module:
    """Replace every nn.Linear by its RTN-quantized `fmt` version, in place; lm_head too, in
    `head_fmt` when given."""
    from lowbit.kernels import prepare
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec

    try:
        from lowbit.runtime.quant_linear import QuantLinear
    except ImportError:  # the runtime's QuantLinear is newer than this module
        QuantLinear = None
    spec = parse_spec(fmt)
    head = getattr(model, "lm_head", None)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                qt = quantize_rtn(child.weight.detach().float(), parse_spec(head_fmt) if head_fmt and child is head else spec)
                if QuantLinear is not None:
                    setattr(module, name, QuantLinear(qt, child.bias, device))
                else:
                    setattr(module, name, PreparedLinear(prepare(qt, device), child.bias))
    from lowbit.runtime.models.fusion import fuse_projections

    fuse_projections(model)
    return model


def quantize_draft_head_(model: nn.Module, device) -> nn.Module:
    """A draft model's float lm_head, on CPU, as DRAFT_HEAD_FORMAT (quantized heads stay)."""
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec
    from lowbit.runtime.quant_linear import QuantLinear

    head = getattr(model, "lm_head", None)
    if torch.device(device).type == "cpu" and isinstance(head, nn.Linear):
        qt = quantize_rtn(head.weight.detach().float(), parse_spec(DRAFT_HEAD_FORMAT))
        model.lm_head = QuantLinear(qt, head.bias, device)
    return model


def quantized_copy(path, fmt: str, dtype: torch.dtype, device) -> nn.Module:
    from lowbit.runtime.loader import load_model

    head = DRAFT_HEAD_FORMAT if torch.device(device).type == "cpu" else None
    return quantize_linears_(load_model(path, dtype, device), fmt, device, head_fmt=head)


def load_draft_model(arg: str, target_tokenizer, dtype: torch.dtype, device) -> nn.Module:
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    path = resolve_model(arg)
    if load_tokenizer(path).backend.get_vocab() != target_tokenizer.backend.get_vocab():
        raise UsageError(f"draft model {arg} does not share the target's tokenizer")
    from lowbit.runtime.models.fusion import fuse_projections

    model = load_model(path, dtype, device)
    fuse_projections(model)
    return quantize_draft_head_(model, device)
