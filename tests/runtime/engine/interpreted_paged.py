"""Triton paged-decode cases, run only under TRITON_INTERPRET=1 by test_paged_triton.py (the flag
must be set before triton compiles the kernel)."""

import os

import pytest
import torch

from tests.runtime.engine.test_paged_attention import random_cache, sequence_kv

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/runtime/engine/test_paged_triton.py"


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_kernel_matches_reference(kv_dtype, window):
    from lowbit.runtime.engine.paged_attention import reference_attention
    from lowbit.kernels.triton_paged import paged_decode

    cache, tables = random_cache(kv_dtype)
    lens = [1, 7, 16, 21]
    H, D = 6, cache.head_dim
    q = torch.randn(len(lens), H, D)
    bt = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    out = paged_decode(q, cache, 0, bt, torch.tensor(lens, dtype=torch.int32), 0.3, window)
    for b, n in enumerate(lens):
        k, v = sequence_kv(cache, tables[b], n)
        ref = reference_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), 0.3, window)[0]
        assert (out[b].double() - ref).abs().max() < 1e-4, (b, n)
