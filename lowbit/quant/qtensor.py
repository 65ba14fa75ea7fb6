"""QTensor: one quantized weight matrix — its packed tensors, logical shape and FormatSpec.

The tensor parts (which ones exist, their shapes and dtypes) are fixed by the spec; each
format module's `part_layout(spec, shape)` says exactly what they are, and `from_tensors`
checks a loaded set against it, so a corrupt or mismatched checkpoint fails with one line.

Part names (not every format has every part):
  qweight        packed element codes, [N, ceil(K*bits/8)] uint8 (int8: [N, K] int8; fp8: [N, K] float8)
  scales         per-group scales in the spec's scale dtype
  zeros          asymmetric int zero points, uint8 [N, G]
  global_scale   nvfp4 per-tensor fp32 multiplier, [1]
  scales_scale   nf4 double quantization: fp32 scale of each run of 256 scale codes
  scales_offset  nf4 double quantization: fp32 mean added back to the decoded scales, [1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.quant.registry import get_format
from lowbit.quant.spec import FormatSpec

PART_NAMES = ("qweight", "scales", "zeros", "global_scale", "scales_scale", "scales_offset")


@dataclass(slots=True)
class QTensor:
    spec: FormatSpec
    shape: tuple[int, int]  # (out_features, in_features) of the logical weight
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    scales_scale: torch.Tensor | None = None
    scales_offset: torch.Tensor | None = None

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors that exist, by part name."""
        out = {}
        for name in PART_NAMES:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def scale_parts(self) -> dict[str, torch.Tensor]:
        """Every part except qweight: what GroupScales.stored holds for these scales."""
        return {name: t for name, t in self.parts().items() if name != "qweight"}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Contiguous CPU copies of the parts, ready for safetensors."""
        return {name: t.detach().contiguous().cpu() for name, t in self.parts().items()}

    def meta(self) -> dict:
        """JSON-ready description; with `to_tensors()` it rebuilds this QTensor exactly."""
        return {"format": self.spec.label, "spec": self.spec.to_dict(), "shape": list(self.shape)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict, where: str = "tensor") -> QTensor:
        """Rebuild from `to_tensors()` + `meta()`; shapes and dtypes are checked against the spec."""
        try:
            spec = FormatSpec.from_dict(meta["spec"])
            shape = (int(meta["shape"][0]), int(meta["shape"][1]))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise LowbitError(f"{where}: quantization metadata is incomplete ({exc!r})") from exc
        layout = get_format(spec).part_layout(spec, shape)
        missing = sorted(set(layout) - set(tensors))
        extra = sorted(set(tensors) - set(layout))
        if missing or extra:
            raise LowbitError(f"{where}: {spec.label} expects parts {sorted(layout)}, found {sorted(tensors)}")
        for name, (part_shape, dtype) in layout.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(part_shape) or t.dtype != dtype:
                raise LowbitError(
                    f"{where}.{name}: expected {dtype} {tuple(part_shape)} for {spec.label}, found {t.dtype} {tuple(t.shape)}"
                )
        return cls(spec=spec, shape=shape, **{name: tensors[name] for name in layout})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per logical weight, scales, zeros and global scales included."""
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return get_format(self.spec).dequantize(self, dtype=dtype)

    @property
    def row_aligned(self) -> bool:
        """Whether every part is indexed by output row first (or holds one value for the tensor), so
        `rows` can cut any set of rows out without decoding the rest. Not so: fp8 2-D blocks and nf4's
        double-quantized scale runs, which span rows."""
        n = self.shape[0]
        return all(t.shape[0] == n or t.numel() == 1 for t in self.parts().values())

    def rows(self, index: torch.Tensor) -> QTensor:
        """The QTensor of rows `index` (a 1-D long tensor) of a row-aligned QTensor."""
        if not self.row_aligned:
            raise LowbitError(f"{self.spec.label}: its parts span rows, so rows cannot be cut out")
        n = self.shape[0]
        cut = {name: (t.index_select(0, index) if t.shape[0] == n and t.numel() != 1 else t)
               for name, t in self.parts().items()}
        return QTensor(spec=self.spec, shape=(int(index.numel()), self.shape[1]), **cut)

    def to(self, device: torch.device | str) -> QTensor:
        moved = {name: t.to(device) for name, t in self.parts().items()}
        return QTensor(spec=self.spec, shape=self.shape, **moved)
