"""The tensors of a float checkpoint directory, indexed once by lowbit's names and read one at a time.

`lowbit quantize` (compress/pipeline.py) and the layer-at-a-time calibration passes
(compress/calibrate.LayerwiseModel) both read a float checkpoint tensor by tensor; this is their
one index. Names are lowbit's spelling (formats/moe_names: Mixtral's block_sparse_moe / w1 w2 w3
experts as mlp / gate_proj up_proj down_proj, transformers 5's fused experts as one slice per
expert), so statistics, recipes and the written checkpoint all use one.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.errors import LowbitError
from lowbit.formats.hf_files import weight_files
from lowbit.formats.moe_names import expert_pieces, read_piece

# bytes per element of each safetensors dtype (an unknown one counts 4)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


class SourceTensors:
    """name -> (file, stored name, expert piece), with each tensor's shape, bytes and stored dtype."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._files: list[Path] = []
        self.file_of: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.nbytes: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' spelling: "BF16", "F32", ...
        self._stored_name: dict[str, str] = {}
        self._piece: dict[str, tuple[int, int, int] | None] = {}
        for file in weight_files(self.directory):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for stored in handle.keys():
                        view = handle.get_slice(stored)
                        dtype = view.get_dtype()
                        for name, shape, piece in expert_pieces(stored, tuple(view.get_shape())):
                            if name in self.file_of:
                                raise LowbitError(f"checkpoint {directory} holds weight {name} twice (e.g. fused and per expert)")
                            self._stored_name[name], self._piece[name] = stored, piece
                            self.file_of[name] = len(self._files)
                            self.shapes[name] = shape
                            self.dtypes[name] = dtype
                            self.nbytes[name] = math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
            except LowbitError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types
                raise LowbitError(f"cannot read {file}: {_first_line(exc)}") from None
            self._files.append(file)

    @property
    def names(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (its own dtype), read from a handle opened for this read alone: one
        kept open keeps every page any read touched in the process's RSS (the whole source by the
        last layer: quantizing the 2.5 GB synthetic MoE peaked at 3.9 GB), while a closed handle's
        pages go with the tensor."""
        if name not in self.file_of:
            raise LowbitError(f"{self.directory} lacks weight {name}")
        with safe_open(str(self._files[self.file_of[name]]), framework="pt") as handle:
            return read_piece(handle, self._stored_name[name], self._piece[name])

    def rename(self, old: str, new: str) -> None:
        """Index `old`'s tensor as `new` (dropping whatever `new` was)."""
        for table in (self.file_of, self.shapes, self.nbytes, self.dtypes, self._stored_name, self._piece):
            table.pop(new, None)
            table[new] = table.pop(old)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
