"""Bookkeeping for weights a target format cannot hold exactly.

A converter first asks, for every weight, why it cannot be written exactly (None when it can).
Without `--allow-requant` any such weight stops the conversion with one line naming it;
with it, the weight is dequantized, requantized into what the target can hold, and a
`LayerChange` records what changed and the reconstruction error ‖W − Ŵ‖_F / ‖W‖_F measured
against the source's own dequantized weight.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.quant.qtensor import QTensor
from lowbit.quant.rtn import quantize_rtn


@dataclass(slots=True)
class LayerChange:
    module: str
    source: str  # the source format label ("int4-g128", "nf4", "dense bfloat16", "gptq act-order")
    target: str  # what was written instead
    reason: str  # why the source could not be written exactly
    rel_error: float  # ‖W − Ŵ‖_F / ‖W‖_F against the source's dequantized weight

    def to_dict(self) -> dict:
        return asdict(self)


def refuse_unless_allowed(target: str, problems: list[tuple[str, str]], allow: bool) -> None:
    """problems: (module, reason). Raise one line unless requantization is allowed."""
    if problems and not allow:
        module, reason = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise LowbitError(
            f"cannot write {module} as {target} exactly: {reason}{more}; pass --allow-requant to requantize"
        )


def source_label(value: torch.Tensor | QTensor) -> str:
    if isinstance(value, QTensor):
        return value.spec.label
    return f"dense {str(value.dtype).removeprefix('torch.')}"


def requantized(module: str, w: torch.Tensor, spec) -> QTensor:
    """quantize_rtn(w, spec) with the module named in its error (a NaN or inf weight of a damaged
    source stops the conversion naming the layer)."""
    try:
        return quantize_rtn(w, spec)
    except LowbitError as exc:
        raise LowbitError(f"{module}: {exc}") from None


def dequantized(value: torch.Tensor | QTensor) -> torch.Tensor:
    return value.dequantize(torch.float32) if isinstance(value, QTensor) else value.float()
