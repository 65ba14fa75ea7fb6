"""Quantized matmul kernels. Call only `prepare` (at load) and `qmatmul` (in forward).

`KernelSettings` / `use_settings` choose a path or the int4 kernel's activations explicitly
(before a model loads); `describe_paths` says which paths can run here and why not."""

from lowbit.kernels.dispatch import (
    PATHS,
    TABLE,
    KernelPath,
    KernelSettings,
    PathStatus,
    choose_path,
    current_settings,
    describe_paths,
    prepare,
    qmatmul,
    use_settings,
)
from lowbit.kernels.prepared import PreparedWeight

__all__ = ["PATHS", "TABLE", "KernelPath", "KernelSettings", "PathStatus", "PreparedWeight", "choose_path",
           "current_settings", "describe_paths", "prepare", "qmatmul", "use_settings"]
