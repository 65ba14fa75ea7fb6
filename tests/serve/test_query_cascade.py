"""`lowbit serve --cascade CHEAP`: the cheap model answers a request when its answer's mean token
probability is above the threshold, else the full model answers it again; the answer and /metrics
say which. Two tiny random models with the same tokenizer (different seeds) stand in for the pair,
so the two models' greedy texts differ and each answer can be traced to the model that wrote it."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import TINY_ARGS
from tiny_model import save_tiny_model

PROMPTS = ["The quick brown fox", "Numbers 0 1 2", "hello there", "A server answers"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cheap_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cascade_cheap"), seed=1)


@pytest.fixture(scope="module")
def references(tiny_model_dir, cheap_dir):
    """{model: {prompt: (greedy text, mean probability of its tokens)}} from the engine in-process."""
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams

    out = {}
    for name, path in (("full", tiny_model_dir), ("cheap", cheap_dir)):
        engine = Engine(str(path), kv_memory=8 << 20)
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        done = engine.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True))
        out[name] = {p: (c.text, sum(math.exp(lp) for lp, _ in c.logprobs) / len(c.logprobs))
                     for p, c in zip(PROMPTS, done)}
    assert all(out["full"][p][0] != out["cheap"][p][0] for p in PROMPTS)  # else the test could not tell them apart
    return out


def _complete(server, prompt: str, **extra):
    status, body = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                               "temperature": 0, "ignore_eos": True, **extra})
    assert status == 200, body
    import json

    return json.loads(body)


def test_threshold_sends_each_request_to_the_model_its_confidence_earns(start_server, tiny_model_dir, cheap_dir,
                                                                        references):
    confidences = sorted(references["cheap"][p][1] for p in PROMPTS)
    assert confidences[0] < confidences[-1]
    threshold = (confidences[1] + confidences[2]) / 2  # two prompts above, two not
    server = start_server(tiny_model_dir, *TINY_ARGS, "--cascade", str(cheap_dir), "--cascade-threshold",
                          f"{threshold:.9f}")
    counts = {"cheap": 0, "full": 0}
    for prompt in PROMPTS:
        text, confidence = references["cheap"][prompt]
        answer = _complete(server, prompt)
        route = answer["cascade"]
        expected = "cheap" if confidence > threshold else "full"
        assert route["answered_by"] == expected
        assert route["cheap_confidence"] == pytest.approx(confidence, abs=1e-5)
        assert answer["choices"][0]["text"] == references[expected][prompt][0]
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        counts[expected] += 1
    assert counts == {"cheap": 2, "full": 2}
    metrics = server.metrics()
    assert metrics['lowbit_cascade_requests_total{answered_by="cheap"}'] == 2
    assert metrics['lowbit_cascade_requests_total{answered_by="full"}'] == 2
    assert metrics["lowbit_cascade_escalations_total"] == 2
    assert metrics['lowbit_requests_finished_total{finish_reason="length"}'] == 4
    assert metrics["lowbit_requests_in_flight"] == 0

    # streamed, through the official client: the same texts, the header and every chunk say who answered
    client = server.client()
    for prompt in PROMPTS[:2]:
        expected = "cheap" if references["cheap"][prompt][1] > threshold else "full"
        raw = client.completions.with_raw_response.create(model=str(tiny_model_dir), prompt=prompt,
                                                          max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                          extra_body={"ignore_eos": True})
        assert raw.headers["x-lowbit-answered-by"] == expected
        chunks = list(raw.parse())
        assert "".join(c.choices[0].text for c in chunks) == references[expected][prompt][0]
        assert {c.model_extra["cascade"]["answered_by"] for c in chunks} == {expected}

    # a score (max_tokens 0, echo + logprobs: lm-eval's loglikelihood) is the full model's alone
    score = _complete(server, PROMPTS[0], max_tokens=0, echo=True, logprobs=0)
    assert "cascade" not in score
    assert score["choices"][0]["text"] == PROMPTS[0]


@pytest.mark.parametrize("threshold, model", [("0", "cheap"), ("1", "full")])
def test_threshold_ends_answer_everything_from_one_model(start_server, tiny_model_dir, cheap_dir, references,
                                                         threshold, model):
    """0: every cheap answer stands (its mean probability is above 0); 1: every request escalates,
    and with n > 1 each choice is the one that model alone would give."""
    server = start_server(tiny_model_dir, *TINY_ARGS, "--cascade", str(cheap_dir), "--cascade-threshold", threshold)
    answer = _complete(server, PROMPTS[1], n=2)
    assert answer["cascade"]["answered_by"] == model
    assert [c["text"] for c in answer["choices"]] == [references[model][PROMPTS[1]][0]] * 2
    answer = _complete(server, PROMPTS[2], logprobs=1)  # the client's own logprobs come back as asked
    assert answer["choices"][0]["text"] == references[model][PROMPTS[2]][0]
    assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) == MAX_TOKENS


@pytest.mark.parametrize("args, message", [
    (["--cascade-threshold", "1.5", "--cascade", "self:int4"], "--cascade-threshold must be in [0, 1], got 1.5"),
    (["--cascade", "self:int9"], "unknown format 'int9'"),
    (["--cascade", "ngram"], "--cascade ngram: give a model with the same tokenizer or self:FORMAT"),
])
def test_bad_cascade_options_are_one_line_errors(tiny_model_dir, args, message):
    run = subprocess.run([sys.executable, "-m", "lowbit", "serve", str(tiny_model_dir), "--port", "1", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert message in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_cheap_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: not the same tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    run = subprocess.run([sys.executable, "-m", "lowbit", "serve", str(tiny_model_dir), "--port", "1", "--cascade",
                          str(other)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "does not share" in run.stderr and "tokenizer" in run.stderr


def test_a_cheap_model_that_fails_to_load_stops_the_server_with_one_line(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short: the header promises more than is there
    from conftest import free_port

    run = subprocess.run([sys.executable, "-m", "lowbit", "serve", str(tiny_model_dir), "--port", str(free_port()),
                          *TINY_ARGS, "--cascade", str(broken)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lowbit: error: could not load the cheap model ({broken})"), run.stderr
    assert "Traceback" not in run.stderr
