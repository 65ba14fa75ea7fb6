"""The model talks to its KV cache only through AttentionCache (runtime/attention.py): both caches
implement it, the model calls its methods (no attribute probing), and the contiguous cache's
arithmetic is SDPA's over everything kept."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lowbit.kernels.causal_attention import BlockCausalAttention
from lowbit.runtime.attention import AttentionCache, AttentionContext, KVCache, causal_attention
from lowbit.runtime.engine.paged_cache import PagedKVCache
from lowbit.runtime.loader import load_model
from tests.runtime.conftest import _llama_config, build_hf
from tests.runtime.engine.conftest import save_with_tokenizer

RUNTIME = Path(__file__).resolve().parents[2] / "lowbit" / "runtime"


def test_both_caches_declare_the_interface():
    assert issubclass(KVCache, AttentionCache) and issubclass(PagedKVCache, AttentionCache)
    assert issubclass(BlockCausalAttention, AttentionCache)
    assert KVCache.flat_rows is False and PagedKVCache.flat_rows is True
    for name in ("attend", "rotate_and_attend", "check_room", "advance"):
        assert callable(getattr(PagedKVCache, name)) and callable(getattr(KVCache, name))
    assert PagedKVCache.attend is not AttentionCache.attend and KVCache.attend is not AttentionCache.attend


def test_no_attribute_probing_of_caches_in_the_runtime():
    probes = []
    for path in RUNTIME.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"getattr\(\s*(self\.)?cache\b|hasattr\(\s*(self\.)?cache\b|\b_fused_ok\b", line):
                probes.append(f"{path.relative_to(RUNTIME)}:{n}: {line.strip()}")
    assert not probes, "\n".join(probes)


class CountingCache(KVCache):
    """A KVCache that counts the interface calls the model makes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = {"attend": 0, "rotate_and_attend": 0}

    def attend(self, q, k, v, layer, scale, window):
        self.calls["attend"] += 1
        return KVCache.attend(self, q, k, v, layer, scale, window)

    def rotate_and_attend(self, *args):
        self.calls["rotate_and_attend"] += 1
        return None


def test_model_calls_the_cache_interface_and_matches_full_recompute(tmp_path):
    save_with_tokenizer(build_hf(_llama_config()), tmp_path)
    model = load_model(tmp_path)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 12))
    full = model(ids)
    cache = CountingCache(config, 1, 32, torch.float32, torch.device("cpu"))
    chunks = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]  # a chunk after a cached prefix
    chunks += [model(ids[:, i : i + 1], cache=cache) for i in range(9, 12)]  # then single tokens
    assert cache.length == 12
    assert cache.calls == {"attend": 5 * config.num_hidden_layers, "rotate_and_attend": 0}  # not flat_rows
    assert (torch.cat(chunks, dim=1) - full).abs().max() < 1e-4


def test_contiguous_attend_is_sdpa_over_everything_kept():
    config = _llama_config()
    from lowbit.runtime.config import ModelConfig

    cfg = ModelConfig.from_dict(config.to_dict())
    cache = KVCache(cfg, 2, 16, torch.float32, torch.device("cpu"))
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k0, v0 = torch.randn(2, kvh, 6, d), torch.randn(2, kvh, 6, d)
    cache.attend(torch.randn(2, h, 6, d), k0, v0, 0, 0.25, None)
    cache.advance(6)
    q, k, v = torch.randn(2, h, 3, d), torch.randn(2, kvh, 3, d), torch.randn(2, kvh, 3, d)
    for window in (None, 4):
        got = cache.attend(q, k, v, 0, 0.25, window)
        want = causal_attention(q, torch.cat([k0, k], 2), torch.cat([v0, v], 2), AttentionContext(6, 3, q.device), 0.25,
                                window)
        assert torch.equal(got, want)
