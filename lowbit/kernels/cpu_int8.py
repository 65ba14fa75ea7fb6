"""CPU path for symmetric int8 weights with float activations (native/int8_gemv.c, AVX-512 or AVX2): cpu-int8f.

Per-channel and grouped int8 (groups a multiple of 16, the last one may be shorter; one group per
row takes any K). The stored signed codes are read as they are on disk (1 byte a weight) and the
scales are decoded once to float32 [N, G]; the kernel widens each code to float32, multiplies it
by the float32 activation (exact), sums each group in float32 and scales the sum. bf16 and fp16
activations are widened to float32 first (exact), so unlike cpu-int8 (torch's op, x rounded to
bf16) and cpu-int8dot (x rounded to int8) the only error is float32 summation.

Batch-invariant (see the C file): row i of an M-row call equals the one-row call bit for bit,
which the speculative verify relies on. Per-channel weights run the kernel for every M (prefill
too: at 2048 rows it beat torch's int8 op 1.7x here). Grouped weights run it up to
GROUPED_KERNEL_ROWS rows; above that (prefill) the weight is dequantized to float32 once per call
and torch's float32 matmul runs (what cpu-lut does; the kernel's per-group totals made it 1.7x
slower than that at 2048 rows), so only there rows are not bit-identical to one-row calls.
"""

from __future__ import annotations

import torch

from lowbit.kernels import layout, scratch
from lowbit.kernels.prepared import PreparedWeight, placed
from lowbit.native import int8_gemv
from lowbit.quant.qtensor import QTensor

PATH = "cpu-int8f"
GROUP_MULTIPLE = 16
GROUPED_KERNEL_ROWS = 64  # grouped weights: batch-invariant C kernel up to this many rows
_LIB = None


def available() -> bool:
    """The kernel built here with AVX-512, or its AVX2 section (8-lane sums: bits of their own)."""
    global _LIB
    lib = int8_gemv.library()
    if lib is not None and lib.lowbit_int8f_available() in (1, 2):
        _LIB = lib
        return True
    return False


def why_not(qt: QTensor) -> str | None:
    """Why the kernel cannot run this weight's format (None when it can), machine aside."""
    spec, k = qt.spec, qt.shape[1]
    if spec.bits != 8 or spec.element != "int" or not spec.symmetric:
        return f"needs symmetric integer 8-bit codes, not {spec.label}"
    if qt.qweight.dtype != torch.int8 or tuple(qt.qweight.shape) != tuple(qt.shape):
        return f"its codes are stored as {qt.qweight.dtype} {tuple(qt.qweight.shape)}, not int8 [N, K]"
    g = layout.group_scales(qt).group_size
    if g < k and g % GROUP_MULTIPLE:
        return f"groups of {g} columns (needs a multiple of {GROUP_MULTIPLE}, or one group per row)"
    return None


def supports(qt: QTensor) -> bool:
    return why_not(qt) is None and available()


def prepare(qt: QTensor) -> PreparedWeight:
    qt = qt.to("cpu")
    n, k = qt.shape
    table = layout.code_table(qt)
    # code u is worth u - 128 and is stored as the int8 u - 128 (quant/intq.py): the kernel reads
    # the stored byte as the value, so check the format still says so
    if not torch.equal(table, torch.arange(256, dtype=torch.float32) - 128):
        raise ValueError(f"{qt.spec.label}: its code table is not the signed code, which cpu-int8f reads")
    gs = layout.group_scales(qt)
    scales = gs.scale.float().reshape(n, -1).contiguous()
    if not torch.isfinite(scales).all():
        raise ValueError(f"{qt.spec.label} {n}x{k}: non-finite scales")
    groups = scales.shape[1]
    group = k if groups == 1 else gs.group_size
    return placed(PreparedWeight(
        path=PATH, shape=(n, k), label=qt.spec.label, device=torch.device("cpu"),
        tensors={"codes": qt.qweight.contiguous(), "scales": scales},
        params={"group": group, "groups": groups},
    ))


def concat(parts: list[PreparedWeight]) -> PreparedWeight:
    """One prepared weight whose output rows are those of `parts`, in order (same K and grouping):
    each output row is computed alone, so the joined matmul is bit-identical to the separate ones."""
    first = parts[0]
    k = first.shape[1]
    if any(p.path != PATH or p.shape[1] != k or p.params != first.params for p in parts):
        raise ValueError("only cpu-int8f weights with the same input width and grouping can be joined")
    return placed(PreparedWeight(
        path=PATH, shape=(sum(p.shape[0] for p in parts), k), label=first.label, device=torch.device("cpu"),
        tensors={name: torch.cat([p.tensors[name] for p in parts]) for name in ("codes", "scales")},
        params=dict(first.params),
    ))


def rows(pw: PreparedWeight, start: int, n: int) -> PreparedWeight | None:
    """Output rows start..start+n-1 of pw as a weight of their own whose codes and scales are views
    of pw's rows (no copy), or None for rows outside pw."""
    if n <= 0 or start < 0 or start + n > pw.shape[0]:
        return None
    tensors = {name: t[start : start + n] for name, t in pw.tensors.items()}
    return PreparedWeight(path=pw.path, shape=(n, pw.shape[1]), label=pw.label, device=pw.device, tensors=tensors,
                          params=dict(pw.params))


def matmul(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """float32 y [M, N] for x [M, K] (any float dtype, widened to float32 exactly)."""
    t, p = pw.tensors, pw.params
    n, k = pw.shape
    xf = x if x.dtype is torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    m = xf.shape[0]
    if p["groups"] > 1 and m > GROUPED_KERNEL_ROWS:
        return xf @ dequantize(pw, scratch.buffer(n * k).view(n, k)).T
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    lib = _LIB or int8_gemv.library()
    codes = t["codes"]
    rc = lib.lowbit_int8f_matmul(codes.data_ptr(), n, k, codes.stride(0), t["scales"].data_ptr(), p["groups"], p["group"],
                                 xf.data_ptr(), xf.stride(0), m, y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_int8f_matmul failed with code {rc}")
    return y


def dequantize(pw: PreparedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] (code * scale, as the format's own float32 dequantize rounds it),
    into `out` [N, K] when given (the int8 code widens exactly inside the multiply)."""
    n, k = pw.shape
    codes, scales, group = pw.tensors["codes"], pw.tensors["scales"], pw.params["group"]
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    out.copy_(codes)  # widened in place: torch's int8 x float32 multiply into `out` took 3x longer
    if k % group == 0:  # no ragged group: a broadcast, without an [N, K] copy of the scales
        out.view(n, -1, group).mul_(scales.unsqueeze(-1))
    else:
        out.mul_(scales.repeat_interleave(group, dim=1)[:, :k])
    return out
