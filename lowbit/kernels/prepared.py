"""PreparedWeight: a QTensor repacked once, at load time, for the matmul path that will run it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.quant.qtensor import QTensor


@dataclass(slots=True)
class PreparedWeight:
    path: str  # the name of the dispatch path that prepared it (kernels/dispatch.py TABLE)
    shape: tuple[int, int]  # (out_features N, in_features K)
    label: str  # the FormatSpec label, for messages and benchmarks
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the path's own layout
    params: dict = field(default_factory=dict)  # the path's integers and flags
    qt: QTensor | None = None  # kept only by the reference path

    @property
    def nbytes(self) -> int:
        """Bytes the path reads per matmul (its tensors; the reference's packed parts)."""
        if self.path == "reference" and self.qt is not None:
            return self.qt.nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
