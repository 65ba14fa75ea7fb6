"""Triton kernel for y = x · dequant(W)ᵀ, straight from lowbit's packed codes, for every format.

One kernel serves all formats because every format decodes the same way once its facts are
read from the format layer (kernels/layout.py): element code c (a `bits`-wide field of the
little-endian bit stream of row n, or one byte for 8-bit formats) is worth table[c], and
w[n, k] = (table[c] - zero[n, j]) * scale[n, j] for j = k // group. The table (2**bits
float32 values) holds int codes minus their zero point, NF4's code book, E2M1 or FP8 values.
Scales are float32 [N, G], or for formats with one-byte scale codes (E8M0, E4M3) the stored
bytes plus a 256-entry value table, so nvfp4/mxfp4 read what they store.

Two kernels. `_qmm_packed_kernel` serves 4- and 8-bit codes (every format but int2/3/5/6): it
loads each row's bytes once and contiguously, splits a 4-bit byte into its even (low nibble) and
odd (high nibble) elements and dots them with the even and odd columns of x, decodes codes
arithmetically when the format's table is affine (int codes) and through the table otherwise,
and, when a K step lies inside one scale group, applies the row's scale (and zero point) once
per step instead of per element. `_qmm_kernel` is the general one (any bit width, a field may
straddle bytes): one gather per element for the code, its value, its scale. The first GPU check
measured the general kernel at 0.03-0.05x torch's bf16 matmul at 1-16 rows, 20-40 GB/s of
the H200's 4.2 TB/s: element gathers, not bytes, bound it.

Two launch shapes: decode (M <= 16) uses a 16-row tile and splits K across programs with an
fp32 atomic add so a single token still fills the GPU; prefill uses larger M/N tiles and no
split. Both accumulate in fp32. Ragged groups and ragged N/K are masked inside the kernel;
nothing is padded in memory. Under TRITON_INTERPRET=1 (CI) every value is converted to fp32
right after loading, because the interpreter computes bf16 wrongly.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from lowbit.kernels import layout
from lowbit.kernels.prepared import PreparedWeight
from lowbit.quant.qtensor import QTensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DECODE_MAX_ROWS = 16


@triton.jit
def _tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's output rows and columns (with their bounds masks) and its share of the K steps."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    first = tl.program_id(2) * steps_per_split
    return rm, rn, rm < M, rn < N, first, tl.minimum(first + steps_per_split, k_steps)


@triton.jit
def _store(y_ptr, acc, rm, rn, m_ok, n_ok, N, SPLIT_K: tl.constexpr):
    """The tile into y: stored, or added when K is split across programs."""
    out = y_ptr + rm[:, None] * N + rn[None, :]
    omask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=omask)
    else:
        tl.atomic_add(out, acc, mask=omask)


# M is the batch's row count, different nearly every call: compiled once for all M (Triton would
# otherwise specialise on M == 1 and on M % 16 and compile again mid-serving)
@triton.jit(do_not_specialize=["M"])
def _qmm_kernel(
    x_ptr, codes_ptr, table_ptr, scales_ptr, scale_table_ptr, zeros_ptr, y_ptr,
    M, N, K, G, GROUP, ROW_BYTES, stride_xm,
    BITS: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    rm, rn, m_ok, n_ok, first_step, end_step = _tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_step, end_step):
        rk = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        wmask = n_ok[:, None] & k_ok[None, :]
        if BITS == 8:
            code = tl.load(codes_ptr + rn[:, None] * ROW_BYTES + rk[None, :], mask=wmask, other=0).to(tl.int32)
        else:
            bit = rk * BITS
            byte = bit // 8
            shift = bit % 8
            row = codes_ptr + rn[:, None] * ROW_BYTES
            word = tl.load(row + byte[None, :], mask=wmask, other=0).to(tl.int32)
            if BITS == 3 or BITS == 5 or BITS == 6:  # such a field can straddle two bytes
                nxt = tl.load(row + byte[None, :] + 1, mask=wmask & (byte[None, :] + 1 < ROW_BYTES), other=0)
                word = word | (nxt.to(tl.int32) << 8)
            code = (word >> shift[None, :]) & ((1 << BITS) - 1)
        w = tl.load(table_ptr + code, mask=wmask, other=0.0)
        gidx = rn[:, None] * G + (rk // GROUP)[None, :]
        if SCALE_CODES:
            scode = tl.load(scales_ptr + gidx, mask=wmask, other=0).to(tl.int32)
            s = tl.load(scale_table_ptr + scode, mask=wmask, other=0.0)
        else:
            s = tl.load(scales_ptr + gidx, mask=wmask, other=0.0)
        if HAS_ZERO:
            w = w - tl.load(zeros_ptr + gidx, mask=wmask, other=0.0)
        w = tl.where(wmask, w * s, 0.0)
        if DOT_FP32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    _store(y_ptr, acc, rm, rn, m_ok, n_ok, N, SPLIT_K)


# How the packed kernel turns an element code into its value at scale 1 (prepare picks the first
# that reproduces the format's table exactly; a table read per element is the slow last resort).
DECODE_TABLE, DECODE_AFFINE, DECODE_SELECT16, DECODE_E4M3, DECODE_E5M2 = range(5)


@triton.jit
def _select16(c, table_ptr):
    """table[c] for 4-bit codes from 16 values held in registers: a 4-level tree of selects on the
    code's bits instead of a memory read per element (NF4's code book, E2M1)."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    b3 = (c & 8) != 0
    t = table_ptr
    v0 = tl.where(b1, tl.where(b0, tl.load(t + 3), tl.load(t + 2)), tl.where(b0, tl.load(t + 1), tl.load(t + 0)))
    v1 = tl.where(b1, tl.where(b0, tl.load(t + 7), tl.load(t + 6)), tl.where(b0, tl.load(t + 5), tl.load(t + 4)))
    v2 = tl.where(b1, tl.where(b0, tl.load(t + 11), tl.load(t + 10)), tl.where(b0, tl.load(t + 9), tl.load(t + 8)))
    v3 = tl.where(b1, tl.where(b0, tl.load(t + 15), tl.load(t + 14)), tl.where(b0, tl.load(t + 13), tl.load(t + 12)))
    return tl.where(b3, tl.where(b2, v3, v2), tl.where(b2, v1, v0))


@triton.jit
def _decode(c, table_ptr, TABLE_OFFSET, TABLE_STEP, DECODE: tl.constexpr):
    if DECODE == 1:  # int codes: value = offset + step * code, no table read
        return c.to(tl.float32) * TABLE_STEP + TABLE_OFFSET
    elif DECODE == 2:
        return _select16(c, table_ptr)
    elif DECODE == 3:  # the code is an OCP E4M3 byte: the hardware converts it
        return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif DECODE == 4:
        return c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        return tl.load(table_ptr + c)


@triton.jit
def _packed_part(acc_part, x_ptr, rm, m_ok, stride_xm, ke, ke_ok, c, rn, n_ok, g_elem, table_ptr,
                 TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                 DECODE: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr,
                 STEP_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc_part + x[:, ke] . w[rn, ke]^T for one set of columns ke and their codes c [BLOCK_N, len(ke)];
    with STEP_SCALE the scale is left out (the caller applies it per step)."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=m_ok[:, None] & ke_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    w = _decode(c, table_ptr, TABLE_OFFSET, TABLE_STEP, DECODE)
    if not STEP_SCALE:
        wmask = n_ok[:, None] & ke_ok[None, :]
        gidx = rn[:, None] * G + g_elem[None, :]
        if HAS_ZERO:
            w = w - tl.load(zeros_ptr + gidx, mask=wmask, other=0.0)
        if SCALE_CODES:
            scode = tl.load(scales_ptr + gidx, mask=wmask, other=0).to(tl.int32)
            w = w * tl.load(scale_table_ptr + scode, mask=wmask, other=0.0)
        else:
            w = w * tl.load(scales_ptr + gidx, mask=wmask, other=0.0)
        w = tl.where(wmask, w, 0.0)
    if DOT_FP32:
        return acc_part + tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc_part + tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit(do_not_specialize=["M"])
def _qmm_packed_kernel(
    x_ptr, codes_ptr, table_ptr, scales_ptr, scale_table_ptr, zeros_ptr, y_ptr,
    M, N, K, G, GROUP, ROW_BYTES, stride_xm, TABLE_OFFSET, TABLE_STEP,
    BITS: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    DECODE: tl.constexpr, STEP_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    rm, rn, m_ok, n_ok, first_step, end_step = _tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_step, end_step):
        k0 = step * BLOCK_K
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            ke = k0 + 2 * j  # the even element of byte k0/2 + j; its odd one is ke + 1
            byte = tl.load(codes_ptr + rn[:, None] * ROW_BYTES + (k0 // 2 + j)[None, :],
                           mask=n_ok[:, None] & (ke < K)[None, :], other=0).to(tl.int32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke, ke < K, byte & 15, rn, n_ok, ke // GROUP,
                                table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                                DECODE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke + 1, ke + 1 < K, byte >> 4, rn, n_ok,
                                (ke + 1) // GROUP, table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr,
                                zeros_ptr, G, DECODE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
        else:  # BITS == 8
            ke = k0 + tl.arange(0, BLOCK_K)
            code = tl.load(codes_ptr + rn[:, None] * ROW_BYTES + ke[None, :],
                           mask=n_ok[:, None] & (ke < K)[None, :], other=0).to(tl.int32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke, ke < K, code, rn, n_ok, ke // GROUP,
                                table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                                DECODE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
        if STEP_SCALE:
            # the step lies in one group g of every row: dot(x, (v - z) * s) = (dot(x, v) - z * sum(x)) * s
            gidx = rn * G + k0 // GROUP
            if SCALE_CODES:
                s = tl.load(scale_table_ptr + tl.load(scales_ptr + gidx, mask=n_ok, other=0).to(tl.int32), mask=n_ok, other=0.0)
            else:
                s = tl.load(scales_ptr + gidx, mask=n_ok, other=0.0)
            if HAS_ZERO:
                ks = k0 + tl.arange(0, BLOCK_K)
                xs = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
                if not DOT_FP32:  # the dot saw bf16 x: the sum takes the same values
                    xs = xs.to(tl.bfloat16)
                xsum = tl.sum(xs.to(tl.float32), axis=1)
                z = tl.load(zeros_ptr + gidx, mask=n_ok, other=0.0)
                part = part - xsum[:, None] * z[None, :]
            acc += part * s[None, :]
        else:
            acc += part
    _store(y_ptr, acc, rm, rn, m_ok, n_ok, N, SPLIT_K)


def prepare(qt: QTensor, device: torch.device) -> PreparedWeight:
    """Move the packed codes to the device as stored (8-bit: as unsigned codes) with decoded tables."""
    cpu = qt.to("cpu")
    n, k = cpu.shape
    gs = layout.group_scales(cpu)
    bits = cpu.spec.bits
    if bits == 8:
        codes = layout.codes(cpu).contiguous()  # unsigned codes, whatever the stored sign convention
    else:
        codes = cpu.qweight.contiguous()
    tensors = {"codes": codes, "table": layout.code_table(cpu).contiguous()}
    scale_values = layout.scale_code_table(cpu)
    if scale_values is not None:
        tensors["scales"] = cpu.scales.contiguous().view(torch.uint8)
        tensors["scale_table"] = scale_values.contiguous()
    else:
        tensors["scales"] = gs.scale.float().contiguous()
    if gs.zero is not None:
        tensors["zeros"] = gs.zero.float().contiguous()
    tensors = {name: t.to(device) for name, t in tensors.items()}
    params = {"bits": bits, "group": gs.group_size, "groups": gs.scale.shape[1], "row_bytes": codes.shape[1],
              **_decoding(tensors["table"], bits, _has_fp8(torch.device(device)))}
    return PreparedWeight(path="triton", shape=(n, k), label=cpu.spec.label, device=torch.device(device), tensors=tensors, params=params)


def _has_fp8(device: torch.device) -> bool:
    """Triton converts FP8 bytes in hardware from compute capability 8.9 (Ada, Hopper) on."""
    if device.type != "cuda" or INTERPRET:
        return INTERPRET
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _decoding(table: torch.Tensor, bits: int, fp8_hardware: bool = True) -> dict:
    """The packed kernel's DECODE mode for a code table, and the affine mode's (offset, step)."""
    t = table.double().cpu()
    offset, step = t[0].item(), (t[1] - t[0]).item()
    if torch.equal(t, offset + step * torch.arange(t.numel(), dtype=torch.float64)):
        return {"decode": DECODE_AFFINE, "affine": (offset, step)}
    if bits == 8 and fp8_hardware:
        every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        for mode, dtype in ((DECODE_E4M3, torch.float8_e4m3fn), (DECODE_E5M2, torch.float8_e5m2)):
            if _same_values(t, every_byte.view(dtype).double()):
                return {"decode": mode, "affine": (0.0, 0.0)}
    if bits == 4:
        return {"decode": DECODE_SELECT16, "affine": (0.0, 0.0)}
    return {"decode": DECODE_TABLE, "affine": (0.0, 0.0)}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other is NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    # asked once per device: a decode step calls matmul hundreds of times
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_config(m: int, n: int, k: int, device: torch.device) -> dict:
    if INTERPRET:  # few, big programs: the interpreter costs per program and per K step
        return {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2 if m <= 16 else 1}
    if m <= DECODE_MAX_ROWS:
        block_n, block_k = 64, 128
        tiles, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        sms = _multiprocessors(device)
        # bench/triton_sweep.py on an H200 (int4, 1 and 16 rows): K split in 8 beat the old
        # "2 programs per SM" rule's 5 (4096x4096: 72 vs 93 us) and 2 (14336x4096: 74 vs 86 us);
        # a power of two divides the K steps evenly
        split = 8
        while split > 1 and (split > k_steps or tiles * split > 16 * sms):
            split //= 2
        return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1}


def matmul(x: torch.Tensor, pw: PreparedWeight, config: dict | None = None) -> torch.Tensor:
    """float32 y [M, N] for a 2-D x [M, K] on the weight's device."""
    n, k = pw.shape
    m = x.shape[0]
    x = x.contiguous()
    cfg = dict(config or _default_config(m, n, k, x.device))
    t, p = pw.tensors, pw.params
    y = (torch.zeros if cfg["SPLIT_K"] > 1 else torch.empty)(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    if INTERPRET:  # launch options of the compiler, which the interpreter does not take
        cfg.pop("num_warps", None)
        cfg.pop("num_stages", None)
    scales = t["scales"]
    args = (x, t["codes"], t["table"], scales, t.get("scale_table", scales), t.get("zeros", scales), y,
            m, n, k, p["groups"], p["group"], p["row_bytes"], x.stride(0))
    flags = dict(BITS=p["bits"], SCALE_CODES="scale_table" in t, HAS_ZERO="zeros" in t,
                 DOT_FP32=INTERPRET or x.dtype == torch.float32)
    if p["bits"] in (4, 8):
        # one scale per row and K step: the group holds whole steps, or the row is one group
        step_scale = p["group"] % cfg["BLOCK_K"] == 0 or p["groups"] == 1
        _qmm_packed_kernel[grid](*args, *p["affine"], **flags, DECODE=p["decode"], STEP_SCALE=step_scale, **cfg)
    else:
        if not INTERPRET and m > DECODE_MAX_ROWS:
            # the general kernel's prefill tile staged 3 deep took 240 KB of shared memory (int3/int6
            # on an H200, over its 227 KB): 2 stages fit
            cfg.setdefault("num_stages", 2)
        _qmm_kernel[grid](*args, **flags, **cfg)
    return y
