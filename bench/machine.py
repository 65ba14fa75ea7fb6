"""What a bench result file says about the machine it was measured on, and which file it goes to.

lowbit's CPU kernels differ between AVX-512 and AVX2-only machines, so a script keeps one latest
results file per CPU class: `<stem>.json` for AVX-512, `<stem>-avx2.json` for AVX2-only; each is
its own table in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_file(stem: str) -> Path:
    from lowbit.native.build import _cpu_flags

    flags = _cpu_flags().split()
    return RESULTS_DIR / (f"{stem}-avx2.json" if flags and "avx512f" not in flags else f"{stem}.json")


def describe() -> str:
    """'AMD EPYC, 2 cores': the CPU's model name and core count."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"
