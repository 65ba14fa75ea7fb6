"""The part of quantize / dequantize that is the same for every format.

A format module supplies the format-specific pieces —
  part_layout(spec, shape)                   what it stores (names, shapes, dtypes)
  compute_scales(w, spec, *, stats, ...)     GroupScales (searched unless the spec asks otherwise)
  scales_from_parts(qt)                      GroupScales decoded from a QTensor's stored scales
  quantize_group_values(x, scale, zero, spec) -> (codes, values)   the element quantizer
  dequantize_codes(codes, scale, zero, spec) -> values
  pack(codes, spec) / unpack(packed, spec, in_features)
  element_grid(spec) -> ElementGrid          optional: the element quantizer as a table, for
                                             formats that round x / scale to the nearest value
                                             of a fixed grid (GPTQ's C column loop reads it)
— and these functions turn them into whole-matrix quantize, dequantize and the column
quantizer GPTQ uses, so all formats share one tested path for groups and ragged edges.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from lowbit.errors import UsageError
from lowbit.quant.groups import GroupScales, check_weight, grouped, num_groups, ungrouped
from lowbit.quant.parts import layout_bytes
from lowbit.quant.qtensor import QTensor
from lowbit.quant.spec import FormatSpec


def quantize_with(fmt: ModuleType, w: torch.Tensor, spec: FormatSpec, scales: GroupScales) -> QTensor:
    w = check_weight(w)
    n, k = w.shape
    expected = (n, num_groups(k, scales.group_size))
    if tuple(scales.scale.shape) != expected:
        raise UsageError(f"{spec.label}: scales of shape {tuple(scales.scale.shape)} do not fit a weight {n}x{k} (need {expected})")
    if "scales" not in scales.stored:
        raise UsageError(f"{spec.label}: GroupScales carry no stored scale tensors; build them with compute_scales or scales_from_parts")
    zero = None if scales.zero is None else scales.zero.unsqueeze(-1)
    codes, _ = fmt.quantize_group_values(grouped(w, scales.group_size), scales.scale.unsqueeze(-1), zero, spec)
    qweight = fmt.pack(ungrouped(codes, k), spec)
    return QTensor(spec=spec, shape=(n, k), qweight=qweight, **scales.stored)


def dequantize_with(fmt: ModuleType, qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qt.shape
    scales = fmt.scales_from_parts(qt)
    codes = grouped(fmt.unpack(qt.qweight, qt.spec, k), scales.group_size)
    zero = None if scales.zero is None else scales.zero.unsqueeze(-1)
    values = fmt.dequantize_codes(codes, scales.scale.unsqueeze(-1), zero, qt.spec)
    return ungrouped(values, k).to(dtype)


def quantize_column_with(
    fmt: ModuleType, column: torch.Tensor, scales: GroupScales, index: int, spec: FormatSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize input column `index` (float [N]) with fixed scales: (codes uint8 [N], values float32 [N])."""
    scale, zero = scales.column(index)
    codes, values = fmt.quantize_group_values(column.detach().float().reshape(-1, 1), scale, zero, spec)
    return codes[:, 0], values[:, 0]


def public_functions(module_name: str):
    """quantize, dequantize, fake_quantize_column and bits_per_weight for one format module."""
    def fmt() -> ModuleType:
        return sys.modules[module_name]

    def quantize(w, spec: FormatSpec, *, scales: GroupScales | None = None, stats=None, global_scale=None) -> QTensor:
        """Quantize W[N, K]; scales are computed (searched per spec.scale_rule) unless given."""
        if scales is None:
            scales = fmt().compute_scales(w, spec, stats=stats, global_scale=global_scale)
        return quantize_with(fmt(), w, spec, scales)

    def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] the QTensor stands for."""
        return dequantize_with(fmt(), qt, dtype)

    def fake_quantize_column(column, scales: GroupScales, index: int, spec: FormatSpec):
        """GPTQ's element quantizer: column `index` with fixed scales → (codes [N], values [N])."""
        return quantize_column_with(fmt(), column, scales, index, spec)

    def bits_per_weight(spec: FormatSpec, in_features: int, out_features: int = 4096) -> float:
        """Stored bits per weight with every scale/zero/global part counted, for a [out, in] matrix."""
        layout = fmt().part_layout(spec, (out_features, in_features))
        return 8.0 * layout_bytes(layout) / (out_features * in_features)

    for f in (quantize, dequantize, fake_quantize_column, bits_per_weight):
        f.__module__ = module_name
    return quantize, dequantize, fake_quantize_column, bits_per_weight
