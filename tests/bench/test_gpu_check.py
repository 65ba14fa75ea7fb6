"""bench/gpu_check.sh cannot rot: its --dry-run runs every step on this CPU (TRITON_INTERPRET=1,
a tiny random model) and must write every section of its one report with numbers in it; a failing
step must not stop the others, and must make the exit status non-zero."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SECTIONS = ["Setup", "(a) Triton kernel tests", "(b) Quantized matmul against bf16, share of HBM bandwidth",
            "(c) lowbit eval of an int4 checkpoint: GPU against CPU", "(d) lowbit bench decode, batch 1-64",
            "(e) lowbit distill on the GPU (accelerate placement, bf16 mixed precision)", "Summary"]
FORMATS = ["int4", "int4-asym", "int8", "nf4", "fp8", "fp8-block128", "mxfp4", "nvfp4"]
NUM = r"\d+(?:\.\d+)?"


def _run(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path), **env})
    report = out / "gpu_check.md"
    assert report.exists(), done.stdout[-3000:] + done.stderr[-2000:]
    return done, report.read_text()


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


@pytest.mark.slow
def test_dry_run_writes_every_section_with_numbers(tmp_path):
    pytest.importorskip("triton")
    done, text = _run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "gpu_check: all steps ok" in done.stdout
    for step in ("setup", "(a) triton tests", "(b) kernels", "(c) eval", "(d) bench", "(e) distill"):
        assert f"gpu_check: {step} ok in" in done.stdout  # one plain progress line per step
    assert "DRY RUN" in text.splitlines()[2]  # nobody mistakes it for a GPU measurement
    sections = _sections(text)
    assert list(sections) == SECTIONS
    assert re.search(rf"torch {NUM}", sections["Setup"])
    assert re.search(r"pytest over 1 process\(es\): .*\b([1-9]\d*) passed", sections["(a) Triton kernel tests"])
    assert "failed" not in sections["(a) Triton kernel tests"]
    kernels = sections["(b) Quantized matmul against bf16, share of HBM bandwidth"]
    for fmt in FORMATS:
        for m in (1, 16):
            # format | path | N x K | M | time µs | GB/s | of peak | bf16 µs | bf16 of peak | × bf16 | eager µs | bf16 eager µs
            assert re.search(rf"^\| {re.escape(fmt)} \| triton \| 64x128 \| {m} \| {NUM} \| {NUM} \| {NUM}% \| {NUM} \| {NUM}% \| {NUM} \| {NUM} \| {NUM} \|$",
                             kernels, re.M), (fmt, m)
    evaluation = sections["(c) lowbit eval of an int4 checkpoint: GPU against CPU"]
    # the dry run's second eval takes `--device cpu` too: two rows, the same PPL
    rows = re.findall(rf"^\| cpu \| ({NUM}) \| {NUM} \|", evaluation, re.M)
    assert len(rows) == 2 and rows[0] == rows[1], rows
    assert "second run's PPL against the CPU's: 0.00e+00 relative difference" in evaluation
    bench = sections["(d) lowbit bench decode, batch 1-64"]
    for label in ("int4 (RTN g128)", "bf16"):
        for batch in (1, 2, 4):
            assert re.search(rf"^\| {re.escape(label)} \| cpu \| bfloat16 \| {batch} \| {NUM} \| {NUM} \| {NUM} \|$", bench, re.M), (label, batch)
    # the dry run distills on the CPU: the held-out KLD falls (the step fails otherwise)
    distilled = sections["(e) lowbit distill on the GPU (accelerate placement, bf16 mixed precision)"]
    before, after = map(float, re.search(rf"^\| cpu \| True \| 1 \| 3 \| ({NUM}) \| ({NUM}) \| {NUM} \|$", distilled, re.M).groups())
    assert after < before
    summary = sections["Summary"]
    assert summary.count("| ok |") == 6
    assert re.search(rf"total: {NUM} s", summary)


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    # an interpreter that does not exist: every step that needs python fails at once
    done, text = _run(tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert done.returncode != 0
    assert "gpu_check: FAILED:" in done.stdout
    sections = _sections(text)
    assert list(sections) == SECTIONS  # every step still has its section
    assert "FAILED" in sections["Setup"] and "FAILED" in sections["(a) Triton kernel tests"]
    assert sections["Summary"].count("FAILED") >= 3
