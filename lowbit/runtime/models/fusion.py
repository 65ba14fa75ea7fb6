"""Post-load fusion of projections that read the same input: q/k/v and gate/up.

An explicit step for inference (the engine calls it after loading): the module tree, its
Hugging Face names and the separate q_proj/k_proj/v_proj/gate_proj/up_proj children stay as
they are (calibration hooks them, the loader fills them), and the fused module is kept as a
plain attribute that forward() prefers. Only quantized weights on the batch-invariant int4
kernel are joined: their rows are computed alone, so the joined matmul is bit-identical to the
separate ones and the join costs no accuracy, only calls (7 matmuls per layer become 4).
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.runtime.attention import SelfAttention
from lowbit.runtime.layers import GatedMLP


class JoinedLinear(nn.Module):
    """Several quantized projections of one input as one matmul; `sizes` splits the output."""

    def __init__(self, prepared, sizes: list[int]):
        super().__init__()
        self.prepared = prepared
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lowbit.kernels import qmatmul

        return qmatmul(x, self.prepared)


def _joinable(modules: list[nn.Module]) -> bool:
    for m in modules:
        prepared = getattr(m, "prepared", None)
        if prepared is None or prepared.path != "cpu-int4dot" or getattr(m, "bias", None) is not None:
            return False
        if getattr(m, "outliers", None) is not None:
            return False
    return True


def _join(modules: list[nn.Module]) -> JoinedLinear | None:
    from lowbit.kernels.cpu_int4dot import concat

    if not _joinable(modules):
        return None
    try:
        prepared = concat([m.prepared for m in modules])
    except ValueError:
        return None
    return JoinedLinear(prepared, [m.prepared.shape[0] for m in modules])


def fuse_projections(model: nn.Module) -> int:
    """Join q/k/v and gate/up where possible (again after weights were swapped; joins that no
    longer apply are dropped). Returns how many joined modules the model now uses."""
    count = 0
    for module in model.modules():
        if isinstance(module, SelfAttention):
            joined = _join([module.q_proj, module.k_proj, module.v_proj])
            module.__dict__["fused_qkv"] = joined  # a plain attribute, not a child module
        elif isinstance(module, GatedMLP):
            joined = _join([module.gate_proj, module.up_proj])
            module.__dict__["fused_gate_up"] = joined
        else:
            continue
        count += joined is not None
    return count
