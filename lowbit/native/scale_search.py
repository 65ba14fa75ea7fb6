"""The integer formats' scale search in C (native/scale_search.c): every candidate's weighted
squared error per group in one pass over the group's values, where torch's search makes ~8 passes
over the whole matrix per candidate. `available()` is False without the library."""

from __future__ import annotations

import torch

from lowbit.native import build
from lowbit.native.build import F32, I64, INT, P

SIGNATURES = {"lowbit_int_scale_errors": [P, I64, I64, P, I64, I64, P, P, F32, F32, P, INT]}

library = build.binding("scale_search", SIGNATURES)


def available() -> bool:
    return library() is not None


def candidate_errors(x: torch.Tensor, weight: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor | None,
                     mid: float, top: float) -> torch.Tensor:
    """Errors float64 [C, R, G] of candidates scales/zeros [C, R, G] for values x [R, G, g] with
    column weights [1, G, g] (or None); zeros None: the fixed zero point `mid`."""
    r, groups, g = x.shape
    if x.dtype != torch.float32 or scales.shape[1:] != (r, groups) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"scale search: x {tuple(x.shape)} {x.dtype}, scales {tuple(scales.shape)} do not fit")
    x = x.contiguous()
    scales = scales.float().contiguous()
    zeros = None if zeros is None else zeros.float().contiguous()
    if weight is not None:
        if weight.shape != (1, groups, g):
            raise ValueError(f"scale search: weight {tuple(weight.shape)} is not [1, {groups}, {g}]")
        weight = weight.float().contiguous()
    errors = torch.empty(scales.shape, dtype=torch.float64)
    rc = library().lowbit_int_scale_errors(
        x.data_ptr(), r * groups, g, None if weight is None else weight.data_ptr(), groups, scales.shape[0],
        scales.data_ptr(), None if zeros is None else zeros.data_ptr(), mid, top, errors.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_int_scale_errors failed with code {rc}")
    return errors
