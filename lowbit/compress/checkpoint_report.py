"""What a quantized checkpoint holds, per quantized layer, and how far it is from its float base.

`inspect_checkpoint(path, base=None)` reads a lowbit checkpoint one module at a time (NativeReader),
a GPTQ, AWQ or compressed-tensors directory whole (each layer as the QTensor lowbit runs, its bytes
as lowbit holds them: a GPTQ layer's zero points counted as lowbit stores them, not as int32 words),
a GGUF file by its GGUF types and stored bytes;
with a base model each layer's relative reconstruction error ‖W − Ŵ‖ / ‖W‖ (float64) is computed
against the base's weight, read lazily from its safetensors, and rows come worst first.
A layer's outlier side matrix (`--keep-outliers`) counts in its bytes and bits/weight at 48 bits per
kept weight, and its error is that of Ŵ + S, what the runtime computes with.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from lowbit.formats.source_tensors import SourceTensors
from lowbit.errors import LowbitError
from lowbit.formats.checkpoint import natural_key
from lowbit.formats.foreign import detect_checkpoint_kind, read_checkpoint
from lowbit.formats.resolve import resolve_model
from lowbit.formats.native import NativeReader, is_native
from lowbit.quant.outlier_matrix import outlier_bits, unpack_outliers
from lowbit.quant.rtn import tensor_relative_error


@dataclass(slots=True)
class LayerRow:
    name: str
    format: str  # spec label
    shape: tuple[int, int]
    group: str  # "g64", "block128", "channel", "tensor"
    bits_per_weight: float  # scales, zeros, global scales and the outlier side matrix included
    bytes: int
    rel_error: float | None = None
    outliers: int = 0  # weights kept in bf16 beside the format (48 bits each)

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "shape": list(self.shape), "group": self.group,
                "bits_per_weight": self.bits_per_weight, "bytes": self.bytes, "rel_error": self.rel_error,
                "outliers": self.outliers}


@dataclass(slots=True)
class InspectReport:
    path: str
    base: str | None
    rows: list[LayerRow]
    dense_params: int  # every tensor kept dense (embeddings, norms, skipped Linears), a tied matrix once
    dense_bytes: int
    formats: dict[str, int] = field(default_factory=dict)
    kind: str = "native"  # or gptq / awq / compressed-tensors: read through formats/foreign.py
    # module -> (the file's format, why lowbit reads it as float): GPTQ act-order, say; counted as dense
    read_as_float: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def quantized_params(self) -> int:
        return sum(r.shape[0] * r.shape[1] for r in self.rows)

    @property
    def outliers(self) -> int:
        return sum(r.outliers for r in self.rows)

    @property
    def quantized_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def total_params(self) -> int:
        return self.quantized_params + self.dense_params

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.dense_bytes

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.total_params

    def to_dict(self) -> dict:
        q, t = self.quantized_params, self.total_params
        return {
            "path": self.path,
            "base": self.base,
            "kind": self.kind,
            "formats": self.formats,
            "read_as_float": {m: {"format": f, "reason": r} for m, (f, r) in self.read_as_float.items()},
            "layers": [r.to_dict() for r in self.rows],
            "quantized": {"params": q, "bytes": self.quantized_bytes,
                          "bits_per_weight": 8.0 * self.quantized_bytes / max(1, q), "outliers": self.outliers},
            "dense": {"params": self.dense_params, "bytes": self.dense_bytes},
            "total": {"params": t, "bytes": self.total_bytes, "bits_per_weight": 8.0 * self.total_bytes / max(1, t),
                      "bf16_bytes": self.bf16_bytes, "ratio_vs_bf16": self.total_bytes / max(1, self.bf16_bytes)},
        }


def group_label(spec) -> str:
    if spec.granularity == "group":
        return f"g{spec.group_size}"
    if spec.granularity == "block":
        return f"block{spec.group_size}"
    return spec.granularity


def inspect_checkpoint(path: str | os.PathLike, base: str | os.PathLike | None = None) -> InspectReport:
    """A lowbit checkpoint read one module at a time, or a GPTQ / AWQ / compressed-tensors directory
    read whole (formats/foreign.py: each layer as the QTensor lowbit runs, its bytes as stored)."""
    name = str(path)
    path = resolve_model(path)  # demo names and hub ids too, like every other command's model argument
    if not is_native(path):
        kind = detect_checkpoint_kind(path)
        if kind == "hf":
            raise LowbitError(f"{name} is a float checkpoint: no quantized layers to inspect "
                              f"(make one with `lowbit quantize {name} --format int4 -o OUT`)")
        if kind == "gguf":
            return _inspect_gguf(path, base)
        return _inspect_foreign(path, kind, base)
    reader = NativeReader(path)
    source = _base_tensors(base) if base is not None else None
    rows = []
    for module in reader.modules:
        rows.append(_row(module, reader.quantized(module), reader.outliers(module), source))
    dense = ((t.numel(), t.numel() * t.element_size()) for t in map(reader.dense, reader.dense_names))
    return _report(path, base, rows, dense, source is not None)


def _inspect_foreign(path, kind: str, base) -> InspectReport:
    ckpt = read_checkpoint(path, kind)
    source = _base_tensors(base) if base is not None else None
    rows = [_row(module, qt, None, source) for module, qt in ckpt.qtensors.items()]
    dense = ((t.numel(), t.numel() * t.element_size()) for t in ckpt.dense.values())
    report = _report(path, base, rows, dense, source is not None)
    report.kind, report.read_as_float = kind, dict(ckpt.unexpressed)
    return report


def _inspect_gguf(path, base) -> InspectReport:
    """A GGUF file: each projection under its GGUF type (Q4_0, Q8_0, MXFP4 as the QTensor lowbit runs;
    K-quants and the rest by their exact float values), its bytes as the file stores them; the
    dense part is every other tensor of the file at its stored bytes."""
    from lowbit.formats.gguf_blocks import exact_gguf_type

    ckpt = read_checkpoint(path, "gguf")
    gguf = ckpt.gguf
    infos = [gguf.info(n) for n in gguf.tensor_names()]
    bits_of = {i.type_name: 8.0 * i.n_bytes / max(1, math.prod(i.shape)) for i in infos}  # a type's bits per weight
    source = _base_tensors(base) if base is not None else None
    rows = []
    for module, qt in ckpt.qtensors.items():
        row = _row(module, qt, None, source)
        stored = ckpt.stored_as.get(module)  # a Q5_0 tensor runs as int8-g32: the row says what the file holds
        if stored is not None:
            row.format, row.bits_per_weight = stored, bits_of[stored]
            row.bytes = round(bits_of[stored] * qt.shape[0] * qt.shape[1] / 8)
        else:
            row.format = exact_gguf_type(qt.spec, qt.shape[1], qt.scales) or qt.spec.label
        rows.append(row)
    for module, (gtype, _) in ckpt.unexpressed.items():
        w = ckpt.dense[f"{module}.weight"]
        bits = bits_of.get(gtype, 32.0)
        row = LayerRow(module, gtype, tuple(w.shape), _gguf_group(gtype), bits, round(bits * w.numel() / 8))
        if source is not None:
            row.rel_error = _dense_error_against(source, module, w)
        rows.append(row)
    total_params, total_bytes = sum(math.prod(i.shape) for i in infos), sum(i.n_bytes for i in infos)
    quantized = sum(r.shape[0] * r.shape[1] for r in rows)
    dense = [(total_params - quantized, total_bytes - sum(r.bytes for r in rows))]
    report = _report(path, base, rows, dense, source is not None)
    report.kind = "gguf"
    return report


def _gguf_group(type_name: str) -> str:
    """g32 for llama.cpp's 32-weight blocks (Q5_0, Q4_1, ...), sb256 for a K-quant's super-blocks."""
    import gguf

    try:
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    except KeyError:
        return "-"
    return "-" if block == 1 else f"sb{block}" if block == 256 else f"g{block}"


def _row(module: str, qt, side, source) -> LayerRow:
    kept = 0 if side is None else int(side["indices"].numel())
    side_bytes = 0 if side is None else sum(t.numel() * t.element_size() for t in side.values())
    row = LayerRow(module, qt.spec.label, tuple(qt.shape), group_label(qt.spec),
                   qt.bits_per_weight + outlier_bits(kept, tuple(qt.shape)), qt.nbytes + side_bytes, outliers=kept)
    if source is not None:
        row.rel_error = _error_against(source, module, qt, side)
    return row


def _report(path, base, rows: list[LayerRow], dense, sort_by_error: bool) -> InspectReport:
    """dense: (params, bytes) of each tensor kept dense."""
    if sort_by_error:
        rows.sort(key=lambda r: -r.rel_error)
    else:
        rows.sort(key=lambda r: natural_key(r.name))
    dense_params = dense_bytes = 0
    for params, nbytes in dense:
        dense_params += params
        dense_bytes += nbytes
    formats: dict[str, int] = {}
    for r in rows:
        formats[r.format] = formats.get(r.format, 0) + 1
    return InspectReport(str(path), str(base) if base is not None else None, rows, dense_params, dense_bytes, formats)


def _base_tensors(base):
    directory = resolve_model(base)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise LowbitError(f"base model {base} is not a model directory with config.json")
    if is_native(directory):
        raise LowbitError(f"base model {base} is itself quantized; --base needs the float model")
    return SourceTensors(directory)


def _dense_error_against(source, module: str, w: torch.Tensor) -> float:
    name = f"{module}.weight"
    if name not in source.shapes or tuple(source.shapes[name]) != tuple(w.shape):
        raise LowbitError(f"base model has no {name} of shape {tuple(w.shape)}: is it the model this file was made from?")
    return tensor_relative_error(source.get(name).double(), w.double())


def _error_against(source, module: str, qt, side=None) -> float:
    """‖W − (Ŵ + S)‖ / ‖W‖ in float64 (S: the outlier side matrix, when the layer has one)."""
    name = f"{module}.weight"
    if name not in source.shapes:
        raise LowbitError(f"base model has no {name}: is it the model this checkpoint was made from?")
    if tuple(source.shapes[name]) != tuple(qt.shape):
        raise LowbitError(f"base {name} has shape {tuple(source.shapes[name])}, the checkpoint {tuple(qt.shape)}")
    w = source.get(name).double()
    approx = qt.dequantize(torch.float64)
    if side is not None:
        approx = approx + unpack_outliers(side, tuple(qt.shape)).double()
    return tensor_relative_error(w, approx)
