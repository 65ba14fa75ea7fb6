"""Dequantize-then-matmul: the path that works for every format, and the oracle for the others.

`reference_matmul` computes in float32 (float64 when asked, for tests) from the QTensor's own
`dequantize`, so it is exactly the numbers the format layer defines; it writes the whole dense
weight on every call, which is why dispatch prefers the fused paths.
"""

from __future__ import annotations

import torch

from lowbit.quant.qtensor import QTensor


def reference_matmul(
    x: torch.Tensor, qt: QTensor, bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias), computed in `compute_dtype`, returned in x's dtype."""
    w = qt.dequantize(torch.float32).to(device=x.device, dtype=compute_dtype)
    y = x.to(compute_dtype) @ w.T
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(x.dtype)
