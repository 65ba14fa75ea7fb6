"""KV cache bytes: GQA, sliding windows, dtypes, paging."""

from __future__ import annotations

import pytest

from lowbit.errors import UsageError
from lowbit.plan import kv_cache
from lowbit.plan.report import load_shape


@pytest.fixture(scope="module")
def llama8b():
    return load_shape("llama-3-8b")[0]


@pytest.fixture(scope="module")
def gemma():
    return load_shape("gemma3-270m")[0]


def test_llama3_8b_bf16_bytes_per_token(llama8b):
    # K and V × 32 layers × 8 KV heads × 128 dims × 2 bytes
    assert kv_cache.kv_bytes_per_token(llama8b, kv_cache.kv_dtype("bf16")) == 2 * 32 * 8 * 128 * 2 == 131072


def test_kv_dtypes(llama8b):
    assert kv_cache.kv_bytes_per_token(llama8b, kv_cache.kv_dtype("fp8")) == 65536
    # int8 adds one fp32 scale per token, head, and K / V
    assert kv_cache.kv_bytes_per_token(llama8b, kv_cache.kv_dtype("int8")) == 2 * 32 * 8 * (128 + 4)
    with pytest.raises(UsageError, match="unknown KV cache dtype"):
        kv_cache.kv_dtype("fp4")


def test_full_attention_sequence_is_linear(llama8b):
    bf16 = kv_cache.kv_dtype("bf16")
    assert kv_cache.kv_bytes_per_sequence(llama8b, bf16, 4096) == 131072 * 4096


def test_gemma3_sliding_window_holds_only_the_window(gemma):
    bf16 = kv_cache.kv_dtype("bf16")
    per_layer_token = 2 * 1 * 256 * 2  # K and V, 1 KV head, head_dim 256, bf16
    tokens = 2048
    # 15 local layers keep 512 tokens, 3 global layers keep all 2048
    expected = 15 * 512 * per_layer_token + 3 * tokens * per_layer_token
    without_window = 18 * tokens * per_layer_token
    got = kv_cache.kv_bytes_per_sequence(gemma, bf16, tokens)
    assert got == expected == 14_155_776
    assert got < without_window
    # below the window every layer holds every token
    assert kv_cache.kv_bytes_per_sequence(gemma, bf16, 300) == 18 * 300 * per_layer_token


def test_paged_rounds_to_blocks(llama8b, gemma):
    bf16 = kv_cache.kv_dtype("bf16")
    assert kv_cache.kv_bytes_paged(llama8b, bf16, 4100) == 131072 * 257 * 16
    assert kv_cache.kv_bytes_paged(llama8b, bf16, 4096) == 131072 * 4096
    per_layer_token = 1024
    # a sliding layer keeps the 32 blocks of its window plus the one it is filling
    assert kv_cache.kv_bytes_paged(gemma, bf16, 2048) == per_layer_token * (15 * 33 * 16 + 3 * 2048)


def test_attention_pair_counts(gemma):
    assert kv_cache.attended_tokens(gemma, 2048) == 15 * 512 + 3 * 2048
    # causal prefill of 1000 tokens: full layers n(n+1)/2 pairs; local layers 512·513/2 + (1000−512)·512
    full = 1000 * 1001 // 2
    local = 512 * 513 // 2 + 488 * 512
    assert kv_cache.causal_attended_pairs(gemma, 1000) == 3 * full + 15 * local
