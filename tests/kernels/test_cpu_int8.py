"""cpu-int8f (kernels/cpu_int8.py, native/int8_gemv.c): int8 codes times float32 activations.

Against the float64 dequantize-then-matmul oracle at a float32-summation tolerance, bit-for-bit
batch invariance (row i of an M-row call == the one-row call, any thread count; grouped weights
up to GROUPED_KERNEL_ROWS rows), the dispatch choosing it, and the fallback when the C kernel is
not there."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kernels import choose_path, cpu_int8, prepare, qmatmul
from lowbit.kernels.dispatch import BY_NAME, describe_paths
from lowbit.native import int8_gemv
from tests.kernels.cases import oracle, quantized, rel_err

needs_kernel = pytest.mark.skipif(not cpu_int8.available(), reason="no AVX-512 build of native/int8_gemv.c here")

# Per-channel and grouped, with ragged tiles: N not a multiple of 4, K not a multiple of 16, a
# last group shorter than the rest (K=200 in groups of 32 or 128; K=40 in groups of 32), K < 16.
CASES = [("int8", 33, 200), ("int8", 5, 7), ("int8", 96, 192), ("int8-g32", 33, 200), ("int8-g128", 33, 200),
         ("int8-g16", 9, 48), ("int8-g32", 6, 40), ("int8-g32-dq", 17, 200), ("int8-g64", 12, 576)]
# Float32 sums of exact products over K <= 576 terms: a few ulps of 2^-24 times sqrt(K) of max|y|;
# a wrong code, scale or group boundary gives errors of order 1e-2 and more.
TOL = 2e-6


@needs_kernel
@pytest.mark.parametrize(("label", "n", "k"), CASES)
def test_matches_the_float64_oracle(label, n, k):
    qt = quantized(label, n, k)
    pw = prepare(qt, "cpu", "cpu-int8f")
    for m in (1, 3, 7, 16, 33):
        x = torch.randn(m, k)
        y = qmatmul(x, pw)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert rel_err(y, oracle(x, qt)) < TOL, (label, n, k, m)
    bias = torch.randn(n)
    x = torch.randn(2, 3, k)  # leading dimensions kept, bias added
    y = qmatmul(x, pw, bias)
    assert y.shape == (2, 3, n)
    assert rel_err(y.reshape(6, n), oracle(x.reshape(6, k), qt, bias)) < TOL


@needs_kernel
@pytest.mark.parametrize(("label", "n", "k", "rows"), [("int8", 37, 200, 140), ("int8-g32", 37, 200, cpu_int8.GROUPED_KERNEL_ROWS),
                                                       ("int8-g16", 10, 64, cpu_int8.GROUPED_KERNEL_ROWS)])
def test_every_row_equals_the_one_row_call_bit_for_bit(label, n, k, rows):
    # The speculative verify relies on it: each pass size (1..6 rows per pass, 3 when grouped),
    # the 128-row sweeps of a per-channel prefill, and either thread count give the same bits per row.
    pw = prepare(quantized(label, n, k), "cpu", "cpu-int8f")
    x = torch.randn(rows, k)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.cat([qmatmul(x[i:i + 1], pw) for i in range(x.shape[0])])
        for m in (2, 3, 4, 5, 6, 7, 9, 16, rows):
            assert torch.equal(qmatmul(x[:m], pw), single[:m]), m
        torch.set_num_threads(2)
        assert torch.equal(qmatmul(x, pw), single)
        assert torch.equal(qmatmul(x[5:9], pw), single[5:9])
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_grouped_prefill_runs_the_exact_float32_weight():
    # Above GROUPED_KERNEL_ROWS grouped weights go to torch's float32 matmul of the dequantized
    # weight, which is the format's own float32 dequantization exactly.
    qt = quantized("int8-g32", 20, 200)
    pw = prepare(qt, "cpu", "cpu-int8f")
    assert torch.equal(cpu_int8.dequantize(pw), qt.dequantize(torch.float32))
    x = torch.randn(cpu_int8.GROUPED_KERNEL_ROWS + 1, 200)
    assert rel_err(qmatmul(x, pw), oracle(x, qt)) < TOL


@needs_kernel
@pytest.mark.parametrize("label", ["int8-g32", "int8-g64"])  # K = 200: g64 leaves a ragged last group
def test_prefill_decodes_into_reused_scratch_without_stale_values(label):
    # the prefill route decodes each weight into the thread's one scratch buffer: a second weight,
    # smaller and then larger, must see none of the first one's values
    from lowbit.kernels import scratch

    x = torch.randn(cpu_int8.GROUPED_KERNEL_ROWS + 3, 200)
    for n in (40, 12, 72):
        qt = quantized(label, n, 200)
        pw = prepare(qt, "cpu", "cpu-int8f")
        expected = x @ qt.dequantize(torch.float32).T
        assert torch.equal(qmatmul(x, pw), expected), (label, n)
    first = scratch.buffer(10)
    assert scratch.buffer(5).data_ptr() == first.data_ptr()  # the same memory, not a new tensor
    # a buffer first grown under inference mode (an engine step) still serves a call outside it
    qt = quantized(label, 300, 200)
    pw = prepare(qt, "cpu", "cpu-int8f")
    with torch.inference_mode():
        inside = qmatmul(x, pw)
    assert torch.equal(qmatmul(x, pw), inside)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_widened_exactly(dtype):
    pw = prepare(quantized("int8-g32", 20, 200), "cpu", "cpu-int8f")
    x = torch.randn(3, 200).to(dtype)
    y = qmatmul(x, pw)
    assert y.dtype == dtype
    assert torch.equal(y, qmatmul(x.float(), pw).to(dtype))  # the only rounding is y's


@needs_kernel
def test_zero_rows_and_strided_input():
    pw = prepare(quantized("int8", 8, 64), "cpu", "cpu-int8f")
    assert qmatmul(torch.randn(0, 64), pw).shape == (0, 8)
    wide = torch.randn(4, 128)
    assert torch.equal(qmatmul(wide[:, ::2], pw), qmatmul(wide[:, ::2].contiguous(), pw))


@needs_kernel
@pytest.mark.parametrize(("label", "k"), [("int8", 192), ("int8", 200), ("int8-g32", 200), ("int8-g128", 192), ("int8-g32-dq", 64)])
def test_dispatch_chooses_it_for_int8(label, k):
    qt = quantized(label, 16, k)
    assert choose_path(qt, "cpu") == "cpu-int8f"
    chosen = [s.name for s in describe_paths(qt, "cpu") if s.chosen]
    assert chosen == ["cpu-int8f"]


def test_reasons_for_other_formats():
    reason = BY_NAME["cpu-int8f"].supports(quantized("int4", 16, 64))
    assert reason is not None and "symmetric integer 8-bit" in reason
    assert "symmetric integer 8-bit" in BY_NAME["cpu-int8f"].supports(quantized("fp8", 16, 64))
    assert "cpu-int8f" in [s.name for s in describe_paths(device=None)]  # what `lowbit doctor` lists


@pytest.mark.parametrize(("k", "fallback"), [(192, "cpu-int8"), (200, "cpu-lut")])
def test_falls_back_without_the_native_build(monkeypatch, k, fallback):
    # No library (no compiler, LOWBIT_NO_NATIVE): the old paths run int8, and naming the path
    # is a one-line error with the reason.
    monkeypatch.setattr(int8_gemv, "library", lambda portable=False: None)
    monkeypatch.setattr(cpu_int8, "_LIB", None)
    assert not cpu_int8.available()
    qt = quantized("int8", 16, k)
    pw = prepare(qt, "cpu")
    assert pw.path == fallback
    x = torch.randn(2, k)
    assert rel_err(qmatmul(x, pw), oracle(x, qt)) < 2e-2  # cpu-int8 rounds x to bf16
    with pytest.raises(LowbitError, match=r"cpu-int8f.*(int8_gemv.c|no AVX512F)"):
        prepare(qt, "cpu", "cpu-int8f")


def test_portable_build_compiles_without_avx512(monkeypatch):
    # The x86-64-v2 build (a CPU without AVX-512) compiles, says so, and the path is off there.
    lib = int8_gemv.library(portable=True)
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.lowbit_int8f_available() == 0
    assert lib.lowbit_int8f_matmul(None, 0, 0, 0, None, 1, 0, None, 0, 0, None, 0, 1) == -1
    monkeypatch.setattr(int8_gemv, "library", lambda portable=False: lib)
    monkeypatch.setattr(cpu_int8, "_LIB", None)
    assert not cpu_int8.available()
    assert choose_path(quantized("int8-g32", 16, 200), "cpu") == "cpu-lut"


@needs_kernel
def test_bad_groups_are_refused_by_the_c_kernel():
    lib = int8_gemv.library()
    q, s, x, y = torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 3), torch.ones(1, 40), torch.empty(1, 4)
    call = lambda g, group: lib.lowbit_int8f_matmul(q.data_ptr(), 4, 40, 40, s.data_ptr(), g, group,  # noqa: E731
                                                   x.data_ptr(), 40, 1, y.data_ptr(), 4, 1)
    assert call(3, 16) == 0  # 16 + 16 + 8
    assert call(3, 24) == -2  # not a multiple of 16
    assert call(2, 16) == -2  # two groups of 16 do not cover K = 40
    assert call(4, 16) == -2  # a fourth group would start past K


@pytest.mark.parametrize(("label", "n", "k"), [("int8-g32", 37, 200), ("int8-g32", 9, 576), ("int8-g16", 10, 64), ("int8", 37, 200)])
def test_the_avx2_build_matches_the_oracle_and_is_batch_invariant(label, n, k, tmp_path):
    # Zen 2/3 and laptops run the AVX2 section (grouped weights: one x row at a time, or up to four
    # sharing each widened code); checked on any machine that can run AVX2, AVX-512 ones included.
    from tests.kernels.cases import avx2_library

    lib = avx2_library("int8_gemv", int8_gemv.SIGNATURES, tmp_path)
    if lib is None:
        pytest.skip("no compiler or no AVX2 here")
    qt = quantized(label, n, k)
    pw = prepare(qt, "cpu", "cpu-int8f")
    t, p = pw.tensors, pw.params
    x = torch.randn(16, k)

    def run(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], n)
        assert lib.lowbit_int8f_matmul(t["codes"].data_ptr(), n, k, t["codes"].stride(0), t["scales"].data_ptr(), p["groups"],
                                       p["group"], rows.data_ptr(), k, rows.shape[0], y.data_ptr(), n, 2) == 0
        return y

    full = run(x)
    assert rel_err(full, oracle(x, qt)) < TOL
    single = torch.cat([run(x[i : i + 1].contiguous()) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(run(x[:m].contiguous()), single[:m]), m
    assert torch.equal(full, single)
