"""The files of a Hugging Face-style model directory: the ONE `read_json`, `read_config`,
`model_dir` and `weight_files` that every loader, converter and method uses. Each failure is one
LowbitError line naming the file. No torch here: `lowbit plan` reads configs through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowbit.errors import LowbitError

_REQUIRED = object()


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_json(path: str | Path, missing: Any = _REQUIRED) -> dict[str, Any]:
    """The JSON object in `path`; `missing` is returned when the file does not exist (without it, a
    missing file is an error like any unreadable one). Not an object, or not JSON: LowbitError."""
    path = Path(path)
    if missing is not _REQUIRED and not path.is_file():
        return missing
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LowbitError(f"cannot read {path}: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise LowbitError(f"{path} does not hold a JSON object")
    return data


def is_gguf_file(path: str | Path) -> bool:
    """Whether the file at `path` starts with GGUF's magic (torch-free: plan/ asks too)."""
    with Path(path).open("rb") as fh:
        return fh.read(4) == b"GGUF"


def model_dir(path: str | Path) -> Path:
    """The path as a model directory, or a clear error saying why it is not one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise LowbitError(f"model not found: {path}")
    if not path.is_dir():
        try:
            gguf = is_gguf_file(path)
        except OSError:  # unreadable: the plain reason below
            gguf = False
        if gguf:
            raise LowbitError(f"{path} is a GGUF file; this command reads a Hugging Face model directory "
                              f"(convert it first: lowbit convert {path} -o DIR)")
        raise LowbitError(f"{path} is not a model directory (expected a folder with config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise LowbitError(f"{path} is not a model directory: it has no config.json")
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model directory, as a dict."""
    return read_json(model_dir(path) / "config.json")


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory: the shards named by model.safetensors.index.json,
    else model.safetensors, else every *.safetensors (sorted)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LowbitError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise LowbitError(f"shard {file.name} named by {index.name} is missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    raise LowbitError(f"{path} has no *.safetensors weights")


def open_safetensors(path: str | Path):
    """A safetensors file opened lazily (torch tensors); a damaged header is one LowbitError line."""
    from safetensors import safe_open  # late: this module stays torch-free for `lowbit plan`

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types for bad files
        raise LowbitError(f"corrupt or unreadable safetensors file {path}: {one_line(exc)}") from None


def read_tensor(handle, name: str, path: str | Path):
    """One tensor of an open safetensors file; a read failure is one LowbitError naming it."""
    try:
        return handle.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types for bad files
        raise LowbitError(f"cannot read tensor {name} from {path}: {one_line(exc)}") from None
