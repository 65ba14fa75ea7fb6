"""The integer formats' scale search in C (native/scale_search.c): every candidate's weighted
squared error per group in one pass over the group's values, where torch's search makes ~8 passes
over the whole matrix per candidate. `available()` is False without the library."""

from __future__ import annotations

import ctypes
import functools

import torch

from lowbit.native.build import bound_library

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib():
    return bound_library({"lowbit_int_scale_errors": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _F, _F, _P, _INT]})


def available() -> bool:
    return _lib() is not None


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
    rc = _lib().lowbit_int_scale_errors(
        x.data_ptr(), r * groups, g, None if weight is None else weight.data_ptr(), groups, scales.shape[0],
        scales.data_ptr(), None if zeros is None else zeros.data_ptr(), mid, top, errors.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lowbit_int_scale_errors failed with code {rc}")
    return errors
