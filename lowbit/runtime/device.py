"""Which torch device a command runs on: `--device auto|cpu|cuda|cuda:N`."""

from __future__ import annotations

import torch

from lowbit.errors import UsageError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str = "auto") -> torch.device:
    """auto takes the first CUDA device when torch sees one (as generate, bench and serve do), else
    the CPU; a CUDA device that is not there is refused here, before anything loads."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device must be {DEVICE_CHOICES}, got '{name}'") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device must be {DEVICE_CHOICES}, got '{name}'")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device
