"""Casting weights to a Hugging Face directory's dtype, and saying what the cast changed.

A quantized weight dequantizes to a code times its scale, which needs more significant bits than
bf16's 8 (a float16 scale times a 4-bit code: up to 15), so `--to hf` in bf16 or f16 rounds it;
float32 holds it exactly. The tally lets a conversion report that instead of calling it exact."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError


@dataclass(slots=True)
class RoundingTally:
    """What casting to `dtype` changed: how many tensors, and the largest relative error."""

    dtype: torch.dtype
    tensors: int = 0
    max_rel_error: float = 0.0

    def to_dict(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "tensors": self.tensors,
                "max_rel_error": self.max_rel_error}


def cast_dense(name: str, tensor: torch.Tensor, dtype: torch.dtype, tally: RoundingTally | None = None) -> torch.Tensor:
    """`tensor` in `dtype`; counts it in `tally` when the cast rounded any value. A finite value
    the dtype cannot hold (float16's 65504) stops the conversion rather than becoming inf."""
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    cast = tensor.to(dtype)
    if torch.finfo(dtype).max < torch.finfo(tensor.dtype).max:  # float16's range (bf16 has float32's)
        overflow = torch.isinf(cast) & torch.isfinite(tensor)
        if bool(overflow.any()):
            largest = float(tensor[overflow].abs().max())
            raise LowbitError(f"{name}: a value of magnitude {largest:.4g} overflows "
                              f"{str(dtype).removeprefix('torch.')}; use --dtype bf16 or f32")
    if tally is not None:
        # float32 holds every bf16, f16 and f32 value exactly: no float64 copies of a large table
        wide = torch.float64 if torch.float64 in (tensor.dtype, dtype) else torch.float32
        source, back = tensor.to(wide), cast.to(wide)
        if not torch.equal(back, source):
            finite = torch.isfinite(source)
            norm = float(torch.linalg.vector_norm(source[finite], dtype=torch.float64))
            diff = float(torch.linalg.vector_norm((back - source)[finite], dtype=torch.float64))
            tally.tensors += 1
            tally.max_rel_error = max(tally.max_rel_error, diff / norm if norm > 0 else 0.0)
    return cast
