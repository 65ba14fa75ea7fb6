"""Every refusal: its HTTP status and OpenAI's error object {"error": {message, type, param, code}}."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from conftest import TINY_ARGS

KEY = "sk-test-4f1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    from conftest import ServerProcess

    args = (*TINY_ARGS, "--served-model-name", "tiny", "--api-key", KEY, "--max-running", "1", "--max-queue", "1",
            "--max-body-bytes", "4096", "--max-model-len", "64")
    proc = ServerProcess(tiny_model_dir, args, tmp_path_factory.mktemp("serve_err") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def error_of(status_body, status: int, param=None, code=None) -> dict:
    got_status, body = status_body
    assert got_status == status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def post(server, path, body=None, raw=None, headers=AUTH):
    return server.request("POST", path, body, headers=headers, raw=raw)


def test_api_key_is_enforced(server):
    error_of(post(server, "/v1/completions", PROMPT, headers={}), 401, code="invalid_api_key")
    error_of(post(server, "/v1/completions", PROMPT, headers={"Authorization": "Bearer sk-wrong"}), 401)
    error_of(server.request("GET", "/v1/models"), 401)
    assert post(server, "/v1/completions", PROMPT)[0] == 200
    assert server.request("GET", "/health")[0] == 200  # probes need no key
    client = server.client(api_key=KEY)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    log = server.output()
    assert KEY not in log  # never logged


@pytest.mark.parametrize("body, param", [
    ({**PROMPT, "temperature": "hot"}, "temperature"),
    ({**PROMPT, "temperature": -1}, "temperature"),
    ({**PROMPT, "top_p": 0}, "top_p"),
    ({**PROMPT, "top_k": 1.5}, "top_k"),
    ({**PROMPT, "max_tokens": 0}, "max_tokens"),
    ({**PROMPT, "n": 0}, "n"),
    ({**PROMPT, "n": 2, "best_of": 1}, "best_of"),
    ({**PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({**PROMPT, "logprobs": 50}, "logprobs"),
    ({**PROMPT, "stop": [""]}, "stop"),
    ({**PROMPT, "stream": "yes"}, "stream"),
    ({"model": "tiny", "max_tokens": 4}, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, "prompt"),
    ({"model": "tiny", "prompt": "Hello", "max_tokens": 100}, "max_tokens"),  # beyond the 64-token context
])
def test_bad_parameters_are_400_naming_the_parameter(server, body, param):
    error_of(post(server, "/v1/completions", body), 400, param=param)


def test_bad_chat_and_malformed_json_are_400(server):
    error_of(post(server, "/v1/chat/completions", {"model": "tiny", "messages": []}), 400, param="messages")
    error_of(post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}), 400,
             param="messages")
    error_of(post(server, "/v1/chat/completions", raw=b'{"model": "tiny", "messages": ['), 400)
    error_of(post(server, "/v1/completions", raw=b"[1, 2]"), 400)


def test_context_overflow_is_400_context_length_exceeded(server):
    error_of(post(server, "/v1/completions", {"model": "tiny", "prompt": "Hello " * 80, "max_tokens": 1}), 400,
             param="prompt", code="context_length_exceeded")


def test_unknown_model_and_route_are_404(server):
    error_of(post(server, "/v1/completions", {**PROMPT, "model": "gpt-4"}), 404, param="model",
             code="model_not_found")
    error_of(server.request("GET", "/v1/nothing-here", headers=AUTH), 404)


def test_body_over_the_limit_is_413(server):
    error_of(post(server, "/v1/completions", {**PROMPT, "prompt": "x" * 5000}), 413, code="request_too_large")


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory, tiny_model_dir):
    """One running slot and one queue slot, with room for streams long enough (240 tokens) that
    they are still running when the test's next request arrives."""
    from conftest import ServerProcess

    args = (*TINY_ARGS, "--served-model-name", "tiny", "--api-key", KEY, "--max-running", "1", "--max-queue", "1",
            "--max-model-len", "256")
    proc = ServerProcess(tiny_model_dir, args, tmp_path_factory.mktemp("serve_queue") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def _fill_and_post(server) -> tuple[int, str]:
    """Two long streams fill the server; the status and body of a third request while they run."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 240, "stream": True,
                       "ignore_eos": True}).encode()
    conns = []
    try:
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("POST", "/v1/completions", body, {**AUTH, "Content-Type": "application/json"})
            conns.append(conn)
        deadline = time.monotonic() + 30
        while server.metrics()["lowbit_requests_in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        return post(server, "/v1/completions", PROMPT)
    finally:
        for conn in conns:
            conn.close()
        deadline = time.monotonic() + 30
        while server.metrics()["lowbit_requests_in_flight"] > 0 and time.monotonic() < deadline:
            time.sleep(0.05)


def test_full_queue_is_429_and_never_grows(queue_server):
    # --max-running 1 + --max-queue 1: two long streams fill the server, the third is refused. On a
    # loaded machine the first stream can still end before the third request lands (then it is
    # queued and served, correctly); a few tries make the full-queue case happen.
    for _ in range(5):
        status_body = _fill_and_post(queue_server)
        if status_body[0] != 200:
            break
    error_of(status_body, 429, code="queue_full")
    assert post(queue_server, "/v1/completions", PROMPT)[0] == 200
    assert queue_server.metrics()['lowbit_http_errors_total{status="429"}'] >= 1
