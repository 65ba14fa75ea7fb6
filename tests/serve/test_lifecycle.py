"""Start-up, cancellation and shutdown of a real server process."""

from __future__ import annotations

import http.client
import json
import re
import time

from conftest import TINY_ARGS

STREAM = {"model": "tiny", "prompt": "Hello", "stream": True, "ignore_eos": True, "temperature": 0}


def open_stream(server, max_tokens: int, **extra) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**STREAM, "max_tokens": max_tokens, **extra}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def read_events(response, n: int) -> list[str]:
    events = []
    while len(events) < n:
        line = response.readline().decode()
        assert line, "stream ended early"
        if line.startswith("data: "):
            events.append(line[6:].strip())
    return events


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_health_is_503_while_loading_then_200(start_server, tiny_model_dir):
    server = start_server(tiny_model_dir, *TINY_ARGS, ready=False)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and 200 not in seen:
        assert server.proc.poll() is None, server.output()
        status = server.health()
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        time.sleep(0.02)
    assert seen == [503, 200], server.output()
    # /v1 while loading would have been 503 too; after start-up it serves.
    assert server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
    # the log says how long loading took and what the process holds
    assert re.search(r"model loaded in \d+\.\d s(, \d+ MiB resident \(the KV cache counts as its blocks are written\))?; ready", server.output()), \
        server.output()


def test_disconnect_mid_stream_aborts_and_frees_kv(module_server):
    server = module_server
    before = server.metrics()
    # sampled, so one token a step: a greedy stream takes 8 steps a C call (runtime/engine/multi_step.py)
    # and could finish its 200 tokens before the server has seen the client go
    conn, response = open_stream(server, max_tokens=200, temperature=1.0, seed=5)
    read_events(response, 3)
    assert server.metrics()["lowbit_kv_cache_blocks_used"] > 0  # the request holds blocks now
    conn.sock.close()  # the client vanishes mid-stream
    conn.close()
    m = wait_for(lambda: (m := server.metrics())["lowbit_requests_in_flight"] == 0
                 and m["lowbit_requests_running"] == 0 and m, what="the aborted request to leave")
    assert m["lowbit_kv_cache_blocks_used"] == 0
    assert m["lowbit_kv_cache_usage_ratio"] == 0.0
    aborted = 'lowbit_requests_finished_total{finish_reason="abort"}'
    assert m[aborted] == before[aborted] + 1
    generated = m["lowbit_generation_tokens_total"] - before["lowbit_generation_tokens_total"]
    assert generated < 200  # cancelled, not run to the end


def test_sigterm_finishes_in_flight_requests_and_exits_0(start_server, tiny_model_dir):
    server = start_server(tiny_model_dir, *TINY_ARGS, "--served-model-name", "tiny")
    conn, response = open_stream(server, max_tokens=60)
    read_events(response, 2)
    server.proc.send_signal(15)
    rest = response.read().decode()  # the stream still runs to its end
    assert rest.rstrip().endswith("data: [DONE]")
    assert '"finish_reason": "length"' in rest
    conn.close()
    assert server.proc.wait(60) == 0, server.output()
    assert server.health() is None  # no longer listening


def test_ctrl_c_while_the_model_loads_exits_130_cleanly(start_server, tiny_model_dir):
    # SIGINT as soon as the server answers (503: still loading). Whether the load ends first or not,
    # the process exits 130 with one line; while a load was still running in its thread, the
    # interpreter's shutdown around it had aborted the process (std::terminate, exit -6)
    server = start_server(tiny_model_dir, *TINY_ARGS, ready=False)
    wait_for(lambda: server.health() is not None or server.proc.poll() is not None, 120, "the server to listen")
    server.proc.send_signal(2)
    assert server.proc.wait(60) == 130, server.output()
    out = server.output()
    assert "Traceback" not in out and "terminate called" not in out
    assert re.search(r"lowbit: stopped \(SIGINT\) (while the model was loading|after a graceful shutdown)", out), out
