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


def placed(pw: PreparedWeight, names=None) -> PreparedWeight:
    """pw with its arrays (those in `names`; all by default) on huge pages inside an engine's arena
    (kernels/hugepages.py place: a copy; views of something placed stay), or pw itself when none
    moves (outside an arena, or placed already). Same params: a path whose params hold pointers
    into the arrays rebuilds them."""
    from lowbit.kernels import hugepages

    tensors = {name: hugepages.place(t) if names is None or name in names else t for name, t in pw.tensors.items()}
    if all(tensors[name] is pw.tensors[name] for name in tensors):
        return pw
    return PreparedWeight(path=pw.path, shape=pw.shape, label=pw.label, device=pw.device, tensors=tensors, params=pw.params)
