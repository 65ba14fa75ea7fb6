"""The one dtype vocabulary of every `--dtype`: f32, bf16, f16 (llama.cpp's and GGUF's spelling),
with torch's long names (float32, bfloat16, float16) and fp32/fp16 accepted as the same thing."""

from __future__ import annotations

import torch

from lowbit.errors import UsageError

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_ALIASES = {"float32": "f32", "fp32": "f32", "bfloat16": "bf16", "float16": "f16", "fp16": "f16", "half": "f16"}


def dtype_name(text: str, option: str = "--dtype", allowed: tuple[str, ...] = tuple(DTYPES)) -> str:
    """The short name of `text` ('float32' -> 'f32'); a one-line usage error if it is not one of `allowed`."""
    name = str(text).strip().lower()
    name = _ALIASES.get(name, name)
    if name not in allowed:
        raise UsageError(f"{option} must be one of {', '.join(allowed)}, got {text!r}")
    return name


def parse_dtype(text: str | torch.dtype, option: str = "--dtype", allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    if isinstance(text, torch.dtype):
        return text
    return DTYPES[dtype_name(text, option, allowed)]


def fits_float16(values: torch.Tensor) -> bool:
    """True when every value survives a round trip through float16 unchanged (bf16 or float32 scales
    that float16 formats - GPTQ, AWQ, GGUF's Q4_0 and Q8_0 - hold exactly)."""
    if values.dtype == torch.float16:
        return True
    if values.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        return False  # fp8 / E8M0 / integer scales: other formats' business
    back = values.to(torch.float16).to(values.dtype)
    return bool(torch.isfinite(back).all()) and torch.equal(back, values)
