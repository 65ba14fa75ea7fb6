"""The per-row ops of a decoder layer in C (native/rowops.c): RMSNorm, residual add + RMSNorm,
and the gated activation act(gate) * up, each one call instead of ~8 small torch ops per norm.

They round where runtime/layers.py's torch reference rounds (see rowops.c), computing each row
alone, so results are batch-invariant; only the float32 sum of squares and the activation's exp
differ from torch's, in the last bits. The model code calls them through `usable()`: CPU,
float32 or bf16, weights in the activations' dtype, no autograd graph to record (inference or
no_grad), and the library built; anything else keeps the torch path.
"""

from __future__ import annotations

import torch

from lowbit.native import rowops

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Activation names of runtime/layers.py ACTIVATIONS the C code computes (others stay in torch).
ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "gelu_new": 1}


def _lib():
    return rowops.library()


def available() -> bool:
    return _lib() is not None


def usable(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the C ops may stand in for the torch path for activations x (and a norm weight)."""
    if not x.is_cpu or x.dtype not in _DTYPES:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False  # autograd needs torch's ops
    if weight is not None and (weight.dtype != x.dtype or not weight.is_contiguous()):
        return False
    return _lib() is not None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(x as 2-D rows with a unit last stride, rows, row stride)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x, x.shape[0], x.stride(0)
    if x.is_contiguous():
        n = x.shape[-1]
        return x, x.numel() // n if n else 0, n
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, x2.shape[0], x2.stride(0)


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, heads: int = 1,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., heads * dim] over each head's dim values (heads > 1: per-head q/k norms
    of a row); into `out` (same shape, may be x) or a new contiguous tensor."""
    x2, rows, stride = _rows(x)
    if out is None:
        out = torch.empty_like(x) if x2 is x and stride == x.shape[-1] else torch.empty(x.shape, dtype=x.dtype)
        o2, ostride = out, x.shape[-1]
    else:
        o2, _, ostride = _rows(out)
        if o2.data_ptr() != out.data_ptr() or o2.shape[0] != rows:
            raise ValueError("rmsnorm: out must be rows of unit stride like x")
    dim = x.shape[-1] // heads
    _check(_lib().lowbit_rmsnorm(x2.data_ptr(), stride, rows, heads, dim, weight.data_ptr(), eps, int(unit_offset),
                                 _DTYPES[x.dtype], o2.data_ptr(), ostride, torch.get_num_threads()), "lowbit_rmsnorm")
    return out


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool,
                r_weight: torch.Tensor | None = None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, norm(s) * weight) with s = x + r, or x + norm(r) * r_weight when r_weight is given
    (Gemma's post-norms); weight None skips the second norm. `inplace` writes s into x."""
    x2, rows, xs = _rows(x)
    r2, rrows, rs = _rows(r)
    if rrows != rows or r.shape[-1] != x.shape[-1]:
        raise ValueError(f"add_rmsnorm: shapes {tuple(x.shape)} and {tuple(r.shape)} differ")
    if inplace:
        s, s2, ss = x, x2, xs
    else:
        s = torch.empty(x.shape, dtype=x.dtype)
        s2, ss = s, x.shape[-1]
    normed = None if weight is None else torch.empty_like(s)
    _check(_lib().lowbit_add_rmsnorm(
        x2.data_ptr(), xs, r2.data_ptr(), rs, None if r_weight is None else r_weight.data_ptr(), rows, x.shape[-1],
        None if weight is None else weight.data_ptr(), eps, int(unit_offset), _DTYPES[x.dtype], s2.data_ptr(), ss,
        None if normed is None else normed.data_ptr(), x.shape[-1], torch.get_num_threads()), "lowbit_add_rmsnorm")
    return s, normed


def act_mul(gate: torch.Tensor, up: torch.Tensor | None, act: str) -> torch.Tensor:
    """act(gate) * up, rounded as torch's act(gate).mul_(up); with up None, gate is the joined
    [..., 2n] output of gate|up and its halves are used."""
    g2, rows, gs = _rows(gate)
    if up is None:
        n = gate.shape[-1] // 2
        gp = g2.data_ptr()
        up_ptr, us = gp + n * gate.element_size(), gs
    else:
        n = gate.shape[-1]
        u2, urows, us = _rows(up)
        if urows != rows or up.shape[-1] != n:
            raise ValueError(f"act_mul: shapes {tuple(gate.shape)} and {tuple(up.shape)} differ")
        gp, up_ptr = g2.data_ptr(), u2.data_ptr()
    out = torch.empty((*gate.shape[:-1], n), dtype=gate.dtype)
    _check(_lib().lowbit_act_mul(gp, gs, up_ptr, us, rows, n, ACTS[act], _DTYPES[gate.dtype], out.data_ptr(), n,
                                 torch.get_num_threads()), "lowbit_act_mul")
    return out


def _logit_rows(logits: torch.Tensor, argmax: torch.Tensor | None) -> bool:
    x, rows, stride = _rows(logits)
    return bool(_lib().lowbit_logit_rows(x.data_ptr(), stride, rows, x.shape[-1],
                                         None if argmax is None else argmax.data_ptr(), torch.get_num_threads()))


def logits_usable(logits: torch.Tensor) -> bool:
    """Whether `nonfinite` / `argmax` run in C for these logits (CPU float32 rows)."""
    return logits.is_cpu and logits.dtype is torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 \
        and _lib() is not None


def nonfinite(logits: torch.Tensor) -> bool:
    """Whether any logit is NaN or infinite (`logits_usable` ones), in one pass."""
    return _logit_rows(logits, None)


TOP_MAX = 64  # the most indices `top_indices` returns per row


def top_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's k largest logits, [rows, k] (`logits_usable` rows, k <= TOP_MAX and
    at most the values per row that are not NaN; order unspecified): torch.topk's set, ~20x faster
    on a 49152-logit row."""
    if not 0 < k <= min(TOP_MAX, logits.shape[-1]):
        raise ValueError(f"top_indices: k must be in [1, {min(TOP_MAX, logits.shape[-1])}], got {k}")
    x, rows, stride = _rows(logits)
    out = torch.empty((rows, k), dtype=torch.long)
    _check(_lib().lowbit_top_rows(x.data_ptr(), stride, rows, x.shape[-1], k, out.data_ptr()), "lowbit_top_rows")
    return out


def rescore(logits: torch.Tensor, top: torch.Tensor, weight: torch.Tensor, x: torch.Tensor,
            vocab: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
    """In place: logits[r, top[r, j]] = x[r] . weight[id] (+ bias[id]) in float32, id = vocab[top]
    where given (a draft head over part of the vocabulary) else top; False (nothing written) where
    the C call does not take these tensors (the caller rescores in torch)."""
    if not (logits_usable(logits) and logits.stride(-1) == 1 and x.dtype is torch.float32 and x.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous() and weight.is_cpu
            and top.dtype is torch.long and top.is_contiguous() and x.shape == (logits.shape[0], weight.shape[1])
            and (vocab is None or vocab.dtype is torch.long and vocab.is_contiguous())
            and (bias is None or bias.dtype is torch.float32 and bias.is_contiguous())):
        return False
    _check(_lib().lowbit_rescore_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], top.data_ptr(), top.shape[1],
                                      None if vocab is None else vocab.data_ptr(), weight.data_ptr(),
                                      int(weight.dtype is torch.bfloat16), weight.shape[1], x.data_ptr(), x.shape[1],
                                      None if bias is None else bias.data_ptr()), "lowbit_rescore_rows")
    return True


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of finite `logits_usable` rows (the first index among ties),
    about twenty times faster on a 49152-logit row."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    _logit_rows(logits, out)
    return out
