"""The CPU paged-attention paths against a float64 oracle: padded short batches (decodes,
verifies) and tiled prefill chunks, with GQA, sliding windows and quantized KV."""

from __future__ import annotations

import pytest
import torch

from lowbit.runtime.config import ModelConfig
from lowbit.runtime.engine import paged_attention as pa
from lowbit.runtime.engine.paged_cache import PagedKVCache


def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=16, hidden_size=48, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
        hidden_act="silu", tie_word_embeddings=False))


def random_cache(kv_dtype=None, block_size=8, num_blocks=12):
    """A pool filled with random K/V, and block tables for four sequences in scattered blocks."""
    cache = PagedKVCache(tiny_config(), num_blocks, block_size, torch.float32, "cpu", kv_dtype)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), 2, 8)
    v = torch.randn(len(slots), 2, 8)
    cache._write(0, k, v, slots)
    return cache, [[3], [7], [1, 10], [2, 9, 5]]


def sequence_kv(cache, table, n):
    slots = pa._slots(table, 0, n, cache.block_size)
    return cache.gather(0, torch.tensor(slots))


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("window", [None, 5])
def test_short_batch_matches_reference(kv_dtype, window):
    cache, tables = random_cache(kv_dtype)
    # (start, n): a decode, a 3-token verify, a decode at a block edge, a 4-token verify
    spans = [(0, 1), (4, 3), (15, 1), (17, 4)]
    T = sum(n for _, n in spans)
    q = torch.randn(T, 6, 8)
    meta = pa.build_metadata([(t, s, n) for t, (s, n) in zip(tables, spans)], cache.block_size, torch.device("cpu"))
    out = torch.empty_like(q)
    out[meta.short.token_index] = pa.short_attention(cache, 0, q, meta.short, 0.3, window)
    row = 0
    for table, (s, n) in zip(tables, spans):
        k, v = sequence_kv(cache, table, s + n)
        ref = pa.reference_attention(q[row : row + n], k, v, torch.arange(s, s + n), 0.3, window)
        assert (out[row : row + n].double() - ref).abs().max() < 1e-5
        row += n


@pytest.mark.parametrize("window", [None, 5])
def test_tiled_prefill_matches_reference(window, monkeypatch):
    monkeypatch.setattr(pa, "PREFILL_TILE", 4)
    cache, tables = random_cache()
    table, start, n = tables[3], 6, 14  # a chunk after 6 cached tokens, 4 tiles
    meta = pa.build_metadata([(table, start, n)], cache.block_size, torch.device("cpu"))
    q = torch.randn(n, 6, 8)
    out = pa.prefill_attention(cache, 0, q, meta.prefills[0], 0.3, window)
    k, v = sequence_kv(cache, table, start + n)
    ref = pa.reference_attention(q, k, v, torch.arange(start, start + n), 0.3, window)
    assert (out.double() - ref).abs().max() < 1e-5


def test_quantized_kv_error_is_small():
    for kv_dtype, tol in (("int8", 0.02), ("fp8", 0.1)):
        cache, _ = random_cache(kv_dtype)
        exact = torch.randn(10, 2, 8)
        cache._write(0, exact, exact, torch.arange(10))
        k, _ = cache.gather(0, torch.arange(10))
        assert (k - exact).abs().max() / exact.abs().max() < tol, kv_dtype
