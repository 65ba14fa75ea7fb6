"""From command-line values to a running server: size parsing, the engine factory, the config."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowbit.errors import UsageError
from lowbit.quant.dtypes import dtype_name

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}
DTYPES = ("f32", "bf16")


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000000' -> 1000000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UsageError(f"--kv-memory must be a size like 2GiB, 512MiB or 1GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def engine_factory(model_path: Path, *, dtype: str = "f32", kv_memory: int | None = None, max_running: int = 64,
                   max_model_len: int | None = None, draft: str | None = None,
                   threads: int | None = None, kernel_settings=None) -> Callable[[], Any]:
    """A zero-argument builder the engine thread calls: loading happens off the event loop.
    kernel_settings: a kernels.dispatch.KernelSettings in effect while the model loads (--kernel,
    --int4-activations), else the environment's."""
    dtype = dtype_name(dtype, allowed=DTYPES)  # float32/bfloat16 spelled out are the same

    def build():
        import torch

        from lowbit.kernels.dispatch import use_settings
        from lowbit.runtime.engine.engine import Engine

        if threads is not None:
            # The engine thread is the only one doing tensor work, so this is its intra-op pool.
            torch.set_num_threads(threads)
        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        with use_settings(kernel_settings):  # None: KernelSettings(), the environment's choices
            return Engine(str(model_path), dtype=torch_dtype, kv_memory=kv_memory, max_num_seqs=max_running,
                          max_model_len=max_model_len, draft=draft)

    return build
