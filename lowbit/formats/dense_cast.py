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
    back = cast.to(torch.float64)
    source = tensor.to(torch.float64)
    overflow = torch.isinf(back) & torch.isfinite(source)
    if bool(overflow.any()):
        largest = float(source[overflow].abs().max())
        raise LowbitError(f"{name}: a value of magnitude {largest:.4g} overflows {str(dtype).removeprefix('torch.')}; "
                          "use --dtype bf16 or f32")
    if tally is not None and not torch.equal(back, source):
        finite = torch.isfinite(source)
        norm = float(source[finite].norm())
        error = float((back - source)[finite].norm()) / norm if norm > 0 else 0.0
        tally.tensors += 1
        tally.max_rel_error = max(tally.max_rel_error, error)
    return cast
