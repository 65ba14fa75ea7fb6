"""The Triton kernels (quantized matmul, paged decode attention) against their float64 oracles,
on the device LOWBIT_TRITON_DEVICE names: `cuda` runs the compiled kernels on a GPU, `cpu` (the
default) runs them under TRITON_INTERPRET=1, which tests/kernels/test_triton_interpreter.py does in
every CPU run (all formats and sizes).

Not collected by the main run (the file name): the interpreter flag must be set before triton
compiles a kernel. bench/gpu_check.sh runs it on the GPU; its --dry-run runs it under the
interpreter with LOWBIT_TRITON_QUICK=1 (a few formats, small sizes), which
tests/bench/test_gpu_check.py checks on every CPU run. LOWBIT_TRITON_SHARD=i/n keeps every n-th
format from the i-th (the paged cases in shard 0 only), so n processes can compile in parallel.

    LOWBIT_TRITON_DEVICE=cuda python -m pytest -q tests/kernels/triton_cases.py
    TRITON_INTERPRET=1 LOWBIT_TRITON_QUICK=1 python -m pytest -q tests/kernels/triton_cases.py
"""

import os

import pytest
import torch

from lowbit.kernels import prepare, qmatmul
from tests.kernels.cases import BF16_TOL, FP32_TOL, ROWS, SHAPES, SPECS, oracle, quantized, rel_err

DEVICE = torch.device(os.environ.get("LOWBIT_TRITON_DEVICE", "cpu"))
QUICK = os.environ.get("LOWBIT_TRITON_QUICK") == "1"
SHARD, SHARDS = (int(v) for v in os.environ.get("LOWBIT_TRITON_SHARD", "0/1").split("/"))
if DEVICE.type == "cuda":
    assert torch.cuda.is_available(), "LOWBIT_TRITON_DEVICE=cuda but torch sees no CUDA device"
    assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1 would run the interpreter, not the GPU"
else:
    assert DEVICE.type == "cpu", f"LOWBIT_TRITON_DEVICE must be cpu or cuda, not {DEVICE}"
    assert os.environ.get("TRITON_INTERPRET") == "1", "on the CPU the Triton kernels need TRITON_INTERPRET=1"

# the quick subset: one format per decoder (int codes, zero points, scale codes, 8-bit, code book, minifloats)
QUICK_SPECS = ["int4", "int4-asym-g64", "int4-asym-g32-dq", "int8", "nf4", "fp8", "mxfp4", "nvfp4"]
SPEC_LIST = (QUICK_SPECS if QUICK else SPECS)[SHARD::SHARDS]
SHAPE_LIST = SHAPES[:1] if QUICK else SHAPES
ROW_LIST = (1, 3, 16) if QUICK else ROWS


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return FP32_TOL  # the kernel's float32 dot runs in IEEE precision on both devices
    # bf16 in, bf16 out: the output rounding (2^-9) dominates under the interpreter, which computes
    # in float32; on a GPU the products themselves take bf16 operands
    return 2**-8 if DEVICE.type == "cpu" else BF16_TOL


@pytest.mark.parametrize("label", SPEC_LIST)
def test_qmm_kernel_matches_oracle(label):
    from lowbit.kernels import triton_qmm

    for n, k in SHAPE_LIST:
        qt = quantized(label, n, k)
        pw = prepare(qt, DEVICE, "triton")
        assert pw.path == "triton"
        for m in ROW_LIST:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                bias = torch.randn(n) if m == 3 else None
                y = qmatmul(x.to(DEVICE), pw, None if bias is None else bias.to(DEVICE))
                assert y.device.type == DEVICE.type and y.dtype == dtype and y.shape == (m, n)
                assert rel_err(y.cpu(), oracle(x, qt, bias)) < _tolerance(dtype), (label, n, k, m, dtype)
        # an uneven split of K steps across programs (7 steps of 32 over 3 splits) and small tiles
        x = torch.randn(5, k)
        y = triton_qmm.matmul(x.to(DEVICE), pw, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3})
        assert rel_err(y.cpu(), oracle(x, qt)) < FP32_TOL, (label, "split")


def _random_cache(kv_dtype, block_size=8, num_blocks=12):
    from lowbit.runtime.engine.paged_cache import PagedKVCache
    from tests.runtime.engine.test_paged_attention import tiny_config

    cache = PagedKVCache(tiny_config(), num_blocks, block_size, torch.float32, DEVICE, kv_dtype)
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    cache._write(0, torch.randn(len(slots), 2, 8).to(DEVICE), torch.randn(len(slots), 2, 8).to(DEVICE), slots)
    return cache, [[3], [7], [1, 10], [2, 9, 5]]


@pytest.mark.skipif(SHARD != 0, reason="the paged cases run in shard 0")
@pytest.mark.parametrize("kv_dtype", [None, "bf16", "int8", "fp8"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_kernel_matches_reference(kv_dtype, window):
    from lowbit.kernels.triton_paged import paged_decode
    from lowbit.runtime.engine import paged_attention as pa

    cache, tables = _random_cache(kv_dtype)
    lens = [1, 7, 16, 21]
    q = torch.randn(len(lens), 6, cache.head_dim)
    bt = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    out = paged_decode(q.to(DEVICE), cache, 0, bt.to(DEVICE), torch.tensor(lens, dtype=torch.int32).to(DEVICE), 0.3, window)
    assert out.device.type == DEVICE.type
    for b, n in enumerate(lens):
        slots = torch.tensor(pa._slots(tables[b], 0, n, cache.block_size), device=DEVICE)
        k, v = (t.cpu() for t in cache.gather(0, slots))
        ref = pa.reference_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), 0.3, window)[0]
        assert (out[b].cpu().double() - ref).abs().max() < 1e-4, (b, n)


DECODE_OF = {"int4": "AFFINE", "int8": "AFFINE", "int4-asym-g64": "AFFINE", "nf4": "SELECT16", "mxfp4": "SELECT16",
             "nvfp4": "SELECT16", "fp8": "E4M3", "fp8-e5m2": "E5M2"}


@pytest.mark.parametrize("label", list(DECODE_OF)[SHARD::SHARDS])
def test_each_decode_mode_equals_a_table_read(label):
    # prepare picks an arithmetic or in-register decode; forced back to reading the format's own
    # code table per element, the kernel must give the same numbers
    from lowbit.kernels import triton_qmm

    qt = quantized(label, 40, 160)
    pw = prepare(qt, DEVICE, "triton")
    assert pw.params["decode"] == getattr(triton_qmm, f"DECODE_{DECODE_OF[label]}"), label
    x = torch.randn(3, 160).to(DEVICE)
    y = triton_qmm.matmul(x, pw)
    pw.params["decode"] = triton_qmm.DECODE_TABLE
    y_table = triton_qmm.matmul(x, pw)
    assert rel_err(y.cpu(), y_table.cpu()) < 1e-6, label
    assert rel_err(y.cpu(), oracle(x.cpu(), qt)) < FP32_TOL, label
