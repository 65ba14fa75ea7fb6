"""The machines plan reasons about: bundled GPU specs, a measured CPU, or numbers from the user.

Bundled figures are the vendors' published peak numbers, dense (without the 2:4 sparsity that
doubles the headline TFLOPs), taken from:
  - H100 SXM5 80GB, H200 SXM 141GB: NVIDIA H100 / H200 Tensor Core GPU datasheets
    (3.35 / 4.8 TB/s HBM; BF16 989.5, FP8 1979 dense TFLOPs for both)
  - A100 80GB SXM: NVIDIA A100 datasheet (2039 GB/s; BF16 312 TFLOPs; no FP8 tensor cores)
  - L4: NVIDIA L4 datasheet (300 GB/s; BF16 121, FP8 242.5 dense TFLOPs)
  - RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, appendix (1008 GB/s; BF16 165.2 and
    FP8 330.3 TFLOPs with FP32 accumulate, dense)
  - B200 (HGX B200, per GPU): NVIDIA HGX / DGX B200 datasheets (8 TB/s HBM3e; BF16 2250, FP8 4500,
    FP4 9000 dense TFLOPs, i.e. half the sparse figures divided by 8 GPUs)
Memory is what the driver reports as total (nvidia-smi memory.total), which is what a process
can plan with, not the marketing "GB".

`--gpu cpu` measures this machine instead: a streaming read (sum over a buffer far larger than
the caches), a square matmul for GFLOP/s, cores and RAM.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from lowbit.errors import UsageError

GIB = 1024**3


@dataclass(slots=True, frozen=True)
class Hardware:
    name: str
    memory_gib: float
    bandwidth_gbs: float  # GB/s, 1e9 bytes per second
    tflops_bf16: float  # dense 16-bit matmul peak
    tflops_fp8: float | None = None  # None: no 8-bit float tensor cores
    tflops_fp4: float | None = None  # None: no 4-bit float tensor cores
    cores: int | None = None
    measured: bool = False
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def bandwidth_bytes(self) -> float:
        return self.bandwidth_gbs * 1e9

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "memory_gib": round(self.memory_gib, 3),
            "bandwidth_gbs": round(self.bandwidth_gbs, 2),
            "tflops_bf16": round(self.tflops_bf16, 4),
            "tflops_fp8": self.tflops_fp8,
            "tflops_fp4": self.tflops_fp4,
            "cores": self.cores,
            "measured": self.measured,
            "source": self.source,
        }


GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM 80GB", 81559 / 1024, 3350, 989.5, 1979, None, source="NVIDIA H100 datasheet"),
    "h200": Hardware("H200 SXM 141GB", 143771 / 1024, 4800, 989.5, 1979, None, source="NVIDIA H200 datasheet"),
    "a100": Hardware("A100 SXM 80GB", 81920 / 1024, 2039, 312, None, None, source="NVIDIA A100 datasheet"),
    "l4": Hardware("L4 24GB", 23034 / 1024, 300, 121, 242.5, None, source="NVIDIA L4 datasheet"),
    "rtx4090": Hardware("RTX 4090 24GB", 24564 / 1024, 1008, 165.2, 330.3, None, source="NVIDIA Ada whitepaper"),
    "b200": Hardware("B200 180GB", 183359 / 1024, 8000, 2250, 4500, 9000, source="NVIDIA HGX B200 datasheet"),
}
_ALIASES = {
    "h100sxm": "h100",
    "h100sxm5": "h100",
    "h10080gb": "h100",
    "h200sxm": "h200",
    "a10080gb": "a100",
    "a100sxm": "a100",
    "4090": "rtx4090",
    "geforcertx4090": "rtx4090",
    "b200sxm": "b200",
}


def gpu_names() -> list[str]:
    return [*GPUS, "cpu"]


def lookup_gpu(name: str) -> Hardware:
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    if key == "cpu":
        return measure_cpu()
    raise UsageError(f"unknown GPU '{name}' (known: {', '.join(gpu_names())}; or give --bandwidth, --memory and --tflops)")


def custom_hardware(
    base: Hardware | None,
    bandwidth_gbs: float | None,
    memory_gib: float | None,
    tflops: float | None,
) -> Hardware:
    """A bundled or measured machine with some numbers replaced, or one built from all three."""
    for flag, value in (("--bandwidth", bandwidth_gbs), ("--memory", memory_gib), ("--tflops", tflops)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} must be a positive number, not {value}")
    if base is None:
        missing = [f for f, v in (("--bandwidth", bandwidth_gbs), ("--memory", memory_gib), ("--tflops", tflops)) if v is None]
        if missing:
            raise UsageError(f"without --gpu, give all of --bandwidth, --memory and --tflops (missing {', '.join(missing)})")
        return Hardware("custom", memory_gib, bandwidth_gbs, tflops, source="command line")
    changes = {}
    if bandwidth_gbs is not None:
        changes["bandwidth_gbs"] = bandwidth_gbs
    if memory_gib is not None:
        changes["memory_gib"] = memory_gib
    if tflops is not None:
        # the user's figure is for the math plan will use; low-precision peaks no longer apply
        changes.update(tflops_bf16=tflops, tflops_fp8=None, tflops_fp4=None)
    if not changes:
        return base
    return replace(base, name=f"{base.name} (adjusted)", source=f"{base.source}; adjusted on the command line", **changes)


def measure_cpu(buffer_mib: int = 512, matmul_size: int = 1024, repeats: int = 5) -> Hardware:
    """This machine, measured: best-of-`repeats` streaming read and matmul, all cores busy."""
    import psutil  # here: only `--gpu cpu` measures, and torch is slow to import
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bandwidth = _read_bandwidth_gbs(torch, buffer_mib, repeats)
    gflops = max(_matmul_gflops(torch, torch.float32, matmul_size, repeats), _matmul_gflops(torch, torch.bfloat16, matmul_size, repeats))
    return Hardware(
        name=f"this CPU ({cores} cores)",
        memory_gib=psutil.virtual_memory().total / GIB,
        bandwidth_gbs=bandwidth,
        tflops_bf16=gflops / 1000,
        cores=cores,
        measured=True,
        source=f"measured: sum over {buffer_mib} MiB, {matmul_size}^3 matmul (best of fp32/bf16), best of {repeats}",
    )


def _read_bandwidth_gbs(torch, buffer_mib: int, repeats: int) -> float:
    # Summing a buffer many times larger than the last-level cache streams it from DRAM once;
    # the best of a few runs is the machine's attainable read bandwidth, as decode sees it.
    buf = torch.ones(buffer_mib * 1024 * 1024 // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def _matmul_gflops(torch, dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9
