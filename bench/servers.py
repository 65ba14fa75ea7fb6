"""Starting and stopping the HTTP servers the serving benches drive (`lowbit serve`, vLLM):
a free loopback port, waiting for /health, and a stop that lets the server drain."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen | None, timeout: float = 600, log=None) -> None:
    """Until GET base/health answers 200; SystemExit if the process ends first or time runs out."""
    where = f"; see {log}" if log else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready{where}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {base} was not ready after {timeout:.0f} s{where}")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGINT (both servers drain on it), then a kill if it has not exited within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
