"""This process's memory as the system counts it (what `lowbit bench` and the server's /metrics report)."""

from __future__ import annotations

import sys


def resident_bytes() -> tuple[int | None, int | None]:
    """(this process's resident memory now, its peak so far) in bytes; None where the system does
    not say (resident now: Linux /proc; peak: getrusage, in KiB on Linux)."""
    now = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    now = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        pass
    return now, peak
