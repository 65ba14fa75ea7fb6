"""The outlier side matrix S: weights kept in bf16 outside a quantized matrix (`--keep-outliers`).

Inference computes x Ŵᵀ + x Sᵀ. Storage (`pack_outliers`): `indices` int32 [nnz] (row * K + column,
ascending) and `values` bf16 [nnz]: 48 bits per kept weight, counted in bits/weight by
`outlier_bits`. Which weights to keep is compression's choice (lowbit/compress/outliers.py).
"""

from __future__ import annotations

import torch

BITS_PER_OUTLIER = 48


def pack_outliers(kept: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The side matrix as {'indices': int32 [nnz], 'values': bf16 [nnz]}."""
    index = mask.flatten().nonzero().flatten()
    return {"indices": index.to(torch.int32), "values": kept.flatten()[index].to(torch.bfloat16)}


def unpack_outliers(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dense float32 [N, K] side matrix S."""
    dense = torch.zeros(shape[0] * shape[1], dtype=torch.float32)
    dense[parts["indices"].long()] = parts["values"].float()
    return dense.view(shape)


def sparse_outliers(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The side matrix as a float32 sparse COO [N, K] tensor (what QuantLinear.set_outliers takes)."""
    index = parts["indices"].long()
    k = int(shape[1])
    coords = torch.stack([index // k, index % k])
    return torch.sparse_coo_tensor(coords, parts["values"].float(), tuple(int(d) for d in shape),
                                   is_coalesced=True, check_invariants=True)


def outlier_bits(count: int, shape: tuple[int, int]) -> float:
    """Extra bits per weight of `count` kept weights in an [N, K] matrix."""
    return BITS_PER_OUTLIER * count / (shape[0] * shape[1])
