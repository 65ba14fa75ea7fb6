"""TrainableQuantLinear: a quantized Linear whose integer codes stay fixed while its scales train.

Every format dequantizes as `fmt.dequantize_codes(codes, scale, zero)` with the decoded scales of
`fmt.scales_from_parts(qt)` (quant/codec.py), which is linear in the stored float parts. So the
float parts of a QTensor (`scales` when they are float16/bfloat16/float32/float8, nf4's and dq's
`scales_scale` / `scales_offset`, nvfp4's `global_scale`) become float32 parameters, and an
asymmetric integer format's unpacked `zeros` do too. The forward rounds each one to its storage
dtype with a straight-through estimator (value of the rounded number, gradient of the identity),
so the weight the training sees is exactly the weight `to_qtensor()` writes: eval of the exported
checkpoint equals the trained model. Integer-coded parts (E8M0 exponents, dq's scale codes,
packed dq zero points), 8-bit float scales (nvfp4's E4M3: only its float32 global scale trains)
and `qweight` never change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import LowbitError
from lowbit.quant.groups import grouped, ungrouped
from lowbit.quant.qtensor import QTensor
from lowbit.quant.registry import get_format

# Parts that may train when stored as floats (qweight never does).
_FLOAT_PARTS = ("scales", "global_scale", "scales_scale", "scales_offset")


def round_to(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """value rounded to `dtype` and back to float32, with the identity's gradient."""
    if dtype == torch.float32:
        return value
    return value + (value.detach().to(dtype).float() - value.detach())


def _zero_top(qt: QTensor) -> int:
    return (1 << qt.spec.bits) - 1


class TrainableQuantLinear(nn.Module):
    def __init__(self, qt: QTensor, bias: bool = False, outliers: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.spec = qt.spec
        self.shape = tuple(qt.shape)
        self.out_features, self.in_features = self.shape
        self.fmt = get_format(qt.spec)
        self.qweight = qt.qweight.detach().clone()
        self.outliers = outliers  # exported unchanged; added to the weight densely while training
        self._dtypes: dict[str, torch.dtype] = {}
        self._fixed: dict[str, torch.Tensor] = {}
        for name, part in qt.scale_parts().items():
            # 8-bit float scales (nvfp4's E4M3) step by 6-12 %: straight-through rounding on so
            # coarse a grid makes the loss jump about rather than fall (measured), so they stay.
            if name in _FLOAT_PARTS and part.is_floating_point() and part.element_size() > 1:
                # a multiplier of the stored value: one learning rate fits scales of any magnitude
                self._dtypes[name] = part.dtype
                self.register_buffer(f"{name}_base", part.detach().float().clone(), persistent=False)
                self.register_parameter(name, nn.Parameter(torch.ones(part.shape)))
            elif name == "zeros" and not qt.spec.double_quant:
                # unpacked integer zero points [N, G]: trained as floats, rounded straight through
                self._dtypes[name] = part.dtype
                self.register_parameter(name, nn.Parameter(part.detach().float().clone()))
            else:
                self._fixed[name] = part.detach().clone()
        self.group_size = self.fmt.scales_from_parts(qt).group_size
        codes = self.fmt.unpack(qt.qweight, qt.spec, self.in_features)
        self.register_buffer("codes", grouped(codes.to(torch.uint8), self.group_size).contiguous(), persistent=False)
        dense_outliers = None
        if outliers is not None:
            from lowbit.quant.outlier_matrix import sparse_outliers

            dense_outliers = sparse_outliers(outliers, self.shape).to_dense().float()
        self.register_buffer("outlier_dense", dense_outliers, persistent=False)
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta")) if bias else None

    @property
    def trained_parts(self) -> list[str]:
        return list(self._dtypes)

    def _parts(self, exported: bool) -> dict[str, torch.Tensor]:
        parts = dict(self._fixed)
        for name, dtype in self._dtypes.items():
            value = getattr(self, name)
            if name == "zeros":
                rounded = value.detach().round().clamp(0, _zero_top(self))
                parts[name] = rounded.to(dtype) if exported else value + (rounded - value.detach())
            else:
                value = getattr(self, f"{name}_base") * value
                parts[name] = value.detach().to(dtype) if exported else round_to(value, dtype)
        return parts

    def weight(self) -> torch.Tensor:
        """The dequantized [N, K] float32 weight, differentiable in the trained parts."""
        view = QTensor(spec=self.spec, shape=self.shape, qweight=self.qweight, **self._parts(exported=False))
        sc = self.fmt.scales_from_parts(view)
        zero = None if sc.zero is None else sc.zero.unsqueeze(-1)
        w = ungrouped(self.fmt.dequantize_codes(self.codes, sc.scale.unsqueeze(-1), zero, self.spec), self.in_features)
        if self.outlier_dense is not None:
            w = w + self.outlier_dense
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def to_qtensor(self, where: str = "") -> QTensor:
        """The QTensor with the trained parts in their storage dtypes (the codes unchanged)."""
        parts = self._parts(exported=True)
        for name, part in parts.items():
            if part.is_floating_point() and not torch.isfinite(part.float()).all():
                raise LowbitError(f"{where or 'a layer'}: trained {name} holds NaN/inf (or overflows {part.dtype})")
        return QTensor(spec=self.spec, shape=self.shape, qweight=self.qweight.clone(), **parts)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.spec.label}, trains={self.trained_parts}"
