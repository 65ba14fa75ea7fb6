"""Where a distillation trains and in what precision: accelerate's Accelerator for one process.

`--device auto|cpu|cuda[:N]` (auto: the first CUDA device torch sees, else the CPU) places the
teacher, the student and the windows; `--bf16` is accelerate's "bf16" mixed precision (the
student's matmuls under autocast on that device, losses and the trained tensors float32). On the
CPU this is the same torch.autocast the CPU path always used, so a CPU run's bytes do not change.
Everything saved (the resumable state, the output) is copied to the CPU first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lowbit.runtime.device import resolve_device


@dataclass(slots=True)
class Placement:
    device: torch.device
    bf16: bool
    accelerator: object  # accelerate.Accelerator (imported lazily: it pulls in much)

    def autocast(self):
        """The student's forward under the mixed precision asked for (a no-op without --bf16)."""
        return self.accelerator.autocast() if self.bf16 else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def to(self, item):
        """A module or tensor on the training device."""
        return item.to(self.device)


def make_placement(device: str = "auto", bf16: bool = False) -> Placement:
    """The Placement for `--device` and `--bf16` (a device torch does not see: a usage error)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    target = resolve_device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target.index)  # accelerate takes the current CUDA device
    # accelerate keeps one state per process and refuses another precision later in it; a process may
    # run several distillations (the Python API, the tests), so each starts from a fresh state
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=target.type == "cpu", mixed_precision="bf16" if bf16 else "no")
    return Placement(device=accelerator.device, bf16=bf16, accelerator=accelerator)
