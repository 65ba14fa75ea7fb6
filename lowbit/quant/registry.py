"""Formats by name: the one place that maps a spec to the module implementing it."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from lowbit.errors import UsageError
from lowbit.quant.parts import layout_bytes
from lowbit.quant.spec import FormatSpec, list_formats, parse_spec

_MODULES = {
    "int": "lowbit.quant.intq",
    "nf4": "lowbit.quant.nf4",
    "fp8": "lowbit.quant.fp8",
    "mxfp4": "lowbit.quant.mxfp4",
    "nvfp4": "lowbit.quant.nvfp4",
}

__all__ = ["get_format", "parse_spec", "list_formats", "weight_bytes", "bits_per_weight", "as_spec"]


def as_spec(spec: FormatSpec | str) -> FormatSpec:
    return spec if isinstance(spec, FormatSpec) else parse_spec(spec)


def get_format(spec: FormatSpec | str) -> ModuleType:
    """The module implementing a spec or format name ("int4-asym", "nf4", "int", ...)."""
    if isinstance(spec, str) and spec in _MODULES:
        family = spec
    else:
        family = as_spec(spec).family
    if family not in _MODULES:
        raise UsageError(f"unknown format '{spec}'")
    return importlib.import_module(_MODULES[family])


def part_layout(spec: FormatSpec | str, shape: tuple[int, int]) -> dict:
    """{part name: (shape, torch dtype)} that a QTensor of this spec and weight shape stores."""
    spec = as_spec(spec)
    return get_format(spec).part_layout(spec, tuple(shape))


def weight_bytes(spec: FormatSpec | str, shape: tuple[int, int]) -> int:
    """Exact stored bytes of a [out_features, in_features] weight, scales and zeros included."""
    return layout_bytes(part_layout(spec, shape))


def bits_per_weight(spec: FormatSpec | str, shape: tuple[int, int]) -> float:
    return 8.0 * weight_bytes(spec, shape) / (shape[0] * shape[1])


def dense_bytes(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> int:
    return shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
