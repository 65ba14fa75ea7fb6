"""Bytes of a format's part layout ({part: (shape, dtype)}): the arithmetic the registry, QTensor
and plan/ share, with no dependency on any format."""

from __future__ import annotations

import torch


def layout_bytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    total = 0
    for shape, dtype in layout.values():
        count = 1
        for d in shape:
            count *= d
        total += count * torch.empty((), dtype=dtype).element_size()
    return total
