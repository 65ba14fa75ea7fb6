"""lowbit's native quantized checkpoint: safetensors shards + config.json's quantization_config.

Layout of a checkpoint directory:
  model.safetensors                      (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
      <module>.weight.<part>             each part of a quantized Linear's QTensor
                                         (qweight, scales, zeros, global_scale, scales_scale, scales_offset)
      <name>                             every tensor kept dense (embeddings, norms, biases, lm_head), as given
  config.json                            the model's config plus
      "quantization_config": {
          "quant_method": "lowbit", "version": 1,
          "modules": {"<module>": {"format": "int4-g128", "shape": [N, K],
                                   "spec": {name, bits, group_size, symmetric, scale_dtype,
                                            granularity, scale_rule, double_quant, layout_version}}}}

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
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_dir
from lowbit.quant.qtensor import PART_NAMES, QTensor

QUANT_METHOD = "lowbit"
VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def part_key(module: str, part: str) -> str:
    """The safetensors name of one part of a quantized module's weight."""
    return f"{module}.weight.{part}"


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
        return {"quant_method": QUANT_METHOD, "version": VERSION, "modules": dict(self.modules)}

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
) -> dict:
    """Write a complete checkpoint atomically (refuses an existing directory unless overwrite)."""
    with atomic_dir(directory, overwrite=overwrite) as tmp:
        writer = NativeWriter(tmp, max_shard_bytes=max_shard_bytes)
        for module, qt in qtensors.items():
            writer.add_quantized(module, qt)
        for name, tensor in (dense or {}).items():
            writer.add_dense(name, tensor)
        return writer.close(config or {})


def read_quantization_config(directory: str | os.PathLike) -> dict:
    """config.json's quantization_config of a lowbit checkpoint; LowbitError for anything else."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise LowbitError(f"{directory}: no config.json, not a lowbit checkpoint")
    try:
        qconfig = json.loads(path.read_text()).get("quantization_config")
    except json.JSONDecodeError as exc:
        raise LowbitError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != QUANT_METHOD:
        raise LowbitError(f"{directory}: not a lowbit quantized checkpoint (no quantization_config with quant_method 'lowbit')")
    if int(qconfig.get("version", 0)) > VERSION:
        raise LowbitError(f"{directory}: checkpoint version {qconfig.get('version')} is newer than this lowbit reads ({VERSION})")
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


class NativeReader:
    """Lazy access to a native checkpoint: one module's QTensor or one dense tensor at a time."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.quantization_config = read_quantization_config(self.directory)
        self.config = json.loads((self.directory / "config.json").read_text())
        self.module_meta: dict[str, dict] = self.quantization_config.get("modules", {})
        self._file_of = self._weight_map()
        quantized_keys = {part_key(m, p) for m in self.module_meta for p in PART_NAMES}
        self.dense_names = [n for n in self._file_of if n not in quantized_keys]
        self._handles: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            return json.loads(index.read_text())["weight_map"]
        single = self.directory / SINGLE_NAME
        if not single.is_file():
            raise LowbitError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME}")
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_NAME)

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise LowbitError(f"{self.directory}: tensor {name} is missing")
        file = self._file_of[name]
        if file not in self._handles:
            path = self.directory / file
            if not path.is_file():
                raise LowbitError(f"{self.directory}: shard {file} is missing")
            self._handles[file] = safe_open(str(path), framework="pt")
        return self._handles[file].get_tensor(name)

    @property
    def modules(self) -> list[str]:
        return list(self.module_meta)

    def quantized(self, module: str) -> QTensor:
        meta = self.module_meta[module]
        prefix = part_key(module, "")
        parts = {n[len(prefix):]: self._tensor(n) for n in self._file_of if n.startswith(prefix) and n[len(prefix):] in PART_NAMES}
        return QTensor.from_tensors(parts, meta, where=module)

    def dense(self, name: str) -> torch.Tensor:
        return self._tensor(name)


def load_native(directory: str | os.PathLike) -> NativeCheckpoint:
    """Every QTensor and dense tensor of a native checkpoint, on the CPU."""
    reader = NativeReader(directory)
    qtensors = {m: reader.quantized(m) for m in reader.modules}
    dense = {n: reader.dense(n) for n in reader.dense_names}
    return NativeCheckpoint(qtensors=qtensors, dense=dense, config=reader.config)
