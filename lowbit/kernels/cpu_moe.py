"""Mixture-of-experts routing on CPU in C (native/moe_route.c), for runtime/models/moe.py.

The model's forward and the one-call decode step (native/decode_layers.c) both route through
these C functions, so a token picks the same experts with the same weights, bit for bit, on
either path: router logits summed in double and rounded to float32 (independent of the batch),
softmax in float32 with libm's expf, top-k (ties to the lower expert), optional renormalization.
`usable` says when they stand in for the torch code (CPU, float32, no autograd, library built).
"""

from __future__ import annotations

import torch

from lowbit.native import moe_route

MAX_EXPERTS = 1024  # moe_route.c


def available() -> bool:
    return moe_route.library() is not None


def usable(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    if rows.dtype is not torch.float32 or weight.dtype is not torch.float32 or not rows.is_cpu or not weight.is_cpu:
        return False
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        return False
    return weight.shape[0] <= MAX_EXPERTS and available()


def _rows(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def route(rows: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, top_k] float32, experts [N, top_k] int64) for rows [N, hidden], router weight [E, hidden]."""
    rows, weight = _rows(rows), weight.contiguous()
    n, hidden = rows.shape
    weights = torch.empty(n, top_k, dtype=torch.float32)
    experts = torch.empty(n, top_k, dtype=torch.long)
    rc = moe_route.library().lowbit_moe_route(rows.data_ptr(), rows.stride(0), n, hidden, weight.data_ptr(), weight.shape[0],
                                              top_k, int(norm_topk), weights.data_ptr(), experts.data_ptr(),
                                              torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_moe_route failed with code {rc}")
    return weights, experts


def shared_gate(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(rows · w) [N, 1] float32 for Qwen2-MoE's shared-expert gate weight [1, hidden]."""
    rows, weight = _rows(rows), weight.contiguous()
    n, hidden = rows.shape
    out = torch.empty(n, 1, dtype=torch.float32)
    rc = moe_route.library().lowbit_moe_shared_gate(rows.data_ptr(), rows.stride(0), n, hidden, weight.data_ptr(),
                                                    out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"lowbit_moe_shared_gate failed with code {rc}")
    return out
