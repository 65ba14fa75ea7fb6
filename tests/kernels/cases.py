"""Shared test material: formats, shapes that need masking, and the float64 oracle."""

from __future__ import annotations

import torch

from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import get_format, parse_spec

# Every format and several group sizes; the shapes leave ragged groups (K=192 with g=128, like
# SmolLM2's K=576) and ragged N/K tiles.
SPECS = [
    "int4", "int4-g32", "int4-asym-g64", "int4-asym", "int4-channel", "int8", "int8-g128", "int3-asym-g32", "int2-g16", "int5-g32", "int6-asym", "int4-asym-g32-dq", "int4-g16-dq",
    "nf4", "nf4-g128", "nf4-dq", "fp8", "fp8-block128", "fp8-tensor", "fp8-e5m2", "mxfp4", "nvfp4",
]
SHAPES = [(96, 192), (33, 200)]
ROWS = (1, 3, 16, 33)


def quantized(label: str, n: int, k: int) -> QTensor:
    """A fresh random weight (a few outlier columns so scales differ) quantized to `label`."""
    w = torch.randn(n, k) * torch.rand(1, k).mul(2).add(0.1)
    spec = parse_spec(label)
    return get_format(spec).quantize(w, spec)


def oracle(x: torch.Tensor, qt: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 dequantize-then-matmul."""
    y = x.double() @ qt.dequantize(torch.float64).T
    return y if bias is None else y + bias.double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# Tolerances, as max |error| / max |y|:
#  fp32 paths: float32 accumulation over K <= 200 terms of a float32 dequantized weight — a few
#    ulps of 2^-24 times sqrt(K); 1e-5 leaves >10x margin and still catches any wrong element.
#  bf16 paths (activations, and for torch's int4/int8 ops scales and zeros, rounded to bf16):
#    each product has relative error <= ~2^-8; over K terms with mixed signs the error of y
#    relative to max|y| stays below ~2^-8 * sqrt(K) / sqrt(K) ~ 4e-3 plus the output rounding
#    2^-9; 2e-2 bounds it while a wrong group/scale/code (errors ~ 1) still fails.
FP32_TOL = 1e-5
BF16_TOL = 2e-2


def avx2_library(name: str, signatures: dict, tmp_path):
    """native/<name>.c compiled for x86-64-v3 (AVX2 + FMA, no AVX-512) into tmp_path, loaded with
    `signatures`; None when this machine cannot build or run it. On an AVX-512 machine this is how
    the tests reach the code a Zen 2/3 or laptop CPU runs."""
    import ctypes
    import subprocess
    from pathlib import Path

    from lowbit.native import build

    cc = build.compiler()
    if cc is None or " avx2 " not in f" {build._cpu_flags()} " or " fma " not in f" {build._cpu_flags()} ":
        return None
    out = Path(tmp_path) / f"lib{name}_avx2.so"
    source = build.SOURCE_DIR / f"{name}.c"
    subprocess.run([*cc, "-march=x86-64-v3", *build._COMMON_FLAGS, str(source), "-o", str(out), "-lm"], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(out))
    for fn, args in signatures.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int
    return lib
