"""Sizes on the command line, and the checks of sizes against the model and the machine.

One syntax for every size option (serve and bench --kv-memory, serve --max-body-bytes): a number
and an optional unit, binary (KiB, MiB, GiB, TiB) or decimal (K/KB, M/MB, G/GB, T/TB), any case;
a number without a unit is bytes. `parse_size` turns it into bytes or raises a one-line UsageError
naming the option.

The limit checks run before a model is loaded or memory is taken, so a value the model or the
machine cannot hold is one line at once, not a long load followed by a failed allocation:
`model_positions` reads max_position_embeddings from config.json alone, `check_positions` compares
a token count with it, `check_memory` compares a byte count with the memory there is.
"""

from __future__ import annotations

import re
from pathlib import Path

from lowbit.errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
GIB = 2**30
MIB = 2**20

SIZE_HELP = "a size like 512MiB, 2GiB or 1.5GB (no unit: bytes)"


def parse_size(text: str, option: str, *, minimum: int = 1) -> int:
    """'2GiB' -> 2147483648, '1.5GB' -> 1500000000, '4096' -> 4096; below `minimum` bytes is an error.

    `minimum` catches a bare number meant in another unit: bench's --kv-memory used to take MiB,
    and `--kv-memory 512` read as 512 bytes would only fail much later, after the model loaded."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    value = int(float(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    if value < 1:
        raise UsageError(f"{option} must be a size like 512MiB, 2GiB, 1.5GB or a number of bytes, got {text!r}")
    if value < minimum:
        bare = " (a number without a unit is bytes)" if unit in ("", "b") else ""
        raise UsageError(f"{option} must be at least {format_size(minimum)}, got {text!r}{bare}")
    return value


def format_size(nbytes: int) -> str:
    """Bytes as the shortest exact binary unit (1MiB, 4GiB), else GiB with one decimal."""
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= MIB else f"{nbytes} bytes"


def available_memory() -> tuple[int, str]:
    """(bytes, what) free where the engine will keep its KV cache: the GPU's free memory when torch
    sees one (the engine's default device), else the RAM the system can give without swapping."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free), "GPU memory available"
    import psutil

    return int(psutil.virtual_memory().available), "memory available"


def check_memory(option: str, text: str, nbytes: int) -> None:
    """Refuse `nbytes` (what `option` = `text` asks for) when it is more than the memory there is."""
    available, what = available_memory()
    if nbytes > available:
        raise UsageError(f"{option} {text} is more than the {available / GIB:.1f} GiB of {what}")


def model_positions(model: str) -> tuple[int, str] | None:
    """(max_position_embeddings, name) of MODEL from its config.json, without loading any weight;
    None for a model with no config.json beside it (a GGUF file): the engine checks that one."""
    from lowbit.formats.hf_files import read_config
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.config import ModelConfig

    path = Path(resolve_model(model))
    if not (path / "config.json").is_file():
        return None
    config = ModelConfig.from_dict(read_config(path))  # an architecture lowbit cannot run: its one line, now
    return config.max_position_embeddings, path.name


def check_positions(option: str, tokens: int, limit: tuple[int, str] | None, *, spelled: str | None = None) -> None:
    """Refuse a token count beyond the model's positions; `spelled` is how the count was asked for
    (e.g. '--prompt-tokens 8000 + --gen-tokens 1000'), else '`option` `tokens`'."""
    if limit is None or tokens <= limit[0]:
        return
    positions, name = limit
    asked = spelled or f"{option} {tokens}"
    raise UsageError(f"{asked} is more than {name}'s {positions} positions (max_position_embeddings)")
