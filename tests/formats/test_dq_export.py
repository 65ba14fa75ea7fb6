"""Grouped int formats with 8-bit scale codes (`dq`) stay in lowbit's native layout: every
export target names the reason it cannot hold them exactly (and requantizes only when allowed)."""

from __future__ import annotations

import torch

from lowbit.formats import awq, compressed_tensors, gguf_blocks, gptq
from lowbit.quant import get_format, parse_spec


def _qt(label: str, n: int = 16, k: int = 256):
    spec = parse_spec(label)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    return get_format(spec).quantize(w, spec)


def test_exports_refuse_scale_codes_with_a_reason():
    qt = _qt("int4-asym-g32-dq")
    assert "8-bit scale codes" in gptq.why_not_exact(qt, (4, 32, False))
    assert "8-bit scale codes" in awq.why_not_exact(qt, 32)
    assert "8-bit scale codes" in compressed_tensors.why_not_exact(qt)
    assert gguf_blocks.exact_gguf_type(parse_spec("int4-g32-dq"), 256) is None
    # the same layers without dq are exact
    plain = _qt("int4-asym-g32")
    assert gptq.why_not_exact(plain, (4, 32, False)) is None or "zero" in gptq.why_not_exact(plain, (4, 32, False))
    assert compressed_tensors.why_not_exact(plain) is None
    assert gguf_blocks.exact_gguf_type(parse_spec("int4-g32"), 256) == "Q4_0"
