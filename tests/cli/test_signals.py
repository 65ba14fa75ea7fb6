"""Shell pipelines trust exit codes: Ctrl-C (SIGINT) exits 130 and SIGTERM 143, each with one line,
and an interrupted command leaves no output; `lowbit` alone prints its help without an error line.
Run on the demo model so the signal arrives while real work is in progress."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest


def _interrupt(args: list[str], sig: int, after_s: float = 6.0) -> tuple[int, str]:
    # default dispositions in the child: a test runner may have SIGINT ignored
    def child():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-m", "lowbit", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=child)
    time.sleep(after_s)
    assert proc.poll() is None, "the command ended before the signal: give it more work"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.demo
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted (SIGINT)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_eval_interrupted_exits_with_the_signal_code(sig, code, word):
    rc, err = _interrupt(["eval", "smollm2-135m", "--data", "wiki-eval", "--chunks", "40"], sig)
    last = err.strip().splitlines()[-1]
    assert rc == code, err[-500:]
    assert last.startswith("lowbit: error: ") and word in last and "no output was written" in last


@pytest.mark.demo
def test_interrupted_quantize_writes_nothing(tmp_path):
    out = tmp_path / "q"
    rc, err = _interrupt(["quantize", "smollm2-135m", "--format", "int4", "--method", "gptq", "--data", "wiki-calib",
                          "--samples", "16", "--seqlen", "256", "-o", str(out)], signal.SIGINT)
    assert rc == 130 and "interrupted (SIGINT)" in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.tmp")]


def test_no_arguments_prints_the_help_without_an_error_line():
    result = subprocess.run([sys.executable, "-m", "lowbit"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Usage" in result.stdout + result.stderr and "error" not in result.stderr
