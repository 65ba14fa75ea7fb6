"""Every CPU path (and the reference) against the float64 dequantize-then-matmul oracle."""

import pytest
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.kernels import choose_path, cpu_bf16, cpu_int4dot, cpu_int8, cpu_lut, prepare, qmatmul
from lowbit.native import bf16_gemv, int4_dot, int4_vnni, int8_gemv, lut_gemv
from tests.kernels.cases import BF16_TOL, FP32_TOL, ROWS, SHAPES, SPECS, oracle, quantized, rel_err

# Paths that round activations (and scales) to bf16; the others compute in float32.
BF16_PATHS = {"cpu-int4dot", "cpu-int4", "cpu-int8", "cpu-bf16"}
needs_bf16_kernel = pytest.mark.skipif(not cpu_bf16.available(), reason="no AVX512-BF16 build on this machine")


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
    qt = quantized(label, 33, 200)
    if label.startswith(("int2", "int3", "int5", "int6")):
        assert path == "reference"
    elif cpu_int4dot.supports(qt):  # integer 4-bit codes in groups of 32k (or one per row)
        assert path == "cpu-int4dot"
    elif cpu_bf16.supports(qt):  # 4-bit formats on a CPU with AVX512-BF16
        assert path == "cpu-bf16"
    elif cpu_int8.supports(qt):  # int8 on a CPU with AVX-512
        assert path == "cpu-int8f"
    else:  # 8-bit formats (int8 at K=200 too: torch's int8 op needs K % 32 == 0)
        assert path == "cpu-lut"


# Which representation the bf16 kernel must pick: exact bf16 weights, or the hi + lo pair.
BF16_KERNEL_MODES = {"mxfp4": 0, "nvfp4": 0, "nvfp4-absmax": 0, "nf4": 1, "nf4-g128": 1, "nf4-dq": 1, "int4-asym-g64": 1, "int4-g32": 1, "int4-channel": 1}


@needs_bf16_kernel
@pytest.mark.parametrize("label", sorted(BF16_KERNEL_MODES))
def test_bf16_kernel_equals_float32_matmul_of_bf16_activations(label):
    # The only rounding allowed is the activations' (to bf16): against the oracle of the rounded
    # x the fused kernel is float32-exact (single) or within the pair's 2^-17 (nf4, fp16 scales).
    # M = 33 runs the prefill route (bf16 GEMM: y rounded to bf16 in single mode).
    for n, k in SHAPES + [(40, 576)]:
        qt = quantized(label, n, k)
        pw = prepare(qt, "cpu", "cpu-bf16")
        assert pw.params["pair"] == BF16_KERNEL_MODES[label]
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16).float()
            ref = oracle(x, qt)
            tol = 2e-5 if pw.params["pair"] else (2**-7 if m > cpu_bf16.FUSED_MAX_ROWS else FP32_TOL)
            assert rel_err(qmatmul(x, pw), ref) < tol, (label, n, k, m)
            # bf16 out: rounded once in C; the prefill GEMM's bf16 y is rounded again after nvfp4's global scale
            y16 = qmatmul(x.to(torch.bfloat16), pw)
            assert y16.dtype == torch.bfloat16 and rel_err(y16, ref) < 2**-7, (label, n, k, m)


@needs_bf16_kernel
def test_bf16_kernel_refuses_weights_it_cannot_represent():
    qt = quantized("mxfp4", 16, 64)
    qt.scales[0, 0] = torch.tensor(1, dtype=torch.uint8).view(qt.scales.dtype)  # 2^-126: products go subnormal
    assert not cpu_bf16.supports(qt)
    assert prepare(qt, "cpu").path == "cpu-lut"


def test_int4_prefill_decodes_to_bf16():
    qt = quantized("int4-g64", 48, 192)
    pw = prepare(qt, "cpu", "cpu-int4")
    assert pw.path == "cpu-int4"
    x = torch.randn(40, 192)
    assert rel_err(qmatmul(x, pw), oracle(x, qt)) < BF16_TOL


@pytest.mark.parametrize("label", ["int4", "int4-asym-g64", "int8", "nf4", "mxfp4", "nvfp4", "fp8-block128"])
def test_lut_kernel_for_every_element_kind(label):
    assert check(label, "cpu-lut") == "cpu-lut"


@pytest.mark.parametrize("label", ["int4-asym-g64", "nf4", "nvfp4", "fp8-e5m2", "int8-g128"])
def test_portable_build_without_avx512(label, monkeypatch):
    # The scalar C code is what runs on CPUs without AVX-512; build it here and check it too.
    for binding in (lut_gemv, bf16_gemv, int4_dot, int4_vnni, int8_gemv):
        lib = binding.library(portable=True)
        if lib is None:
            pytest.skip("no C compiler")
        monkeypatch.setattr(binding, "library", lambda portable=False, lib=lib: lib)
    assert not cpu_bf16.available() and not cpu_int4dot.available()  # the portable build has no bf16 kernel: cpu-lut runs 4-bit formats
    assert check(label, None) == "cpu-lut"


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


def test_torch_int8_op_only_where_k_allows(monkeypatch):
    monkeypatch.setattr(cpu_int8, "available", lambda: False)  # else cpu-int8f runs int8 (tests/kernels/test_cpu_int8.py)
    assert prepare(quantized("int8", 16, 192), "cpu").path == "cpu-int8"
    assert prepare(quantized("int8", 16, 200), "cpu").path == "cpu-lut"


def test_int4_group_transcoding_for_ragged_k():
    # K=192 with g=128 has a ragged group of 64: torch's op gets group 64, scales repeated.
    qt = quantized("int4", 16, 192)
    pw = prepare(qt, "cpu", "cpu-int4")
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
