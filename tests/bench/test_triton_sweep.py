"""bench/triton_sweep.py under the Triton interpreter: every configuration computes the default's
result and gets a row; a CUDA device that is not there is refused in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, **env):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "triton_sweep.py"), *args], capture_output=True,
                          text=True, env={**os.environ, **env}, cwd=ROOT, timeout=300)


def test_every_configuration_is_checked_and_timed(tmp_path):
    out = tmp_path / "sweep.md"
    done = _run("--device", "cpu", "--shapes", "48x128", "--formats", "int4,nvfp4", "--block-n", "16,32",
                "--split-k", "1,3", "--rows", "1,5", "--rounds", "1", "--budget", "0.001", "--markdown", str(out),
                TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "WRONG" not in text
    for fmt in ("int4", "nvfp4"):
        for m in (1, 5):
            rows = re.findall(rf"^\| {fmt} \| 48x128 \| {m} \| (.+?) \| [\d.]+ \|", text, re.M)
            assert rows == ["default", "N16 K128 split1 w4", "N16 K128 split3 w4", "N32 K128 split1 w4",
                            "N32 K128 split3 w4"], rows


def test_a_missing_gpu_is_one_line():
    if torch.cuda.is_available():
        return
    done = _run("--device", "cuda")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["triton_sweep: torch sees no CUDA device (use --device cpu with TRITON_INTERPRET=1)"]
