"""CPU path for integer 4-bit weights through bf16 dot products (kernels/int4_dot.c, AVX512-BF16).

Numbers: activations are rounded to bf16, weights are not: the codes' integer values are exact
in bf16, so every product is exact in float32, and the group's scale and zero point are applied
in float32 after the group's dot product (y = sum_j s_j * dot_j - s_j * z_j * sum_j(x)). The result
is the float32 dequantize-then-matmul of bf16-rounded activations up to float32 summation order.

Batch invariance: each row of x is converted, summed and accumulated in the same order whatever
the number of rows in the call, so a row's output is bit-identical whether it runs alone or
among 1 + k rows of a speculative verify. Up to FUSED_MAX_ROWS rows read the weight once; more
(prefill) decode the weight to bf16 once and use torch's GEMM (not batch-invariant, not needed).

`concat` joins prepared weights of the same input width along the output dimension (q/k/v,
gate/up), so one call reads all of them.
"""

from __future__ import annotations

import ctypes

import torch

from lowbit.errors import LowbitError
from lowbit.kernels import layout
from lowbit.kernels.native import load_library
from lowbit.kernels.prepared import PreparedWeight
from lowbit.quant.qtensor import QTensor

FUSED_MAX_ROWS = 16
PATH = "cpu-int4dot"


class I4WeightStruct(ctypes.Structure):
    """The C kernel's `I4Weight` (kernels/int4_dot.c)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("table", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("szs", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("blocks", ctypes.c_int64), ("groups", ctypes.c_int64),
        ("bpg", ctypes.c_int32),
    ]


_LIB = None


def available() -> bool:
    global _LIB
    lib = load_library()
    ok = lib is not None and lib.lowbit_i4_available() == 1
    if ok:
        _LIB = lib
    return ok


def _integer_table(qt: QTensor) -> torch.Tensor | None:
    table = layout.code_table(qt)
    if not torch.equal(table, table.round()) or table.abs().max() > 256:
        return None
    return table


def supports(qt: QTensor) -> bool:
    spec = qt.spec
    if spec.bits != 4 or spec.element != "int" or not available():
        return False
    g = layout.group_scales(qt).group_size
    if not (g >= qt.shape[1] or g % 64 == 0):
        return False
    return _integer_table(qt) is not None


def _struct(tensors: dict, n: int, k: int, groups: int, bpg: int) -> dict:
    codes = tensors["codes"]
    szs = tensors.get("szs")
    struct = I4WeightStruct(
        codes.data_ptr(), codes.shape[1], tensors["table"].data_ptr(), tensors["scales"].data_ptr(),
        None if szs is None else szs.data_ptr(), n, k, codes.shape[1] // 32, groups, bpg,
    )
    # The struct holds raw pointers into `tensors`, which the PreparedWeight keeps alive.
    return {"struct": struct, "ref": ctypes.byref(struct), "groups": groups, "bpg": bpg}


def prepare(qt: QTensor, prefill: PreparedWeight | None = None) -> PreparedWeight:
    from lowbit.kernels.cpu_bf16 import repack64

    qt = qt.to("cpu")
    n, k = qt.shape
    gs = layout.group_scales(qt)
    table = _integer_table(qt)
    codes = repack64(layout.codes(qt))
    blocks = codes.shape[1] // 32
    groups = gs.scale.shape[1]
    bpg = blocks if groups == 1 else gs.group_size // 64
    table32 = torch.zeros(32, dtype=torch.bfloat16)
    table32[:16] = table.to(torch.bfloat16)
    tensors = {"codes": codes, "table": table32, "scales": gs.scale.float().contiguous()}
    if gs.zero is not None:
        tensors["szs"] = (gs.scale.double() * gs.zero.double()).float().contiguous()
    params = _struct(tensors, n, k, groups, bpg)
    if prefill is None:
        from lowbit.kernels import cpu_bf16

        bf16_plan = cpu_bf16.plan(qt)
        prefill = cpu_bf16.prepare(qt, bf16_plan) if bf16_plan is not None else None
    params["prefill"] = prefill
    return PreparedWeight(path=PATH, shape=(n, k), label=qt.spec.label, device=torch.device("cpu"), tensors=tensors, params=params)


def concat(parts: list[PreparedWeight]) -> PreparedWeight:
    """One prepared weight whose output rows are those of `parts`, in order (same K and grouping)."""
    first = parts[0]
    k = first.shape[1]
    if any(p.path != PATH or p.shape[1] != k or p.params["bpg"] != first.params["bpg"]
           or p.params["groups"] != first.params["groups"] or not torch.equal(p.tensors["table"], first.tensors["table"])
           for p in parts):
        raise ValueError("only int4dot weights with the same input width, grouping and code table can be joined")
    n = sum(p.shape[0] for p in parts)
    tensors = {
        "codes": torch.cat([p.tensors["codes"] for p in parts]).contiguous(),
        "table": first.tensors["table"],
        "scales": torch.cat([p.tensors["scales"] for p in parts]).contiguous(),
    }
    if any("szs" in p.tensors for p in parts):
        tensors["szs"] = torch.cat([p.tensors.get("szs", torch.zeros_like(p.tensors["scales"])) for p in parts]).contiguous()
    params = _struct(tensors, n, k, first.params["groups"], first.params["bpg"])
    params["prefill"] = None
    prefills = [p.params.get("prefill") for p in parts]
    if all(p is not None for p in prefills):
        params["prefill_parts"] = prefills
    return PreparedWeight(path=PATH, shape=(n, k), label=first.label, device=torch.device("cpu"), tensors=tensors, params=params)


def _prefill(x: torch.Tensor, pw: PreparedWeight, out_dtype: torch.dtype) -> torch.Tensor:
    from lowbit.kernels import cpu_bf16

    parts = pw.params.get("prefill_parts") or ([pw.params["prefill"]] if pw.params.get("prefill") is not None else None)
    if parts is None:
        # No bf16 plan: run the fused kernel over slices of rows (still correct, just slower).
        return torch.cat([matmul(x[i : i + FUSED_MAX_ROWS], pw, out_dtype) for i in range(0, x.shape[0], FUSED_MAX_ROWS)])
    # bf16 activations: bf16 weights and GEMM (torch's int4 op's precision); float32: exact weights
    pair = x.dtype != torch.bfloat16
    ys = [cpu_bf16.prefill_matmul(x, p, out_dtype, pair=pair) for p in parts]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def matmul(x: torch.Tensor, pw: PreparedWeight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] in out_dtype (float32 or bf16) for a 2-D x [M, K] (float32 or bf16; others are cast)."""
    m = x.shape[0]
    if m > FUSED_MAX_ROWS:
        return _prefill(x, pw, out_dtype)
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _fused(x, pw, out_dtype == torch.bfloat16)


def _fused(x: torch.Tensor, pw: PreparedWeight, out_bf16: bool) -> torch.Tensor:
    # A decode step makes ~120 of these calls, so this stays a few attribute lookups and one
    # ctypes call (~3 us of Python per call; the old route through dispatch cost ~10 us).
    n = pw.shape[0]
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    rc = (_LIB or load_library()).lowbit_i4_matmul(pw.params["ref"], x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), m,
                               y.data_ptr(), out_bf16, n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_i4_matmul failed with code {rc}")
    return y


def decode_matmul(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """qmatmul's fast path for a weight on this path without bias: x [..., K] bf16 or float32,
    y [..., N] in x's dtype (bf16 rounded once in C)."""
    k = pw.shape[1]
    if x.shape[-1] != k:
        raise LowbitError(f"matmul input has {x.shape[-1]} features but the {pw.label} weight expects {k}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.shape[0] > FUSED_MAX_ROWS or x2.shape[0] == 0 or x2.stride(-1) != 1:
        return None
    y = _fused(x2, pw, x.dtype == torch.bfloat16)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], pw.shape[0])
