"""Post-load fusion of projections that read the same input: q/k/v and gate/up.

An explicit step for inference (the engine calls it after loading): the module tree, its
Hugging Face names and the separate q_proj/k_proj/v_proj/gate_proj/up_proj children stay as
they are (calibration hooks them, the loader fills them), and the fused module is kept as a
plain attribute that forward() prefers. Joined are quantized weights on the batch-invariant int4
and int8 kernels (cpu-int4dot, cpu-int8f), and dense Linears the engine made InvariantLinears (kernels/cpu_f32.py): their rows are
computed alone, so the joined matmul is bit-identical to the separate ones (in float32, and in
bf16 up to the kernel's 16 rows; torch's bf16 GEMM past them) and the join costs no accuracy,
only calls (7 matmuls per layer become 4). A join holds one copy of the weights, and the separate
projections become views of its rows (a dense Linear's weight, a quantized one's prepared arrays
where they fill whole tiles of the kernel), so it costs no memory.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.kernels import hugepages
from lowbit.kernels.dispatch import prepared_rows
from lowbit.runtime import module_swaps
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


class JoinedDense(nn.Module):
    """Several dense InvariantLinears of one input as one; their weights are views of its rows."""

    def __init__(self, linear: nn.Linear, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _join_dense(modules: list[nn.Module]) -> JoinedDense | None:
    from lowbit.kernels.cpu_f32 import InvariantLinear

    if not all(type(m) is InvariantLinear for m in modules):
        return None  # quantized (QuantLinear has no .weight) or not on the dense kernel
    first = modules[0]
    w0 = first.weight
    if any(m.weight.dtype is not w0.dtype or m.weight.device != w0.device or m.weight.requires_grad
           or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
           or m.bf16_x != first.bf16_x for m in modules):
        return None
    with torch.no_grad():
        weight = hugepages.place(torch.cat([m.weight.data for m in modules]))
        bias = None if first.bias is None else torch.cat([m.bias.data for m in modules])
    joined = InvariantLinear.__new__(InvariantLinear)
    nn.Module.__init__(joined)
    joined.in_features, joined.out_features = first.in_features, weight.shape[0]
    joined.weight = nn.Parameter(weight, requires_grad=False)
    joined.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    joined.bf16_x = first.bf16_x
    start = 0
    for m in modules:  # the separate weights become views of the joined rows: one copy in memory
        rows = m.weight.shape[0]
        m.weight.data = weight[start : start + rows]
        if bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return JoinedDense(joined, [m.out_features for m in modules])


def _concat_for(modules: list[nn.Module]):
    """The `concat` of the batch-invariant quantized path all of these run on, or None."""
    from lowbit.kernels import cpu_int4dot, cpu_int8

    paths = set()
    for m in modules:
        prepared = getattr(m, "prepared", None)
        if prepared is None or getattr(m, "bias", None) is not None or getattr(m, "outliers", None) is not None:
            return None
        paths.add(prepared.path)
    return {frozenset({cpu_int4dot.PATH}): cpu_int4dot.concat, frozenset({cpu_int4dot.INT8_PATH}): cpu_int4dot.concat,
            frozenset({cpu_int8.PATH}): cpu_int8.concat}.get(frozenset(paths))


def _join(modules: list[nn.Module]) -> JoinedLinear | JoinedDense | None:
    concat = _concat_for(modules)
    if concat is None:
        return _join_dense(modules)
    try:
        prepared = concat([m.prepared for m in modules])
    except ValueError:
        return None
    sizes = [m.prepared.shape[0] for m in modules]
    # the separate projections become views of the joined rows where the kernel's layout allows
    # (the int4 kernel's: whole groups of 64 rows, as SmolLM2's, Gemma-3's and the MoE's q/k/v and
    # gate/up are), as a dense join does: one copy in memory instead of two (39 of SmolLM2
    # int4-g32's 98 MB of int4 arrays)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    views = [prepared_rows(prepared, start, n) for start, n in zip(starts, sizes)]
    if all(v is not None for v in views):
        for m, view in zip(modules, views):
            m.prepared = view
    return JoinedLinear(prepared, sizes)


def fuse_projections(model: nn.Module) -> int:
    """Join q/k/v and gate/up where possible (again after weights were swapped; joins that no
    longer apply are dropped). Returns how many joined modules the model now uses."""
    count = 0
    for module in model.modules():
        if isinstance(module, SelfAttention):
            joined = _join([module.q_proj, module.k_proj, module.v_proj])
            module.__dict__["fused_qkv"] = joined  # a plain attribute, not a child module
            module_swaps.note_swap()
        elif isinstance(module, GatedMLP):
            joined = _join([module.gate_proj, module.up_proj])
            module.__dict__["fused_gate_up"] = joined
            module_swaps.note_swap()
        else:
            continue
        count += joined is not None
    return count
