"""Open a GGUF file, check it is whole, read its metadata, and dequantize one tensor at a time.

The container is parsed here (`_parse`); the `gguf` package decodes quantized blocks. Everything a
caller sees is plain Python values and torch tensors in Hugging Face's (rows, cols) order.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowbit.errors import LowbitError
from lowbit.formats.native import count_nonfinite

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


@dataclass(slots=True)
class Field:
    """One metadata entry: its GGUF value types (an array's element type after ARRAY) and its value:
    a scalar as a Python value (a string as bytes), a numeric array as numpy, a string array as a
    list of bytes. `contents()` is the decoded Python value."""

    types: list[int]
    value: Any

    def contents(self) -> Any:
        if self.types[0] == _STRING:
            return self.value.decode("utf-8")
        if self.types[0] != _ARRAY:
            return self.value
        if self.types[1] == _STRING:
            return [b.decode("utf-8") for b in self.value]
        if self.types[1] == _ARRAY:
            return [f.contents() for f in self.value]
        return self.value.tolist()


@dataclass(slots=True)
class _Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost first
    qtype: int
    type_name: str
    start: int  # byte offset in the file
    n_bytes: int


class GGUFFile:
    """A validated GGUF file: metadata by key, tensors by name."""

    __slots__ = ("path", "fields", "_tensors", "_map")

    def __init__(self, path: Path, fields: dict[str, Field], tensors: list[_Tensor]) -> None:
        self.path = path
        self.fields = fields
        self._tensors = {t.name: t for t in tensors}
        self._map: np.ndarray | None = None  # the file mapped read-only, at the first tensor read

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise LowbitError(f"{self.path} has no general.architecture in its metadata")
        return arch

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as str / int / float / bool / list, or `default` when absent."""
        field = self.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """A per-architecture key such as `llama.block_count`, given `block_count`."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def string_array(self, key: str) -> list[str]:
        """A string array decoded leniently: vocabularies may hold invalid UTF-8 byte pieces."""
        field = self.fields.get(key)
        if field is None or field.types[:2] != [_ARRAY, _STRING]:
            return []
        return [b.decode("utf-8", errors="replace") for b in field.value]

    def numeric_array(self, key: str) -> np.ndarray | None:
        field = self.fields.get(key)
        if field is None:
            return None
        if field.types[0] != _ARRAY or not isinstance(field.value, np.ndarray):
            return np.zeros(0)
        return field.value

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(t.name, t.type_name, tuple(reversed(t.dims)), t.n_bytes)

    def raw_bytes(self, name: str) -> bytes:
        return self._data(self._tensor(name)).tobytes()

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32, shaped as Hugging Face expects (outermost dim first)."""
        import gguf.quants  # late: the gguf package is slow to import and only GGUF work needs it

        t = self._tensor(name)
        if t.type_name not in SUPPORTED_TYPES:
            raise LowbitError(
                f"tensor {name} in {self.path.name} has GGUF type {t.type_name}, which lowbit cannot import "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        shape = tuple(reversed(t.dims))
        data = self._data(t)
        try:
            with np.errstate(all="ignore"):  # a damaged block overflows; said below, once, naming the tensor
                if t.type_name == "F64":
                    decoded = data.view(np.float64)
                else:
                    decoded = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.qtype))
                values = np.array(decoded, dtype=np.float32)
            out = torch.from_numpy(values).reshape(shape)  # a copy: the file is mapped read-only
        except (ValueError, RuntimeError) as exc:  # sizes that do not fit the type's blocks: a damaged table
            raise LowbitError(f"tensor {name} in {self.path.name} cannot be decoded as {t.type_name} {list(shape)}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        check_finite_tensor(out, name, self.path.name)
        return out

    def _data(self, t: _Tensor) -> np.ndarray:
        """The tensor's bytes as uint8 rows (outer dims flattened), a view of the mapped file."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        rows = math.prod(t.dims[1:])
        return self._map[t.start : t.start + t.n_bytes].reshape(rows, t.n_bytes // rows)

    def _tensor(self, name: str) -> _Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise LowbitError(f"{self.path.name} has no tensor named {name}") from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file; every failure is a one-line LowbitError naming the problem."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LowbitError(f"GGUF file not found: {path}")
    if path.is_dir():
        raise LowbitError(f"expected a GGUF file, got a directory: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise LowbitError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    fields, tensors = _parse(path, path.stat().st_size)
    return GGUFFile(path, fields, tensors)


def printable(text: str, limit: int = 80) -> str:
    """A name read from a file, safe in a one-line message: control characters (a damaged name may
    hold newlines or terminal escapes) as `?`, cut at `limit` characters."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# GGUF value types: the scalars' struct formats; 8 is a string (u64 length + bytes), 9 an array (u32
# element type + u64 count + elements).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32


def _parse(path: Path, size: int) -> tuple[dict[str, Field], list[_Tensor]]:
    """The metadata and the tensor table, every length and count checked against the file before
    it is used (a damaged count of 2^60 elements is a one-line error, not a loop that long).

    Why our own parser: the `gguf` package's reader builds numpy views for every piece of every
    field, 16 s for Gemma-3's 262144-token vocabulary; this walk takes well under a second."""
    if size < 24:
        raise LowbitError(f"{path} is truncated: {size} bytes cannot hold a GGUF header (24 bytes)")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _walk(path, size, data)


def _walk(path: Path, size: int, data) -> tuple[dict[str, Field], list[_Tensor]]:
    import gguf  # late: the gguf package is slow to import and only GGUF work needs it

    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise LowbitError(f"{path}: GGUF version {version} is not one lowbit reads (2 or 3)")
    # every metadata entry takes at least 13 bytes, every tensor entry at least 32
    if n_kv * 13 + n_tensors * 32 > size - 24:
        raise LowbitError(f"{path} is corrupt: its header counts {n_kv} metadata entries and {n_tensors} "
                          f"tensors, more than its {size} bytes can hold")
    pos = 24

    def need(n: int, what: str) -> None:
        if pos + n > size:
            raise LowbitError(f"{path} is truncated or corrupt: {what} runs past the end of the file "
                              f"(byte {pos + n} of {size})")

    def string(what: str) -> bytes:
        nonlocal pos
        need(8, what)
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        need(n, what)
        pos += n
        return data[pos - n : pos]

    def value(vtype: int, what: str) -> Field:
        nonlocal pos
        if vtype in _SCALARS:
            need(_SCALAR_BYTES[vtype], what)
            (v,) = struct.unpack_from(_SCALARS[vtype], data, pos)
            pos += _SCALAR_BYTES[vtype]
            return Field([vtype], v)
        if vtype == _STRING:
            return Field([vtype], string(what))
        if vtype != _ARRAY:
            raise LowbitError(f"{path} is corrupt: {what} has unknown GGUF value type {vtype}")
        need(12, what)
        etype, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        width = _SCALAR_BYTES.get(etype, 8 if etype == _STRING else 12 if etype == _ARRAY else None)
        if width is None:
            raise LowbitError(f"{path} is corrupt: {what} is an array of unknown GGUF type {etype}")
        need(count * width, f"{what} ({count} elements)")
        if etype in _SCALARS:
            # numpy reads struct's format codes: the same little-endian widths
            items = np.frombuffer(data, dtype=_SCALARS[etype], count=count, offset=pos).copy()
            pos += count * width
            return Field([_ARRAY, etype], items)
        if etype == _STRING:
            return Field([_ARRAY, _STRING], [string(what) for _ in range(count)])
        inner = [value(etype, what) for _ in range(count)]
        return Field([_ARRAY, *(inner[0].types if inner else [_ARRAY])], inner)

    def named(what: str, kind: str) -> tuple[str, str, int]:
        """An entry's name (a metadata key, a tensor name), safe to show, and the u32 after it."""
        nonlocal pos
        name = string(what).decode("utf-8", errors="replace")
        shown = printable(name)
        need(4, f"{kind} {shown}")
        (number,) = struct.unpack_from("<I", data, pos)
        pos += 4
        return name, shown, number

    fields: dict[str, Field] = {}
    for i in range(n_kv):
        key, shown, vtype = named(f"metadata key {i}", "metadata")
        fields[key] = value(vtype, f"metadata {shown}")
    table = []
    for i in range(n_tensors):
        name, shown, n_dims = named(f"tensor name {i}", "tensor")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise LowbitError(f"{path} is corrupt: tensor {shown} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        need(8 * n_dims + 12, f"tensor {shown}")
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos)
        qtype, offset = struct.unpack_from("<IQ", data, pos + 8 * n_dims)
        pos += 8 * n_dims + 12
        table.append((name, shown, dims, qtype, offset))
    alignment = fields.get("general.alignment")
    alignment = alignment.value if alignment is not None and alignment.types == [4] else _DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise LowbitError(f"{path} is corrupt: general.alignment is {alignment}, not a power of two")
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, shown, dims, qtype, offset in table:
        if any(d <= 0 for d in dims):
            raise LowbitError(f"{path} is corrupt: tensor {shown} has dimensions {list(dims)}")
        try:
            kind = gguf.GGMLQuantizationType(qtype)
            block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise LowbitError(f"{path} is corrupt: tensor {shown} has unknown GGUF tensor type {qtype}") from None
        if dims[0] % block:
            raise LowbitError(f"{path} is corrupt: tensor {shown} has rows of {dims[0]} values, not whole "
                              f"{kind.name} blocks of {block}")
        n_bytes = math.prod(dims) // block * type_bytes
        end = data_start + offset + n_bytes
        if end > size:
            raise LowbitError(
                f"{path} is truncated or corrupt: tensor {shown} ends at byte {end} but the file has {size} bytes"
            )
        tensors.append(_Tensor(name, tuple(dims), qtype, kind.name, data_start + offset, n_bytes))
    return fields, tensors


def check_finite_tensor(values: torch.Tensor, name: str, file: str) -> None:
    """Weights that are NaN or inf are never accepted: a LowbitError naming the tensor and how many."""
    bad = count_nonfinite(values)
    if bad:
        raise LowbitError(f"tensor {name} in {file} holds {bad} NaN/inf values: the file is damaged "
                          "(refusing to import it)")
