"""The calibration attention (kernels/causal_attention.py) against float64 masked softmax attention."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.causal_attention import QUERY_BLOCK, BlockCausalAttention


def reference(q, k, v, scale, window):
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t = q.shape[2]
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize(
    "batch,heads,kv_heads,t,window",
    [(5, 9, 3, 3 * QUERY_BLOCK + 7, None), (2, 4, 1, 2 * QUERY_BLOCK + 2, 50), (3, 2, 2, 17, None), (1, 2, 1, 130, 1)],
)
@pytest.mark.parametrize("sdpa", [False, True])
def test_matches_masked_softmax_attention(batch, heads, kv_heads, t, window, sdpa):
    gen = torch.Generator().manual_seed(t)
    d = 32
    q, k, v = (torch.randn(batch, h, t, d, generator=gen).bfloat16() for h in (heads, kv_heads, kv_heads))
    out = BlockCausalAttention(sdpa=sdpa).attend(q, k, v, 0, d**-0.5, window)
    ref = reference(q, k, v, d**-0.5, window)
    assert out.shape == (batch, heads, t, d) and out.dtype == torch.bfloat16
    # bf16 scores and probabilities: errors of a few bf16 ulps of values of size ~1
    err = (out.double() - ref).abs()
    assert err.max() < 0.05 and err.mean() < 4e-3, (err.max(), err.mean())
    if window == 1:  # each query sees only itself
        assert torch.equal(out, v.repeat_interleave(heads // kv_heads, 1))


def test_sdpa_is_taken_only_for_full_causal_attention(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v = (torch.randn(1, h, 70, 16).bfloat16() for h in (4, 2, 2))
    kernel = BlockCausalAttention(sdpa=True)
    kernel.attend(q, k, v, 0, 0.25, 20)
    assert calls == []  # sliding windows stay on the blocks
    kernel.attend(q, k, v, 0, 0.25, None)
    assert len(calls) == 1 and calls[0]["is_causal"] and calls[0]["enable_gqa"]
    BlockCausalAttention(sdpa=False).attend(q, k, v, 0, 0.25, None)
    assert len(calls) == 1


@pytest.mark.parametrize("keys", [64, 512, 2048, 186, 575, 700])
def test_bf16_softmax_rounds_the_float32_softmax(keys):
    # attend() takes the softmax of bf16 scores in bf16, relying on torch computing it in float32
    # and rounding once: bit for bit the float32 softmax rounded to bf16 but for the float32 sum's
    # order, which moves a rare probability across a rounding boundary (one ulp).
    gen = torch.Generator().manual_seed(keys)
    scores = (torch.randn(4, 256, keys, generator=gen) * 6).bfloat16()
    scores[1, :, keys // 2 :] = float("-inf")  # masked keys, as the causal and window masks leave them
    scores[2, 5, :] = float("-inf")
    scores[2, 5, 3] = 2.0
    want = torch.softmax(scores, -1, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).int()
    got = torch.softmax(scores, -1)
    assert got.dtype == torch.bfloat16
    ulps = (got.view(torch.int16).int() - want).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3, (ulps.max(), (ulps > 0).float().mean())
    if keys % 64 == 0:
        assert ulps.max() == 0
