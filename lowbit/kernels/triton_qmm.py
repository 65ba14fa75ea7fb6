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
def _qmm_kernel(
    x_ptr, codes_ptr, table_ptr, scales_ptr, scale_table_ptr, zeros_ptr, y_ptr,
    M, N, K, G, GROUP, ROW_BYTES, stride_xm,
    BITS: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    for step in range(pid_k * steps_per_split, tl.minimum((pid_k + 1) * steps_per_split, k_steps)):
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
    out = y_ptr + rm[:, None] * N + rn[None, :]
    omask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=omask)
    else:
        tl.atomic_add(out, acc, mask=omask)


@triton.jit
def _decode(c, table_ptr, TABLE_OFFSET, TABLE_STEP, AFFINE: tl.constexpr):
    if AFFINE:  # int codes: value = offset + step * code, no table read
        return c.to(tl.float32) * TABLE_STEP + TABLE_OFFSET
    return tl.load(table_ptr + c)


@triton.jit
def _packed_part(acc_part, x_ptr, rm, m_ok, stride_xm, ke, ke_ok, c, rn, n_ok, g_elem, table_ptr,
                 TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                 AFFINE: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr,
                 STEP_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc_part + x[:, ke] . w[rn, ke]^T for one set of columns ke and their codes c [BLOCK_N, len(ke)];
    with STEP_SCALE the scale is left out (the caller applies it per step)."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=m_ok[:, None] & ke_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    w = _decode(c, table_ptr, TABLE_OFFSET, TABLE_STEP, AFFINE)
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


@triton.jit
def _qmm_packed_kernel(
    x_ptr, codes_ptr, table_ptr, scales_ptr, scale_table_ptr, zeros_ptr, y_ptr,
    M, N, K, G, GROUP, ROW_BYTES, stride_xm, TABLE_OFFSET, TABLE_STEP,
    BITS: tl.constexpr, SCALE_CODES: tl.constexpr, HAS_ZERO: tl.constexpr, DOT_FP32: tl.constexpr,
    AFFINE: tl.constexpr, STEP_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    for step in range(pid_k * steps_per_split, tl.minimum((pid_k + 1) * steps_per_split, k_steps)):
        k0 = step * BLOCK_K
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BITS == 4:
            j = tl.arange(0, BLOCK_K // 2)
            ke = k0 + 2 * j  # the even element of byte k0/2 + j; its odd one is ke + 1
            byte = tl.load(codes_ptr + rn[:, None] * ROW_BYTES + (k0 // 2 + j)[None, :],
                           mask=n_ok[:, None] & (ke < K)[None, :], other=0).to(tl.int32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke, ke < K, byte & 15, rn, n_ok, ke // GROUP,
                                table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                                AFFINE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke + 1, ke + 1 < K, byte >> 4, rn, n_ok,
                                (ke + 1) // GROUP, table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr,
                                zeros_ptr, G, AFFINE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
        else:  # BITS == 8
            ke = k0 + tl.arange(0, BLOCK_K)
            code = tl.load(codes_ptr + rn[:, None] * ROW_BYTES + ke[None, :],
                           mask=n_ok[:, None] & (ke < K)[None, :], other=0).to(tl.int32)
            part = _packed_part(part, x_ptr, rm, m_ok, stride_xm, ke, ke < K, code, rn, n_ok, ke // GROUP,
                                table_ptr, TABLE_OFFSET, TABLE_STEP, scales_ptr, scale_table_ptr, zeros_ptr, G,
                                AFFINE, SCALE_CODES, HAS_ZERO, STEP_SCALE, DOT_FP32)
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
    out = y_ptr + rm[:, None] * N + rn[None, :]
    omask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=omask)
    else:
        tl.atomic_add(out, acc, mask=omask)


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
              "affine": _affine(tensors["table"])}
    return PreparedWeight(path="triton", shape=(n, k), label=cpu.spec.label, device=torch.device(device), tensors=tensors, params=params)


def _affine(table: torch.Tensor) -> tuple[float, float] | None:
    """(offset, step) when table[c] == offset + step * c exactly for every code (int formats)."""
    t = table.double().cpu()
    offset, step = t[0].item(), (t[1] - t[0]).item()
    exact = torch.equal(t, offset + step * torch.arange(t.numel(), dtype=torch.float64))
    return (offset, step) if exact else None


def _default_config(m: int, n: int, k: int, device: torch.device) -> dict:
    if INTERPRET:  # few, big programs: the interpreter costs per program and per K step
        return {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2 if m <= 16 else 1}
    if m <= DECODE_MAX_ROWS:
        block_n, block_k = 64, 128
        tiles = triton.cdiv(n, block_n)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        split = max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(k, block_k), 16))
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
    if INTERPRET:
        cfg.pop("num_warps", None)  # a launch option of the compiler, which the interpreter does not take
    scales = t["scales"]
    args = (x, t["codes"], t["table"], scales, t.get("scale_table", scales), t.get("zeros", scales), y,
            m, n, k, p["groups"], p["group"], p["row_bytes"], x.stride(0))
    flags = dict(BITS=p["bits"], SCALE_CODES="scale_table" in t, HAS_ZERO="zeros" in t,
                 DOT_FP32=INTERPRET or x.dtype == torch.float32)
    if p["bits"] in (4, 8):
        affine = p.get("affine")
        # one scale per row and K step: the group holds whole steps, or the row is one group
        step_scale = p["group"] % cfg["BLOCK_K"] == 0 or p["groups"] == 1
        _qmm_packed_kernel[grid](*args, *(affine or (0.0, 0.0)), **flags, AFFINE=affine is not None,
                                 STEP_SCALE=step_scale, **cfg)
    else:
        _qmm_kernel[grid](*args, **flags, **cfg)
    return y
