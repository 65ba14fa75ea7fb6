"""Runs triton_cases.py (every format's quantized matmul and the paged decode kernel against
their oracles) in a child pytest with TRITON_INTERPRET=1: the flag must be set before triton
compiles a kernel, and must not leak into the other tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_under_interpreter():
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", LOWBIT_KERNEL="", LOWBIT_TRITON_DEVICE="cpu")
    for name in ("LOWBIT_TRITON_QUICK", "LOWBIT_TRITON_SHARD"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here / "triton_cases.py")],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
