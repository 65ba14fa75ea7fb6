"""CPU path for 4-bit formats through bf16 dot products (native/bf16_gemv.c, AVX512-BF16).

Numbers: activations are rounded to bf16 (as torch's int4 op does); weights are NOT rounded.
prepare() checks every weight the kernel can form — each code's value times each scale in use —
and picks one of two exact representations:
  single  every weight is a bf16 number: E2M1 times a power of two (mxfp4) or times an E4M3 block
          scale (nvfp4, whose float32 global scale is applied to the output instead), integer
          codes times bf16 scales. One dot product per 32 weights and row.
  pair    otherwise (NF4's code book, float32 scales): w = hi + lo with hi = bf16(w) and
          lo = bf16(w - hi), so |w - hi - lo| <= 2^-17 |w|; two dot products.
Products and sums are float32 (vdpbf16ps flushes subnormals, so weights below 2^-100 in
magnitude, or non-finite ones, send the weight to the float32 LUT path instead). The result
therefore equals the float32 dequantize-then-matmul of bf16-rounded activations up to float32
summation order (single) or to 2^-17 relative weight error (pair).

Layout: codes in 64-element blocks of 32 bytes (byte i: element i low nibble, element 32+i high
nibble), rows and x zero-padded to whole blocks. One-byte scale codes (E8M0, E4M3) keep one
byte per group and index 256 prebuilt 16-entry bf16 weight tables (8 KiB, shared by every
weight with the same code book and scale decoding).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from lowbit.kernels import layout
from lowbit.native import bf16_gemv
from lowbit.kernels.prepared import PreparedWeight
from lowbit.quant.qtensor import QTensor

FUSED_MAX_ROWS = 16  # larger batches decode the weight to bf16 once and use torch's GEMM
FLT_SAFE_MIN = 2.0**-100  # weights this small could make vdpbf16ps' flushed subnormals matter
SINGLE_GROUP_SHIFT = 62  # "one group per row" for the kernel: k >> 62 is always group 0


class WeightStruct(ctypes.Structure):
    """The C kernel's `Weight` (native/bf16_gemv.c), built once at prepare time."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("table", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("code_tables", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("blocks", ctypes.c_int64), ("groups", ctypes.c_int64), ("row_div", ctypes.c_int64),
        ("gshift", ctypes.c_int32), ("mode", ctypes.c_int32), ("pair", ctypes.c_int32), ("post", ctypes.c_float),
    ]


def available() -> bool:
    lib = bf16_gemv.library()
    return lib is not None and lib.lowbit_bf16_available() == 1


def _group_shift(qt: QTensor, group: int) -> int | None:
    k = qt.shape[1]
    if group >= k:
        return SINGLE_GROUP_SHIFT
    if group < 16 or group & (group - 1):
        return None
    return group.bit_length() - 1


def repack64(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> [N, 32 * ceil(K / 64)]: per 64-element block, byte i = element i | element 32+i << 4."""
    n, k = codes.shape
    blocks = -(-k // 64)
    c = torch.nn.functional.pad(codes, (0, blocks * 64 - k)).reshape(n, blocks, 2, 32)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, blocks * 32).contiguous()


def _is_bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float() == v


def _safe(v: torch.Tensor) -> bool:
    a = v.abs()
    return bool(torch.isfinite(v).all() and ((a == 0) | (a >= FLT_SAFE_MIN)).all() and (a <= 3.0e38).all())


@functools.cache
def _shared_tables(table: tuple, base: tuple) -> torch.Tensor:
    """bf16 [256, 16]: table[i] * base[c] for each scale code c (cached: layers share code books)."""
    values = torch.tensor(base, dtype=torch.float32)[:, None] * torch.tensor(table, dtype=torch.float32)[None, :]
    return values.nan_to_num(0.0, 0.0, 0.0).to(torch.bfloat16).contiguous()


def _coded_plan(qt: QTensor, table: torch.Tensor) -> dict | None:
    """Byte scale codes: the 256 bf16 tables and the output multiplier, if every weight in use is exact."""
    full = layout.scale_code_table(qt)
    base = layout.scale_code_table(qt, unit_global=True)
    if full is None or base is None:
        return None
    used = torch.unique(qt.scales.cpu().contiguous().view(torch.uint8).reshape(-1)).long()
    post = 1.0
    if qt.global_scale is not None:
        # A per-tensor factor (nvfp4's global scale): the kernel multiplies the output by it.
        post = float(qt.global_scale.float().reshape(-1)[0])
        if not torch.equal((base[used] * post).float(), full[used]):
            return None
    weights = base[used][:, None] * table[None, :]
    if not (_safe(weights) and bool(_is_bf16(weights).all())):
        return None
    tables = _shared_tables(tuple(table.tolist()), tuple(base.tolist()))
    return {"code_tables": tables, "post": post}


def plan(qt: QTensor) -> dict | None:
    """How the kernel would run this weight (mode, tables, pair), or None if it cannot."""
    spec = qt.spec
    if spec.bits != 4 or not available():
        return None
    gs = layout.group_scales(qt)
    shift = _group_shift(qt, gs.group_size)
    if shift is None:
        return None
    table = layout.code_table(qt)
    if gs.zero is None:
        coded = _coded_plan(qt, table)
        if coded is not None:
            return {"mode": 1, "shift": shift, "pair": 0, "table": table, **coded}
    values = table[None, None, :]
    if gs.zero is not None:
        values = values - gs.zero.float()[..., None]
    values = values * gs.scale.float()[..., None]
    if not _safe(values):
        return None
    pair = 0 if bool(_is_bf16(values).all()) else 1
    if pair and shift == 4:
        return None  # pair tables for two 16-wide groups would need 64 entries; the LUT path runs these
    return {"mode": 0, "shift": shift, "pair": pair, "table": table, "post": 1.0}


def supports(qt: QTensor) -> bool:
    return plan(qt) is not None


def prepare(qt: QTensor, p: dict | None = None) -> PreparedWeight:
    """Repack for the kernel; `p` is plan(qt) when the caller already has it."""
    qt = qt.to("cpu")
    n, k = qt.shape
    p = p or plan(qt)
    if p is None:
        raise ValueError(f"{qt.spec.label}: the bf16 kernel cannot run this weight")
    gs = layout.group_scales(qt)
    codes = repack64(layout.codes(qt))
    tensors = {"codes": codes, "table": p["table"].contiguous()}
    if p["mode"] == 1:
        tensors["scales"] = qt.scales.contiguous().view(torch.uint8)
        tensors["code_tables"] = p["code_tables"]
    else:
        tensors["scales"] = gs.scale.float().contiguous()
    if gs.zero is not None:
        tensors["zeros"] = gs.zero.float().contiguous()
    rows = tensors["scales"].shape[0]
    blocks = codes.shape[1] // 32
    ptr = lambda name: tensors[name].data_ptr() if name in tensors else None  # noqa: E731
    struct = WeightStruct(
        ptr("codes"), codes.shape[1], ptr("table"), ptr("scales"), ptr("code_tables"), ptr("zeros"),
        n, blocks, gs.scale.shape[1], n // rows, p["shift"], p["mode"], p["pair"], p["post"],
    )
    # The struct holds raw pointers into `tensors`, which the PreparedWeight keeps alive.
    params = {"struct": struct, "ref": ctypes.byref(struct), "blocks": blocks, "pair": p["pair"], "mode": p["mode"], "post": p["post"]}
    return PreparedWeight(path="cpu-bf16", shape=(n, k), label=qt.spec.label, device=torch.device("cpu"), tensors=tensors, params=params)


def dequantize(pw: PreparedWeight, part: int = 0) -> torch.Tensor:
    """bf16 [N, K]: the weights (part 0; hi in pair mode) or the pair's lo parts (part 1), before `post`."""
    n, k = pw.shape
    width = pw.params["blocks"] * 64
    w = torch.empty(n, width, dtype=torch.bfloat16)
    rc = bf16_gemv.library().lowbit_bf16_dequant(pw.params["ref"], w.data_ptr(), width, part, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_bf16_dequant failed with code {rc}")
    return w[:, :k]


def prefill_matmul(x: torch.Tensor, pw: PreparedWeight, out_dtype: torch.dtype = torch.float32, pair: bool = True) -> torch.Tensor:
    """Large M: decode the weight once into a temporary matrix and run torch's GEMM on it.

    Single mode: bf16 GEMM (float32 accumulation, y rounded to bf16, as torch's int4 op rounds it).
    Pair mode: hi + lo summed into a float32 weight and a float32 GEMM, so nothing is rounded
    beyond the pair's 2^-17 (unless `pair` is False: hi only, weights rounded to bf16).
    """
    if pw.params["pair"] and pair:
        w = dequantize(pw, 0).float() + dequantize(pw, 1).float()
        y = torch.nn.functional.linear(x.float(), w)
    else:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), dequantize(pw, 0))
    if pw.params["post"] != 1.0:
        y = y.float() * pw.params["post"]
    return y.to(out_dtype)


def matmul(x: torch.Tensor, pw: PreparedWeight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] in out_dtype (float32 or bf16) for a 2-D x [M, K] of any float dtype (rounded to bf16)."""
    n, k = pw.shape
    m = x.shape[0]
    if m > FUSED_MAX_ROWS:
        # Prefill: decode the weight once into a temporary bf16 matrix and run torch's bf16 GEMM
        # (float32 accumulation), one per part in pair mode; the decode is amortised over M rows.
        return prefill_matmul(x, pw, out_dtype)
    width = pw.params["blocks"] * 64
    # Rows of x 4 KiB apart would share L1 sets (and alias 4 KiB load checks) when several are
    # read per weight block: give them a 64-byte offset.
    ldx = width + 32 if m > 1 and width % 2048 == 0 else width
    xb = x.to(torch.bfloat16)
    if ldx != k:
        xb = torch.nn.functional.pad(xb, (0, ldx - k))
    xb = xb.contiguous()
    out_bf16 = out_dtype == torch.bfloat16
    y = torch.empty(m, n, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    rc = bf16_gemv.library().lowbit_bf16_matmul(pw.params["ref"], xb.data_ptr(), ldx, m, y.data_ptr(), int(out_bf16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_bf16_matmul failed with code {rc}")
    return y
