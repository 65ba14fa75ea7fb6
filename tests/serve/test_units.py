"""The server's pure parts, without a process: sizes, histograms, request validation, CLI refusals."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from lowbit.errors import UsageError
from lowbit.cli.sizes import parse_size
from lowbit.runtime.server.metrics import Histogram, Metrics, parse_metrics
from lowbit.runtime.server.protocol import APIError, completion_logprobs, parse_chat, parse_completion


def test_parse_size():
    assert parse_size("2GiB", "--kv-memory") == 2 * 2**30
    assert parse_size("512MiB", "--kv-memory") == 512 * 2**20
    assert parse_size("1.5GB", "--kv-memory") == 1_500_000_000
    assert parse_size("4096", "--kv-memory") == 4096
    for bad in ("lots", "0GiB", "-1MiB", "2 parsecs", ""):
        with pytest.raises(UsageError, match="--kv-memory"):
            parse_size(bad, "--kv-memory")


def test_histogram_buckets_are_cumulative_and_parse_back():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(v)
    h.observe(0.5, times=2)
    values = parse_metrics("\n".join(h.render()))
    # le is inclusive: 0.1 falls in the 0.1 bucket
    assert values['x_seconds_bucket{le="0.1"}'] == 2
    assert values['x_seconds_bucket{le="1.0"}'] == 5
    assert values['x_seconds_bucket{le="+Inf"}'] == 7 == values["x_seconds_count"]
    assert values["x_seconds_sum"] == pytest.approx(0.05 + 0.1 + 0.5 + 2 + 3 + 1.0)


def test_metrics_render_without_engine_has_every_series():
    text = Metrics().render(None)
    values = parse_metrics(text)
    for name in ("lowbit_requests_running", "lowbit_kv_cache_usage_ratio", "lowbit_prefix_cache_hits_total",
                 "lowbit_preemptions_total", "lowbit_spec_mean_accepted_length",
                 "lowbit_time_to_first_token_seconds_count", "lowbit_inter_token_latency_seconds_count",
                 "lowbit_e2e_request_latency_seconds_count"):
        assert values[name] == 0
    assert text.count("# TYPE") == len({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")})
    if sys.platform == "linux":  # this process's resident memory, as Prometheus' process collector names it
        assert values["process_resident_memory_bytes"] > 10 << 20


def test_request_validation_names_the_parameter():
    req = parse_completion({"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 3, "top_k": -1, "stop": "x"})
    assert req.prompts == [[5, 6, 7]] and req.sampling == {"top_k": 0, "stop": ("x",)}
    scoring = parse_completion({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert scoring.wants_prompt_logprobs and scoring.max_tokens == 0
    assert scoring.sampling_params(0, prompt_logprobs=True).prompt_logprobs == 1
    choices = parse_completion({"prompt": "a", "n": 2, "best_of": 3, "seed": 5})
    assert (choices.n, choices.best_of) == (2, 3) and choices.sampling_params(4, seed_offset=2).seed == 7
    assert choices.sampling_params(4).logprobs == 0  # best_of ranks by logprob
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "a", "echo": "yes"})
    assert err.value.param == "echo"
    with pytest.raises(APIError) as err:
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert err.value.param == "messages" and err.value.status == 400
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                              "text": "b"}]}],
                       "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 5})
    assert chat.messages[0]["content"] == "ab" and chat.logprobs == 2 and chat.max_tokens == 5
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "a", "temperature": -1}).sampling_params(4)
    assert err.value.param == "temperature"


def test_completion_logprobs_offsets_follow_the_text():
    lp = completion_logprobs([("Hel", -0.1, [("Hel", -0.1)]), ("lo", -0.2, [])], text_offset=5)
    assert lp["text_offset"] == [5, 8] and lp["tokens"] == ["Hel", "lo"] and lp["top_logprobs"][1] == {}


def test_cli_refuses_bad_values_and_a_busy_port(tiny_model_dir):
    bad = subprocess.run([sys.executable, "-m", "lowbit", "serve", str(tiny_model_dir), "--kv-memory", "lots"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--kv-memory" in bad.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = subprocess.run([sys.executable, "-m", "lowbit", "serve", str(tiny_model_dir), "--port",
                               str(s.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1 and "could not listen" in busy.stderr.splitlines()[-1]


def test_stream_events_survive_clients_that_split_on_unicode_line_breaks():
    # guidellm splits the event stream with str.splitlines(), which also breaks at NEL, LINE
    # SEPARATOR and PARAGRAPH SEPARATOR; JSON leaves those unescaped, so a token holding one
    # used to cut its event in two.
    from lowbit.runtime.server.answer import _sse

    text = "a\u2028b\x85c\u2029d é\n"
    event = _sse({"choices": [{"text": text}]})
    assert event.endswith("\n\n") and event.startswith("data: ")
    body = event[len("data: "):-2]
    assert len(body.splitlines()) == 1
    assert json.loads(body) == {"choices": [{"text": text}]}
    assert "é" in body  # other characters stay as they are
