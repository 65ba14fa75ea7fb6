"""Draft models for speculative decoding: another checkpoint sharing the target's tokenizer, or
an in-memory quantized copy of the target (`self:int4`): the quantized model drafts, the
precise model verifies."""

from __future__ import annotations

import os

import torch
from torch import nn

from lowbit.errors import UsageError
from lowbit.kernels import cpu_rowops


# A draft's lm_head is read in full at every draft step (28M weights on SmolLM2, a large share of
# a draft step), and its precision only moves the acceptance rate, never the output. Measured on
# SmolLM2 with a GPTQ int4 draft, unrescored: mean accepted length 3.37 with a bf16, int8 or float
# head, 2.0 with int4 (RTN g128) and 2.46 with int4 g32. Rescored (RescoredHead), an int4-g32 head
# keeps the float head's choice: LOWBIT_DRAFT_HEAD picks the format (tests and comparisons).
DRAFT_HEAD_FORMAT = os.environ.get("LOWBIT_DRAFT_HEAD", "int4-g32")


class RescoredHead(nn.Module):
    """A draft's quantized lm_head read through the fast CPU kernels (int4: cpu-int4dot, int8:
    cpu-int8dot, both with int8 activations), with each row's TOP best candidates rescored in
    float32 against the head's float weight (`exact`: the tied embedding's own tensor where the head
    is tied, so no copy).

    Why rescore: the quantized weights and activations move the draft's argmax (int8 activations
    alone cut the mean accepted length from 3.37 to 2.91; an int4 head without rescoring, to 2.46);
    the float head's argmax is almost always among the approximate top few, and rescoring them
    restores its choice at the cost of TOP dot products."""

    TOP = 16

    def __init__(self, qt, bias: torch.Tensor | None, device, exact: torch.Tensor, vocab: torch.Tensor | None = None):
        super().__init__()
        from lowbit.runtime.quant_linear import QuantLinear

        self.vocab = vocab  # sorted ids the quantized rows `qt` are (draft_vocab.py); None: every token
        self.fast = QuantLinear(qt, bias if bias is None or vocab is None else bias[vocab], device)
        self.exact = exact.detach()  # [N, K] float32 or bf16 (a plain attribute: not a parameter)
        self.bias = bias
        self.label = qt.spec.label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fast(x)
        flat = y.view(-1, y.shape[-1])
        xs = x.reshape(-1, x.shape[-1]).float().contiguous()
        top = self._top(flat, min(self.TOP, flat.shape[-1]))
        if not cpu_rowops.rescore(flat, top, self.exact, xs, self.vocab, self.bias):  # one C call where it can
            ids = top if self.vocab is None else self.vocab[top]
            exact = torch.bmm(self.exact[ids].float(), xs[:, :, None])[:, :, 0]  # [M, TOP]
            if self.bias is not None:
                exact = exact + self.bias.float()[ids]
            flat.scatter_(1, top, exact.to(flat.dtype))
        if self.vocab is None:
            return y
        # every token's column, -inf outside the vocabulary: samplers and the rejection rule see a
        # distribution over the model's ids (a fresh tensor: callers may keep or change it)
        full = torch.full((flat.shape[0], self.exact.shape[0]), float("-inf"), dtype=flat.dtype, device=flat.device)
        full.index_copy_(1, self.vocab, flat)
        return full.view(*y.shape[:-1], -1)

    @staticmethod
    def _top(flat: torch.Tensor, k: int) -> torch.Tensor:
        if cpu_rowops.logits_usable(flat):
            try:
                return cpu_rowops.top_indices(flat, k)
            except RuntimeError:
                pass  # a row with fewer than k numbers (NaN logits): torch ranks them, the target rejects them
        return flat.topk(k, dim=-1).indices


def _draft_head(weight: torch.Tensor, bias, device, fmt: str, vocab: torch.Tensor | None = None) -> RescoredHead:
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec

    try:
        spec = parse_spec(fmt)
    except UsageError as e:
        raise UsageError(f"draft head format (LOWBIT_DRAFT_HEAD): {e}") from None
    if vocab is not None:
        vocab = vocab[vocab < weight.shape[0]]  # a draft model's head may have fewer (padding) rows
    rows = weight if vocab is None else weight[vocab]
    return RescoredHead(quantize_rtn(rows.detach().float(), spec), bias, device, weight, vocab)


def quantize_linears_(model: nn.Module, fmt: str, device, head_fmt: str | None = None, fuse: bool = True,
                      head_vocab: torch.Tensor | None = None) -> nn.Module:
    """Replace every nn.Linear by its RTN-quantized `fmt` version, in place; lm_head too, in
    `head_fmt` when given, scoring only `head_vocab`'s tokens when given (draft_vocab.py). fuse:
    join q/k/v and gate/up after (False: the caller joins them, as engine_model.load_engine_model
    does once the weights' huge-page generation is set)."""
    from lowbit.quant.rtn import quantize_rtn
    from lowbit.quant.spec import parse_spec
    from lowbit.runtime.quant_linear import QuantLinear

    spec = parse_spec(fmt)
    head = getattr(model, "lm_head", None)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if head_fmt and child is head:
                    setattr(module, name, _draft_head(child.weight, child.bias, device, head_fmt, head_vocab))
                else:
                    setattr(module, name, QuantLinear(quantize_rtn(child.weight.detach().float(), spec), child.bias, device))
    if fuse:
        from lowbit.runtime.models.fusion import fuse_projections

        fuse_projections(model)
    return model


def quantize_draft_head_(model: nn.Module, device, vocab: torch.Tensor | None = None) -> nn.Module:
    """A draft model's float lm_head, on CPU, as DRAFT_HEAD_FORMAT over `vocab`'s tokens (None: all;
    quantized heads stay)."""
    head = getattr(model, "lm_head", None)
    if torch.device(device).type == "cpu" and isinstance(head, nn.Linear):
        model.lm_head = _draft_head(head.weight, head.bias, device, DRAFT_HEAD_FORMAT, vocab)
    return model


def quantized_copy(path, fmt: str, dtype: torch.dtype, device, fuse: bool = True,
                   head_vocab: torch.Tensor | None = None) -> nn.Module:
    from lowbit.runtime.loader import load_model

    head = DRAFT_HEAD_FORMAT if torch.device(device).type == "cpu" else None
    return quantize_linears_(load_model(path, dtype, device), fmt, device, head_fmt=head, fuse=fuse,
                             head_vocab=head_vocab if head else None)


def check_same_tokenizer(path, target_tokenizer, what: str, whose: str = "the target's") -> None:
    """A one-line UsageError unless the model at `path` has the target's vocabulary (a draft's or a
    cascade's tokens must mean the same ids)."""
    from lowbit.runtime.tokenizer import load_tokenizer

    if load_tokenizer(path).backend.get_vocab() != target_tokenizer.backend.get_vocab():
        raise UsageError(f"{what} does not share {whose} tokenizer")


def load_draft_model(arg: str, target_tokenizer, dtype: torch.dtype, device, role: str = "draft model",
                     head_vocab: torch.Tensor | None = None) -> nn.Module:
    from lowbit.formats.resolve import resolve_model

    path = resolve_model(arg)
    check_same_tokenizer(path, target_tokenizer, f"{role} {arg}")
    from lowbit.runtime.engine.engine_model import load_engine_model

    # as the engine loads its target (invariant Linears, joined projections): the one-call decode step
    return load_engine_model(path, dtype, torch.device(device), draft_head=True, head_vocab=head_vocab)


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
