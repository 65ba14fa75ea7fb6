"""Triton kernel cases, run only under TRITON_INTERPRET=1 by test_triton_interpreter.py.

The file name keeps pytest from collecting it in the main run: the interpreter flag must be set
before triton compiles the kernel, and must not leak into other test folders.
"""

import os

import pytest
import torch

from lowbit.kernels import prepare, qmatmul
from tests.kernels.cases import FP32_TOL, ROWS, SHAPES, SPECS, oracle, quantized, rel_err

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_interpreter.py"


@pytest.mark.parametrize("label", SPECS)
def test_kernel_matches_oracle(label):
    from lowbit.kernels import triton_qmm

    for n, k in SHAPES:
        qt = quantized(label, n, k)
        pw = prepare(qt, "cpu", "triton")
        assert pw.path == "triton"
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                bias = torch.randn(n) if m == 3 else None
                y = qmatmul(x, pw, bias)
                assert y.dtype == dtype and y.shape == (m, n)
                # bf16 in, bf16 out: the output rounding (2^-9) dominates
                tol = FP32_TOL if dtype == torch.float32 else 2**-8
                assert rel_err(y, oracle(x, qt, bias)) < tol, (label, n, k, m, dtype)
        # An uneven split of K steps across programs (7 steps of 32 over 3 splits) and small tiles.
        x = torch.randn(5, k)
        y = triton_qmm.matmul(x, pw, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3})
        assert rel_err(y, oracle(x, qt)) < FP32_TOL, (label, "split")
