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


def quantize_linears_(model: nn.Module, fmt: str, device) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by its RTN-quantized `fmt` version, in place."""
    from lowbit.kernels import prepare
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec

    try:
        from lowbit.runtime.quant_linear import QuantLinear
    except ImportError:  # the runtime's QuantLinear is newer than this module
        QuantLinear = None
    spec = parse_spec(fmt)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                qt = quantize_rtn(child.weight.detach().float(), spec)
                if QuantLinear is not None:
                    setattr(module, name, QuantLinear(qt, child.bias, device))
                else:
                    setattr(module, name, PreparedLinear(prepare(qt, device), child.bias))
    from lowbit.runtime.models.fusion import fuse_projections

    fuse_projections(model)
    return model


def quantized_copy(path, fmt: str, dtype: torch.dtype, device) -> nn.Module:
    from lowbit.runtime.loader import load_model

    return quantize_linears_(load_model(path, dtype, device), fmt, device)


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
    return model
