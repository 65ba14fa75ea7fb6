"""Open a GGUF file, check it is whole, read its metadata, and dequantize one tensor at a time.

The `gguf` package parses the container and decodes quantized blocks; everything a caller
sees here is plain Python values and torch tensors in Hugging Face's (rows, cols) order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowbit.errors import LowbitError

GGUF_MAGIC = b"GGUF"

# Tensor types lowbit imports. Others (ternary, IQ1-3 grids, integer tensors) are refused
# by name rather than risk a silent mis-decode.
SUPPORTED_TYPES = frozenset(
    {
        "F32", "F16", "BF16", "F64",
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ4_NL", "IQ4_XS",
    }
)


@dataclass(slots=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # Hugging Face order: GGUF lists dimensions innermost first
    n_bytes: int


class GGUFFile:
    """A validated GGUF file: metadata by key, tensors by name."""

    __slots__ = ("path", "_reader", "_tensors")

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise LowbitError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as str / int / float / bool / list, or `default` when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """A per-architecture key such as `llama.block_count`, given `block_count`."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def string_array(self, key: str) -> list[str]:
        """A string array decoded leniently: vocabularies may hold invalid UTF-8 byte pieces."""
        field = self._reader.fields.get(key)
        if field is None:
            return []
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]

    def numeric_array(self, key: str) -> np.ndarray | None:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if not field.data:
            return np.zeros(0)
        return np.concatenate([np.asarray(field.parts[i]) for i in field.data])

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(t.name, t.tensor_type.name, tuple(reversed([int(d) for d in t.shape])), int(t.n_bytes))

    def raw_bytes(self, name: str) -> bytes:
        return self._tensor(name).data.tobytes()

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32, shaped as Hugging Face expects (outermost dim first)."""
        import gguf.quants  # late: the gguf package is slow to import and only GGUF work needs it

        t = self._tensor(name)
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise LowbitError(
                f"tensor {name} in {self.path.name} has GGUF type {type_name}, which lowbit cannot import "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        shape = tuple(reversed([int(d) for d in t.shape]))
        with np.errstate(all="ignore"):  # a damaged block overflows; said below, once, naming the tensor
            values = np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
        out = torch.from_numpy(values).reshape(shape)  # a copy: the file is mapped read-only
        check_finite_tensor(out, name, self.path.name)
        return out

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise LowbitError(f"{self.path.name} has no tensor named {name}") from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file; every failure is a one-line LowbitError naming the problem."""
    from gguf import GGUFReader  # late: the gguf package is slow to import and only GGUF work needs it

    path = Path(path).expanduser()
    if not path.exists():
        raise LowbitError(f"GGUF file not found: {path}")
    if path.is_dir():
        raise LowbitError(f"expected a GGUF file, got a directory: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise LowbitError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the parser reports truncation as assorted numpy errors
        raise LowbitError(
            f"{path} is truncated or corrupt: the GGUF header could not be parsed ({size} bytes; "
            f"{type(exc).__name__}: {exc})"
        ) from exc
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise LowbitError(
                f"{path} is truncated: tensor {t.name} ends at byte {end} but the file has {size} bytes"
            )
    return GGUFFile(path, reader)


def check_finite_tensor(values: torch.Tensor, name: str, file: str) -> None:
    """Weights that are NaN or inf are never accepted: a LowbitError naming the tensor and how many."""
    bad = ~torch.isfinite(values)
    if bad.any():
        raise LowbitError(f"tensor {name} in {file} holds {int(bad.sum())} NaN/inf values: the file is damaged "
                          "(refusing to import it)")
