"""Quantized matmul kernels. Call only `prepare` (at load) and `qmatmul` (in forward)."""

from lowbit.kernels.dispatch import PATHS, choose_path, prepare, qmatmul
from lowbit.kernels.prepared import PreparedWeight

__all__ = ["PATHS", "PreparedWeight", "choose_path", "prepare", "qmatmul"]
