"""Server fixtures: a real `lowbit serve` process on a free loopback port, always killed at teardown.

`start_server(model_dir, *args)` starts `lowbit serve` on the real engine and waits (bounded)
for /health 200; `module_server` is one such server over the tiny model shared by a module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from tiny_model import save_tiny_model  # noqa: E402

START_TIMEOUT_S = 120
# One model thread: on a shared 2-core machine a second OpenMP thread mostly waits at barriers.
TINY_ARGS = ("--kv-memory", "8MiB", "--threads", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | Path, args: tuple[str, ...], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "lowbit", "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None  # not listening yet

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if self.health() == 200:
                return self
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output()}")

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()

    # -- plain HTTP, for what the openai client hides (status codes, raw bodies) --------------
    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        from lowbit.runtime.server.metrics import parse_metrics

        return parse_metrics(self.request("GET", "/metrics")[1])

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("serve_tiny"))


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(model, *args, ready=True) -> ServerProcess, killed at teardown."""
    procs: list[ServerProcess] = []

    def start(model, *args, ready: bool = True, env: dict | None = None) -> ServerProcess:
        proc = ServerProcess(model, tuple(args), tmp_path / f"server{len(procs)}.log", env)
        procs.append(proc)
        return proc.wait_ready() if ready else proc

    yield start
    for proc in procs:
        proc.kill()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory, tiny_model_dir):
    """One server over the tiny model for a whole test module (starting one costs seconds)."""
    log_dir = tmp_path_factory.mktemp("serve_log")
    proc = ServerProcess(tiny_model_dir, (*TINY_ARGS, "--served-model-name", "tiny"), log_dir / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


# The shared module server, its openai client and the tiny model's tokenizer, for the modules that
# talk to `module_server` (a module that starts its own server defines its own `server`).
@pytest.fixture(scope="module")
def server(module_server):
    return module_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from lowbit.runtime.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
