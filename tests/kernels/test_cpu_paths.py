"""Every CPU path (and the reference) against the float64 dequantize-then-matmul oracle."""

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.kernels import choose_path, cpu_lut, native, prepare, qmatmul
from lowbit.tests.kernels.cases import BF16_TOL, FP32_TOL, ROWS, SHAPES, SPECS, oracle, quantized, rel_err

# Paths that round activations (and scales) to bf16; the others compute in float32.
BF16_PATHS = {"cpu-int4", "cpu-int8"}


def check(label: str, path: str | None, dtype: torch.dtype = torch.float32) -> str:
    chosen = None
    for n, k in SHAPES:
        qt = quantized(label, n, k)
        pw = prepare(qt, "cpu", path)
        chosen = pw.path
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n) if m == 3 else None
            y = qmatmul(x, pw, bias)
            assert y.dtype == dtype and y.shape == (m, n)
            tol = BF16_TOL if (pw.path in BF16_PATHS or dtype != torch.float32) else FP32_TOL
            assert rel_err(y, oracle(x, qt, bias)) < tol, (label, pw.path, n, k, m)
    return chosen


@pytest.mark.parametrize("label", SPECS)
def test_automatic_path_matches_oracle(label):
    path = check(label, None)  # the path of the last shape, K=200 (no int4 group of torch's fits)
    if label.startswith(("int2", "int3")):
        assert path == "reference"
    else:  # int8 at K=200 too: torch's int8 op needs K % 32 == 0
        assert path == "cpu-lut"


@pytest.mark.parametrize("label", ["int4", "int4-asym-g64", "int8", "nf4", "mxfp4", "nvfp4", "fp8-block128"])
def test_lut_kernel_for_every_element_kind(label):
    assert check(label, "cpu-lut") == "cpu-lut"


@pytest.mark.parametrize("label", ["int4-asym-g64", "nf4", "nvfp4", "fp8-e5m2", "int8-g128"])
def test_portable_build_without_avx512(label, monkeypatch):
    # The scalar C code is what runs on CPUs without AVX-512; build it here and check it too.
    lib = native.load_library(portable=True)
    if lib is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_lut, "load_library", lambda: lib)
    assert check(label, "cpu-lut") == "cpu-lut"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("label", ["int4", "int8", "nf4", "nvfp4"])
def test_half_precision_inputs(label, dtype):
    check(label, None, dtype)


def test_reference_path_forced_by_environment(monkeypatch):
    monkeypatch.setenv("LOWBIT_KERNEL", "reference")
    assert check("nf4", None) == "reference"


def test_large_batch_uses_dequantized_weight_exactly():
    qt = quantized("mxfp4", 40, 96)
    pw = prepare(qt, "cpu", "cpu-lut")
    assert torch.equal(cpu_lut.dequantize(pw), qt.dequantize(torch.float32))
    x = torch.randn(2, 5, 96)  # leading dimensions are kept
    assert qmatmul(x, pw).shape == (2, 5, 40)


def test_torch_int8_op_only_where_k_allows():
    assert prepare(quantized("int8", 16, 192), "cpu").path == "cpu-int8"
    assert prepare(quantized("int8", 16, 200), "cpu").path == "cpu-lut"


def test_int4_group_transcoding_for_ragged_k():
    # K=192 with g=128 has a ragged group of 64: torch's op gets group 64, scales repeated.
    qt = quantized("int4", 16, 192)
    pw = prepare(qt, "cpu")
    assert pw.path == "cpu-int4" and pw.params["group"] == 64


def test_bad_requests_are_one_line_errors():
    qt = quantized("nf4", 16, 64)
    with pytest.raises(UsageError, match="unknown kernel path"):
        prepare(qt, "cpu", "fast")
    with pytest.raises(LowbitError, match="cannot run nf4"):
        prepare(qt, "cpu", "cpu-int4")
    with pytest.raises(LowbitError, match="needs a CUDA device"):
        choose_path(qt, "cpu", "triton")
    pw = prepare(qt, "cpu")
    with pytest.raises(LowbitError, match="expects 64"):
        qmatmul(torch.randn(2, 63), pw)
    with pytest.raises(LowbitError, match="bf16, fp16 or fp32"):
        qmatmul(torch.randn(2, 64).double(), pw)
