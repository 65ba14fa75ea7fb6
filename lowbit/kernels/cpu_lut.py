"""CPU path for every 4-bit and 8-bit format through the compiled LUT kernel (native/lut_gemv.c).

prepare: 4-bit codes are repacked so one 16-byte load yields 32 codes in element order (chunk c
of a row: byte i = element 32c+i low nibble, 32c+16+i high nibble; rows zero-padded to whole
chunks); 8-bit codes stay as stored. Scales become float32 [N, G] decoded by the format module
itself, except one-byte scale codes (E8M0, E4M3), which stay one byte and go through a 256-entry
value table, so nvfp4/mxfp4 read 4.5/4.25 bits per weight as on disk.

matmul: up to 16 rows of x run fused (the weight is decoded in registers and never written);
larger batches decode the weight once into float32 and use torch's matmul, since they are
compute-bound and the decode is amortised. Accumulation is float32 in both, so the result equals
the float32 dequantize-then-matmul up to summation order, for any activation dtype.
"""

from __future__ import annotations

import torch

from lowbit.kernels import layout, scratch
from lowbit.native import lut_gemv
from lowbit.kernels.prepared import PreparedWeight, placed
from lowbit.quant.qtensor import QTensor

FUSED_MAX_ROWS = 16
_KIND8 = {"int": 0, "e4m3": 1, "e5m2": 2}


def supports(qt: QTensor) -> bool:
    spec = qt.spec
    if spec.bits == 4:
        ok = True
    elif spec.bits == 8:
        ok = spec.element in _KIND8 and not (spec.element == "int" and qt.qweight.dtype != torch.int8)
    else:
        return False
    g = layout.group_scales(qt).group_size
    single_group = g >= qt.shape[1]
    # The kernel finds a column's group with a shift, so groups must be powers of two >= 16.
    return ok and (single_group or (g >= 16 and g & (g - 1) == 0)) and lut_gemv.library() is not None


def repack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] → [N, 16 * ceil(K / 32)] in the chunked nibble order above."""
    n, k = codes.shape
    chunks = -(-k // 32)
    c = torch.nn.functional.pad(codes, (0, chunks * 32 - k)).reshape(n, chunks, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, chunks * 16).contiguous()


def prepare(qt: QTensor) -> PreparedWeight:
    qt = qt.to("cpu")
    n, k = qt.shape
    gs = layout.group_scales(qt)
    tensors: dict[str, torch.Tensor] = {}
    params = {"bits": qt.spec.bits, "group": gs.group_size, "groups": gs.scale.shape[1], "kind": 0}
    if qt.spec.bits == 4:
        tensors["codes"] = repack4(layout.codes(qt))
        tensors["table"] = layout.code_table(qt).contiguous()
    else:
        tensors["codes"] = qt.qweight.contiguous().view(torch.uint8)
        tensors["table"] = torch.zeros(16)
        params["kind"] = _KIND8[qt.spec.element]
    code_values = layout.scale_code_table(qt)
    if code_values is not None:
        tensors["scales"] = qt.scales.contiguous().view(torch.uint8)
        tensors["scale_table"] = code_values.contiguous()
        params["scale_mode"] = 1
    else:
        tensors["scales"] = gs.scale.float().contiguous()
        params["scale_mode"] = 0
    if gs.zero is not None:
        tensors["zeros"] = gs.zero.float().contiguous()
    # placed at once inside an engine's arena (off the C heap, which long-lived arrays fragment)
    return placed(PreparedWeight(path="cpu-lut", shape=(n, k), label=qt.spec.label, device=torch.device("cpu"), tensors=tensors,
                                 params=params))


def _common_args(pw: PreparedWeight) -> list:
    t, p = pw.tensors, pw.params
    n, k = pw.shape
    scale_table = t.get("scale_table")
    zeros = t.get("zeros")
    return [
        p["bits"], p["kind"], t["codes"].data_ptr(), t["codes"].shape[1], t["table"].data_ptr(),
        t["scales"].data_ptr(), p["scale_mode"], 0 if scale_table is None else scale_table.data_ptr(),
        0 if zeros is None else zeros.data_ptr(), n, k, p["groups"], p["group"], 1,
    ]


def dequantize(pw: PreparedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K], decoded by the C kernel (into `out` [N, K] when given)."""
    n, k = pw.shape
    w = torch.empty(n, k, dtype=torch.float32) if out is None else out
    lut_gemv.library().lowbit_lut_dequant(*_common_args(pw), w.data_ptr(), k, torch.get_num_threads())
    return w


def matmul(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """float32 y [M, N] for a 2-D x [M, K] of any float dtype."""
    n, k = pw.shape
    m = x.shape[0]
    if m > FUSED_MAX_ROWS:
        return x.float() @ dequantize(pw, scratch.buffer(n * k).view(n, k)).T
    lib = lut_gemv.library()
    width = pw.tensors["codes"].shape[1] * 2 if pw.params["bits"] == 4 else k
    width = -(-width // 16) * 16
    xf = torch.nn.functional.pad(x.float(), (0, width - k)).contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.lowbit_lut_matmul(*_common_args(pw), xf.data_ptr(), width, m, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_lut_matmul failed with code {rc}")
    return y
