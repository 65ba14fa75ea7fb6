"""Triton kernel for y = x · dequant(W)ᵀ, straight from lowbit's packed codes, for every format.

One kernel serves all formats because every format decodes the same way once its facts are
read from the format layer (kernels/layout.py): element code c (a `bits`-wide field of the
little-endian bit stream of row n, or one byte for 8-bit formats) is worth table[c], and
w[n, k] = (table[c] - zero[n, j]) * scale[n, j] for j = k // group. The table (2**bits
float32 values) holds int codes minus their zero point, NF4's code book, E2M1 or FP8 values.
Scales are float32 [N, G], or for formats with one-byte scale codes (E8M0, E4M3) the stored
bytes plus a 256-entry value table, so nvfp4/mxfp4 read what they store.

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
    params = {"bits": bits, "group": gs.group_size, "groups": gs.scale.shape[1], "row_bytes": codes.shape[1]}
    return PreparedWeight(path="triton", shape=(n, k), label=cpu.spec.label, device=torch.device(device), tensors=tensors, params=params)


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
    scales = t["scales"]
    _qmm_kernel[grid](
        x, t["codes"], t["table"], scales, t.get("scale_table", scales), t.get("zeros", scales), y,
        m, n, k, p["groups"], p["group"], p["row_bytes"], x.stride(0),
        BITS=p["bits"], SCALE_CODES="scale_table" in t, HAS_ZERO="zeros" in t,
        DOT_FP32=INTERPRET or x.dtype == torch.float32, **cfg,
    )
    return y
