"""The one entry point for quantized matmul: `prepare` at load time, `qmatmul` in forward.

Path choice (first that applies):
  CUDA device                                  triton      (kernels/triton_qmm.py)
  CPU with AVX512-BF16 or -VNNI, integer 4-bit
  codes, groups of 64k or one per row         cpu-int4dot (kernels/cpu_int4dot.py, batch-invariant)
  CPU, int4 with a group torch's op accepts    cpu-int4    (kernels/cpu.py, torch's int4 op)
  CPU, per-channel int8                        cpu-int8    (kernels/cpu.py, torch's int8 op)
  CPU with AVX512-BF16, other 4-bit formats    cpu-bf16    (kernels/cpu_bf16.py, bf16 dot products)
  CPU, any 4-bit or 8-bit format               cpu-lut     (kernels/cpu_lut.py, compiled C kernel)
  anything else (int2/3/5/6 on CPU, no compiler) reference   (kernels/reference.py)
  only when named: 8-bit integer codes with int8 activations (AVX512-VNNI, W8A8)
                                               cpu-int8dot (kernels/cpu_int4dot.py)
`LOWBIT_KERNEL` (or the `path` argument) forces one: reference | cpu | cpu-int4dot | cpu-int4 | cpu-int8 |
cpu-bf16 | cpu-lut | cpu-int8dot | triton ("cpu" means the best CPU path); a forced path that cannot run this weight
raises a one-line LowbitError instead of silently running another.
"""

from __future__ import annotations

import os

import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.kernels import cpu, cpu_bf16, cpu_int4dot, cpu_lut
from lowbit.kernels.prepared import PreparedWeight
from lowbit.kernels.reference import reference_matmul
from lowbit.quant.qtensor import QTensor

PATHS = ("reference", "cpu", "cpu-int4dot", "cpu-int4", "cpu-int8", "cpu-bf16", "cpu-lut", "cpu-int8dot", "triton")
ENV = "LOWBIT_KERNEL"


def _requested(path: str | None) -> str | None:
    path = path or os.environ.get(ENV) or None
    if path is not None and path not in PATHS:
        raise UsageError(f"unknown kernel path '{path}' (choose from {', '.join(PATHS)}; set by {ENV} or argument)")
    return path


_CPU_CHECKS = (
    ("cpu-int4dot", cpu_int4dot.supports),
    ("cpu-int4", lambda qt: cpu.int4_group(qt) is not None),
    ("cpu-int8", cpu.int8_channel),
    ("cpu-bf16", cpu_bf16.supports),
    ("cpu-lut", cpu_lut.supports),
    ("cpu-int8dot", cpu_int4dot.supports_int8),  # only when asked for: it rounds activations to int8
)


def _cpu_candidates(qt: QTensor, first_only: bool = False) -> list[str]:
    """CPU paths that can run this weight, best first (only the best with first_only: the checks
    decode scales and are not free at load time)."""
    out = []
    for name, ok in _CPU_CHECKS:
        if ok(qt):
            out.append(name)
            if first_only:
                break
    return out


def choose_path(qt: QTensor, device: torch.device | str, path: str | None = None) -> str:
    """Which path `prepare` will use for this weight on this device."""
    device = torch.device(device)
    want = _requested(path)
    if want == "reference":
        return "reference"
    if device.type == "cuda":
        if want not in (None, "triton"):
            raise LowbitError(f"kernel path '{want}' runs on CPU, but the weight is on {device}")
        return "triton"
    if want == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise LowbitError("kernel path 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        return "triton"
    if want in (None, "cpu"):
        best = _cpu_candidates(qt, first_only=True)
        return best[0] if best else "reference"
    candidates = _cpu_candidates(qt)
    if want not in candidates:
        raise LowbitError(f"kernel path '{want}' cannot run {qt.spec.label} {qt.shape[0]}x{qt.shape[1]} on this machine")
    return want


def prepare(qt: QTensor, device: torch.device | str = "cpu", path: str | None = None) -> PreparedWeight:
    """Repack a loaded QTensor once for the matmul path chosen on `device` (never saved to disk)."""
    device = torch.device(device)
    chosen = choose_path(qt, device, path)
    if chosen == "triton":
        from lowbit.kernels import triton_qmm  # imported late: TRITON_INTERPRET is read at import

        return triton_qmm.prepare(qt, device)
    if chosen in ("cpu-int4dot", "cpu-int8dot"):
        return cpu_int4dot.prepare(qt)
    if chosen == "cpu-int4":
        return cpu.prepare_int4(qt)
    if chosen == "cpu-int8":
        return cpu.prepare_int8(qt)
    if chosen == "cpu-bf16":
        return cpu_bf16.prepare(qt)
    if chosen == "cpu-lut":
        return cpu_lut.prepare(qt)
    return PreparedWeight(path="reference", shape=qt.shape, label=qt.spec.label, device=device, qt=qt.to(device))


_MATMULS = {
    "cpu-int4dot": cpu_int4dot.matmul,
    "cpu-int8dot": cpu_int4dot.matmul,
    "cpu-int4": cpu.matmul_int4,
    "cpu-int8": cpu.matmul_int8,
    "cpu-bf16": cpu_bf16.matmul,
    "cpu-lut": cpu_lut.matmul,
}


def qmatmul(x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] in bf16/fp16/fp32; y has x's dtype."""
    if (prepared.path == "cpu-int4dot" or prepared.path == "cpu-int8dot") and bias is None and (
            x.dtype is torch.bfloat16 or x.dtype is torch.float32):
        y = cpu_int4dot.decode_matmul(x, prepared)
        if y is not None:
            return y
    n, k = prepared.shape
    if x.shape[-1] != k:
        raise LowbitError(f"matmul input has {x.shape[-1]} features but the {prepared.label} weight expects {k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LowbitError(f"quantized matmul takes bf16, fp16 or fp32 inputs, not {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if prepared.path == "reference":
        y = reference_matmul(x2, prepared.qt)
    elif prepared.path == "triton":
        from lowbit.kernels import triton_qmm

        y = triton_qmm.matmul(x2, prepared)
    elif x2.shape[0] == 0:
        y = x2.new_zeros(0, n)
    elif (prepared.path == "cpu-int4dot" or prepared.path == "cpu-int8dot") and bias is None:
        # float32 or bf16 y straight from C (bf16 rounded once); fp16 inputs come back as float32
        out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        return cpu_int4dot.matmul(x2, prepared, out).to(x.dtype).reshape(*lead, n)
    elif prepared.path == "cpu-bf16" and bias is None and x.dtype == torch.bfloat16:
        return cpu_bf16.matmul(x2, prepared, torch.bfloat16).reshape(*lead, n)  # rounded once, in C
    else:
        y = _MATMULS[prepared.path](x2, prepared)
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype).reshape(*lead, n)
