"""lowbit's native quantized checkpoint: safetensors shards + config.json's quantization_config.

Layout of a checkpoint directory:
  model.safetensors                      (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
      <module>.weight.<part>             each part of a quantized Linear's QTensor
                                         (qweight, scales, zeros, global_scale, scales_scale, scales_offset)
      <module>.outliers.indices          optional side matrix S of weights kept outside the format
      <module>.outliers.values           (quant/outlier_matrix.py): int32 [nnz] row * K + column, strictly
                                         ascending, and bf16 [nnz]; the layer computes x Ŵᵀ + x Sᵀ
      <name>                             every tensor kept dense (embeddings, norms, biases, lm_head), as given
  config.json                            the model's config plus
      "quantization_config": {
          "quant_method": "lowbit", "version": 1 (2 when any module has outliers),
          "modules": {"<module>": {"format": "int4-g128", "shape": [N, K],
                                   "spec": {name, bits, group_size, symmetric, scale_dtype,
                                            granularity, scale_rule, double_quant, layout_version}}},
          "outliers": {"<module>": {"count": nnz}}}       (only when some module has them)

A checkpoint with outliers says version 2 so that a lowbit from before side matrices refuses it
("newer than this lowbit reads") rather than running it without them.

The spec of each module fully determines which parts exist and their shapes and dtypes
(quant/<format>.py documents the bit layouts), so `load_native` rebuilds identical QTensors.
`NativeWriter` streams tensors into shards as they are produced, so a layer-by-layer quantizer
never holds the whole model; `NativeReader` loads one module at a time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_dir
from lowbit.formats.hf_files import open_safetensors, read_json, read_tensor
from lowbit.quant.qtensor import PART_NAMES, QTensor

QUANT_METHOD = "lowbit"
VERSION = 2  # the newest this code reads and writes; 1 when a checkpoint has no outliers
OUTLIER_PARTS = ("indices", "values")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def part_key(module: str, part: str) -> str:
    """The safetensors name of one part of a quantized module's weight."""
    return f"{module}.weight.{part}"


def outlier_key(module: str, part: str) -> str:
    """The safetensors name of one part of a module's outlier side matrix ("indices" or "values")."""
    return f"{module}.outliers.{part}"


def check_outliers(parts: dict[str, torch.Tensor], shape, where: str) -> dict[str, torch.Tensor]:
    """The side matrix's parts if they are well formed for an [N, K] weight; LowbitError otherwise."""
    if set(parts) != set(OUTLIER_PARTS):
        raise LowbitError(f"{where}: outliers need parts {list(OUTLIER_PARTS)}, got {sorted(parts)}")
    indices, values = parts["indices"], parts["values"]
    if indices.dtype != torch.int32 or values.dtype != torch.bfloat16 or indices.dim() != 1 or values.shape != indices.shape:
        raise LowbitError(
            f"{where}: outliers must be int32 indices and bf16 values of one length, got "
            f"{indices.dtype} {tuple(indices.shape)} and {values.dtype} {tuple(values.shape)}"
        )
    size = int(shape[0]) * int(shape[1])
    if indices.numel() and (int(indices[0]) < 0 or int(indices[-1]) >= size or bool((indices[1:] <= indices[:-1]).any())):
        raise LowbitError(f"{where}: outlier indices must be strictly ascending and inside the {shape[0]}x{shape[1]} weight")
    return {"indices": indices, "values": values}


class NativeWriter:
    """Write quantized modules and dense tensors into an existing (e.g. atomic temp) directory.

    Call `add_quantized` / `add_dense` in any order, then `close(config)` once: it names the
    shards, writes the index when there is more than one, and writes config.json with the
    quantization_config (merged into `config`, or into a config.json already in the directory).
    """

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.modules: dict[str, dict] = {}
        self.outliers: dict[str, dict] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()

    def add_quantized(self, module: str, qt: QTensor) -> None:
        if module in self.modules:
            raise UsageError(f"module {module} was already written")
        for part, tensor in qt.to_tensors().items():
            self._add(part_key(module, part), tensor)
        self.modules[module] = qt.meta()

    def add_outliers(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        """The side matrix of a module already added with `add_quantized` (see quant/outlier_matrix.py)."""
        if module not in self.modules:
            raise UsageError(f"outliers for {module}, which was not written as a quantized module")
        if module in self.outliers:
            raise UsageError(f"outliers of {module} were already written")
        parts = check_outliers(parts, self.modules[module]["shape"], module)
        for part in OUTLIER_PARTS:
            self._add(outlier_key(module, part), parts[part].contiguous().cpu())
        self.outliers[module] = {"count": int(parts["indices"].numel())}

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        self._add(name, tensor.detach().contiguous().cpu())

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise UsageError(f"tensor {name} was already written")
        self._names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self._shards):05d}.safetensors"
        # One metadata key only: safetensors writes a multi-key metadata map in random order,
        # which would make identical checkpoints differ byte for byte.
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def quantization_config(self) -> dict:
        qconfig = {"quant_method": QUANT_METHOD, "version": 2 if self.outliers else 1, "modules": dict(self.modules)}
        if self.outliers:
            qconfig["outliers"] = dict(self.outliers)
        return qconfig

    def close(self, config: dict | None = None) -> dict:
        """Finish the shards and config.json; returns the quantization_config written."""
        if self._pending or not self._shards:
            self._flush()
        total = len(self._shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards):
            final = SINGLE_NAME if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(tmp, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        if total > 1:
            index = {"metadata": {"total_size": sum((self.directory / f).stat().st_size for f in set(weight_map.values()))},
                     "weight_map": weight_map}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config_path = self.directory / "config.json"
        if config is None:
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
        qconfig = self.quantization_config()
        config = {**config, "quantization_config": qconfig}
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        return qconfig


def save_native(
    directory: str | os.PathLike,
    qtensors: dict[str, QTensor],
    dense: dict[str, torch.Tensor] | None = None,
    *,
    config: dict | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    outliers: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict:
    """Write a complete checkpoint atomically (refuses an existing directory unless overwrite).
    `outliers`: module -> {'indices', 'values'} side matrices (quant/outlier_matrix.py `pack_outliers`)."""
    with atomic_dir(directory, overwrite=overwrite) as tmp:
        writer = NativeWriter(tmp, max_shard_bytes=max_shard_bytes)
        for module, qt in qtensors.items():
            writer.add_quantized(module, qt)
        for module, parts in (outliers or {}).items():
            writer.add_outliers(module, parts)
        for name, tensor in (dense or {}).items():
            writer.add_dense(name, tensor)
        return writer.close(config or {})


def read_quantization_config(directory: str | os.PathLike) -> dict:
    """config.json's quantization_config of a lowbit checkpoint; LowbitError for anything else."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise LowbitError(f"{directory}: no config.json, not a lowbit checkpoint")
    qconfig = read_json(path).get("quantization_config")
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != QUANT_METHOD:
        raise LowbitError(f"{directory}: not a lowbit quantized checkpoint (no quantization_config with quant_method 'lowbit')")
    version = qconfig.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise LowbitError(f"{path}: quantization_config.version {json.dumps(version)[:40]} is not an integer")
    if version > VERSION:
        raise LowbitError(f"{directory}: checkpoint version {version} is newer than this lowbit reads ({VERSION})")
    for key in ("modules", "outliers"):
        entries = qconfig.get(key, {})
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            raise LowbitError(f"{path}: quantization_config.{key} is not an object of per-module objects")
    for module, meta in qconfig.get("modules", {}).items():
        shape = meta.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise LowbitError(f"{path}: quantization_config.modules.{module}.shape {json.dumps(shape)[:40]} is not [rows, columns]")
        if not isinstance(meta.get("spec"), dict):
            raise LowbitError(f"{path}: quantization_config.modules.{module} has no spec object")
    return qconfig


def is_native(directory: str | os.PathLike) -> bool:
    try:
        read_quantization_config(directory)
    except LowbitError:
        return False
    return True


@dataclass(slots=True)
class NativeCheckpoint:
    qtensors: dict[str, QTensor]
    dense: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)
    outliers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> side matrix parts


class NativeReader:
    """Lazy access to a native checkpoint: one module's QTensor or one dense tensor at a time."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.quantization_config = read_quantization_config(self.directory)
        self.config = read_json(self.directory / "config.json")
        self.module_meta: dict[str, dict] = self.quantization_config.get("modules", {})
        self.outlier_meta: dict[str, dict] = self.quantization_config.get("outliers", {})
        unknown = sorted(set(self.outlier_meta) - set(self.module_meta))
        if unknown:
            raise LowbitError(f"{self.directory}: outliers listed for {unknown[0]}, which is not a quantized module")
        self._file_of = self._weight_map()
        packed = self.packed_names  # once: a set built per name made loading quadratic (0.35 s on SmolLM2)
        self.dense_names = [n for n in self._file_of if n not in packed]
        self._handles: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
                raise LowbitError(f"{index}: weight_map is not an object of tensor name -> shard file")
            return weight_map
        single = self.directory / SINGLE_NAME
        if not single.is_file():
            raise LowbitError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME}")
        return dict.fromkeys(open_safetensors(single).keys(), SINGLE_NAME)

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise LowbitError(f"{self.directory}: tensor {name} is missing")
        file = self._file_of[name]
        path = self.directory / file
        if file not in self._handles:
            if not path.is_file():
                raise LowbitError(f"{self.directory}: shard {file} is missing")
            self._handles[file] = open_safetensors(path)
        return read_tensor(self._handles[file], name, path)

    @property
    def modules(self) -> list[str]:
        return list(self.module_meta)

    @property
    def packed_names(self) -> set[str]:
        """safetensors names of every quantized part and outlier part (everything not dense)."""
        names = {part_key(m, p) for m in self.module_meta for p in PART_NAMES}
        return names | {outlier_key(m, p) for m in self.outlier_meta for p in OUTLIER_PARTS}

    def outliers(self, module: str) -> dict[str, torch.Tensor] | None:
        """The module's side matrix {'indices', 'values'}, checked against its shape and count; None without."""
        if module not in self.outlier_meta:
            return None
        parts = check_outliers({p: self._tensor(outlier_key(module, p)) for p in OUTLIER_PARTS},
                               self.module_meta[module]["shape"], module)
        if parts["indices"].numel() != int(self.outlier_meta[module].get("count", -1)):
            raise LowbitError(f"{self.directory}: {module} has {parts['indices'].numel()} outliers, config.json says {self.outlier_meta[module].get('count')}")
        return parts

    def quantized(self, module: str) -> QTensor:
        meta = self.module_meta[module]
        parts = {p: self._tensor(part_key(module, p)) for p in PART_NAMES if part_key(module, p) in self._file_of}
        try:
            qt = QTensor.from_tensors(parts, meta, where=module)
        except UsageError as exc:  # the spec's own validation speaks of options; here it is the file's
            raise LowbitError(f"{self.directory}: {module} has an invalid format spec in config.json: {exc}") from None
        for part, tensor in parts.items():
            if tensor.is_floating_point():  # the scales: NaN/inf only in a damaged file
                check_finite_part(tensor, f"{module}.weight.{part}", self.directory)
        return qt

    def dense(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        check_finite_part(tensor, name, self.directory)
        return tensor


FINITE_CHUNK = 1 << 22  # elements per isfinite pass: its temporaries stay ~4 MB


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many NaN/inf values a float tensor holds, chunk by chunk: torch's isfinite of a whole
    tensor makes several temporaries of its size (loading Gemma-3's 168 M-value embedding peaked
    ~0.9 GB higher for them)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    flat = tensor.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), FINITE_CHUNK):
        part = flat[start : start + FINITE_CHUNK]
        if part.element_size() == 1:  # float8 has no isfinite kernel; bf16 holds every value it can
            part = part.to(torch.bfloat16)
        finite = torch.isfinite(part)
        if not bool(finite.all()):
            bad += int(finite.numel() - finite.sum())
    return bad


def check_finite_part(tensor: torch.Tensor, name: str, where) -> None:
    """A float tensor of a checkpoint holding NaN/inf: a LowbitError naming it (the loader's check too)."""
    bad = count_nonfinite(tensor)
    if bad:
        raise LowbitError(f"tensor {name} in {where} holds {bad} NaN/inf value(s): the checkpoint is damaged")


def load_native(directory: str | os.PathLike) -> NativeCheckpoint:
    """Every QTensor and dense tensor of a native checkpoint, on the CPU."""
    reader = NativeReader(directory)
    qtensors = {m: reader.quantized(m) for m in reader.modules}
    dense = {n: reader.dense(n) for n in reader.dense_names}
    outliers = {m: reader.outliers(m) for m in reader.outlier_meta}
    return NativeCheckpoint(qtensors=qtensors, dense=dense, config=reader.config, outliers=outliers)
