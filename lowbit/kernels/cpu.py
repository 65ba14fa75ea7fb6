"""CPU paths through torch's own weight-only ops: int4 (`_weight_int4pack_mm_for_cpu`) and
per-channel int8 (`_weight_int8pack_mm`).

int4: torch computes w = (q - 8) * scale + zero per group of 32/64/128/256 columns, with scale
and zero in the activation dtype; bf16 is its fast case (fp32 and fp16 activations are 30-80x
slower), so activations are rounded to bf16 and the result is cast back. lowbit's (q - zp) * s
becomes scale = s, zero = (8 - zp) * s, both rounded to bf16: every dequantized weight is then
within bf16 rounding of the group's range, the same order as rounding x to bf16. The packed
layout depends on the CPU's instruction set, so it is built at load and never saved. Groups
torch does not take (K = 576 with g = 128 leaves a ragged group of 64) are transcoded losslessly
into the largest accepted group dividing both g and K (here 64: each scale repeated twice).

Prefill (M > 16): torch's int4 op is slower than its bf16 GEMM there, so the weight is decoded
once per call into bf16 (the exact weight rounded once) by the bf16 kernel's decoder and run
through F.linear.

int8: y = (x @ q^T) * scale with q the signed codes and one scale per row, again in bf16.
"""

from __future__ import annotations

import torch

from lowbit.kernels import cpu_bf16, layout
from lowbit.kernels.prepared import PreparedWeight
from lowbit.quant.qtensor import QTensor

INT4_GROUPS = (256, 128, 64, 32)
INT4_ROW_MULTIPLE = 16  # the packing op refuses other row counts ("expect N to be dividable by 16")
PREFILL_ROWS = 16  # more rows than this: decode to bf16 once and use torch's bf16 GEMM
_TINYGEMM_MID = 8  # torch's int4 op subtracts 8 from every code


def int4_group(qt: QTensor) -> int | None:
    """The group size torch's int4 op will use for this weight, or None if none fits."""
    if qt.spec.bits != 4 or qt.spec.element != "int" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    n, k = qt.shape
    if n % INT4_ROW_MULTIPLE:
        return None
    g = layout.group_scales(qt).group_size
    for t in INT4_GROUPS:
        if g % t == 0 and k % t == 0:
            return t
    return None


def prepare_int4(qt: QTensor) -> PreparedWeight:
    qt = qt.to("cpu")
    n, k = qt.shape
    t = int4_group(qt)
    gs = layout.group_scales(qt)
    table = layout.code_table(qt)
    zero_point = -table[0]  # code u is worth (u - zero_point) at scale 1
    if not torch.equal(table, torch.arange(16, dtype=torch.float32) - zero_point):
        raise ValueError(f"{qt.spec.label}: codes are not uniform integers")
    zp = gs.zero if gs.zero is not None else torch.full_like(gs.scale, float(zero_point))
    scale = gs.scale.repeat_interleave(gs.group_size // t, dim=1)[:, : k // t]
    zp = zp.repeat_interleave(gs.group_size // t, dim=1)[:, : k // t]
    offset = (_TINYGEMM_MID - zp) * scale
    scale_zero = torch.stack([scale, offset], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(layout.codes(qt).to(torch.int32).contiguous(), 1)
    # torch's op is slower than a bf16 GEMM for prefill batches: keep the bf16 kernel's copy
    # (half a byte per weight more) to decode the weight once per call there.
    bf16_plan = cpu_bf16.plan(qt)
    prefill = cpu_bf16.prepare(qt, bf16_plan) if bf16_plan is not None else None
    return PreparedWeight(
        path="cpu-int4", shape=(n, k), label=qt.spec.label, device=torch.device("cpu"),
        tensors={"packed": packed, "scale_zero": scale_zero}, params={"group": t, "prefill": prefill},
    )


def matmul_int4(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """bf16 y [M, N] for x [M, K]."""
    t = pw.tensors
    prefill = pw.params.get("prefill")
    if prefill is not None and x.shape[0] > PREFILL_ROWS:
        # bf16 weights (the exact weight rounded once), bf16 GEMM, bf16 y: the op's own precision.
        return cpu_bf16.prefill_matmul(x, prefill, torch.bfloat16, pair=False)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), t["packed"], pw.params["group"], t["scale_zero"])


def int8_channel(qt: QTensor) -> bool:
    spec = qt.spec
    # torch 2.13's op returns wrong numbers or crashes when K is not a multiple of 16 (K=200
    # segfaults at M=3); 32 keeps a margin.
    ok_k = qt.shape[1] % 32 == 0
    return spec.bits == 8 and spec.element == "int" and spec.granularity == "channel" and ok_k and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def prepare_int8(qt: QTensor) -> PreparedWeight:
    qt = qt.to("cpu")
    table = layout.code_table(qt)
    zero_point = int(-table[0])
    signed = (layout.codes(qt).to(torch.int16) - zero_point).to(torch.int8).contiguous()
    scale = layout.group_scales(qt).scale.reshape(-1).to(torch.bfloat16).contiguous()
    return PreparedWeight(
        path="cpu-int8", shape=qt.shape, label=qt.spec.label, device=torch.device("cpu"),
        tensors={"qweight": signed, "scales": scale},
    )


def matmul_int8(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    t = pw.tensors
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), t["qweight"], t["scales"])
