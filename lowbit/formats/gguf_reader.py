"""Open a GGUF file, check it is whole, read its metadata, and dequantize one tensor at a time.

The `gguf` package parses the container and decodes quantized blocks; everything a caller
sees here is plain Python values and torch tensors in Hugging Face's (rows, cols) order.
"""

from __future__ import annotations

import math
import os
import warnings
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
        try:
            with np.errstate(all="ignore"):  # a damaged block overflows; said below, once, naming the tensor
                values = np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
            out = torch.from_numpy(values).reshape(shape)  # a copy: the file is mapped read-only
        except (ValueError, RuntimeError) as exc:  # sizes that do not fit the type's blocks: a damaged table
            raise LowbitError(f"tensor {name} in {self.path.name} cannot be decoded as {type_name} {list(shape)}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
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
    _check_structure(path, size)
    try:
        # The parser adds offsets and multiplies dimensions in numpy's 64-bit integers: a damaged
        # table overflows them (a RuntimeWarning and a wrapped value), which is checked below in
        # Python integers instead.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the parser reports truncation as assorted numpy errors
        raise LowbitError(
            f"{path} is truncated or corrupt: the GGUF header could not be parsed ({size} bytes; "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        if math.prod(dims) != int(t.n_elements) or any(d <= 0 for d in dims):
            raise LowbitError(f"{path} is corrupt: tensor {t.name} has dimensions {dims}")
        end = int(reader.data_offset) + int(t.field.parts[-1][0]) + int(t.n_bytes)  # the stored offset, unwrapped
        if end > size:
            raise LowbitError(
                f"{path} is truncated or corrupt: tensor {t.name} ends at byte {end} but the file has {size} bytes"
            )
    return GGUFFile(path, reader)


def printable(text: str, limit: int = 80) -> str:
    """A name read from a file, safe in a one-line message: control characters (a damaged name may
    hold newlines or terminal escapes) as `?`, cut at `limit` characters."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# GGUF value types: byte width of the scalars; 8 is a string (u64 length + bytes), 9 an array
# (u32 element type + u64 count + elements).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


def _check_structure(path: Path, size: int) -> None:
    """Walk the header's lengths and counts before the gguf package parses it, in bounded time:
    its parser trusts them, so a damaged count of 2^60 array elements past the end of the file makes
    it loop (and allocate) for as long as the count says, where this says which field is wrong."""
    import mmap
    import struct

    with path.open("rb") as fh:
        if size < 24:
            raise LowbitError(f"{path} is truncated: {size} bytes cannot hold a GGUF header (24 bytes)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
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

            def string(what: str) -> str:
                nonlocal pos
                need(8, what)
                (n,) = struct.unpack_from("<Q", data, pos)
                pos += 8
                need(n, what)
                pos += n
                return bytes(data[pos - n : pos]).decode("utf-8", errors="replace")

            def value(vtype: int, what: str) -> None:
                nonlocal pos
                if vtype in _SCALAR_BYTES:
                    need(_SCALAR_BYTES[vtype], what)
                    pos += _SCALAR_BYTES[vtype]
                elif vtype == _STRING:
                    string(what)
                elif vtype == _ARRAY:
                    need(12, what)
                    etype, count = struct.unpack_from("<IQ", data, pos)
                    pos += 12
                    width = _SCALAR_BYTES.get(etype, 8 if etype == _STRING else 12 if etype == _ARRAY else None)
                    if width is None:
                        raise LowbitError(f"{path} is corrupt: {what} is an array of unknown GGUF type {etype}")
                    need(count * width, f"{what} ({count} elements)")
                    if etype in _SCALAR_BYTES:
                        pos += count * width
                    else:
                        for _ in range(count):
                            value(etype, what)
                else:
                    raise LowbitError(f"{path} is corrupt: {what} has unknown GGUF value type {vtype}")

            for i in range(n_kv):
                key = printable(string(f"metadata key {i}"))
                need(4, f"metadata {key}")
                (vtype,) = struct.unpack_from("<I", data, pos)
                pos += 4
                value(vtype, f"metadata {key}")
            for i in range(n_tensors):
                name = printable(string(f"tensor name {i}"))
                need(4, f"tensor {name}")
                (n_dims,) = struct.unpack_from("<I", data, pos)
                pos += 4
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise LowbitError(f"{path} is corrupt: tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS})")
                need(8 * n_dims + 12, f"tensor {name}")
                pos += 8 * n_dims + 12


def check_finite_tensor(values: torch.Tensor, name: str, file: str) -> None:
    """Weights that are NaN or inf are never accepted: a LowbitError naming the tensor and how many."""
    bad = ~torch.isfinite(values)
    if bad.any():
        raise LowbitError(f"tensor {name} in {file} holds {int(bad.sum())} NaN/inf values: the file is damaged "
                          "(refusing to import it)")
