"""logit_bias, presence/frequency penalties, min_tokens, chat logprobs and response_format through
the official `openai` client against a real server on the tiny (random) model.

References: the same SamplingParams run by an in-process Engine on the same checkpoint (the server
is a transport: its tokens must be the engine's); structured output is checked with jsonschema;
every bad value of a new field is a 400 whose `param` names it.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["answer", "score", "words"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from lowbit.runtime.engine.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's --threads 1
    try:
        yield Engine(tiny_model_dir, kv_memory=8 << 20)
    finally:
        torch.set_num_threads(threads)


def engine_text(engine, prompt: str, **kw) -> tuple[str, int, str]:
    from lowbit.runtime.engine.sequence import SamplingParams

    c = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(temperature=0, **kw))[0]
    return c.text, len(c.token_ids), c.finish_reason


PROMPT = "The quick brown fox"


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5},
    {"logit_bias": {"68": -100, "70": 4.5}},
])
def test_penalties_and_bias_equal_the_engine(client, engine, fields):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=NO_EOS)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=NO_EOS,
                                  **fields)
    kw = {**fields, "logit_bias": {int(k): float(v) for k, v in fields.get("logit_bias", {}).items()} or None}
    expected, _, _ = engine_text(engine, PROMPT, max_tokens=24, ignore_eos=True, **kw)
    assert r.choices[0].text == expected
    assert r.choices[0].text != plain.choices[0].text  # the field really acts
    if "logit_bias" in fields:
        assert engine.tokenizer.decode([68]) not in r.choices[0].text  # -100 bans the token


def test_bias_forces_a_token_on_chat_and_completions(client, engine):
    forced = engine.tokenizer.decode([70])
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.9, seed=3,
                                  logit_bias={"70": 100})
    assert r.choices[0].text == forced * 5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logit_bias={"70": 100}, presence_penalty=0.1, frequency_penalty=0.1)
    assert chat.choices[0].message.content == forced * 3


def test_min_tokens_holds_back_eos_and_stop(client, engine):
    eos = next(iter(engine.tokenizer.eos_ids))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert client.completions.create(**body).usage.completion_tokens == 1  # EOS at once
    r = client.completions.create(**body, extra_body={"min_tokens": 4})
    _, n, reason = engine_text(engine, PROMPT, max_tokens=12, logit_bias={eos: 100.0}, min_tokens=4)
    assert r.choices[0].finish_reason == reason == "stop" and r.usage.completion_tokens == n == 5
    # a stop string is looked for only from the min_tokens-th token on (vLLM's rule)
    base = engine_text(engine, PROMPT, max_tokens=12, ignore_eos=True)[0]
    stop = base[:3]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={**NO_EOS, "min_tokens": 6})
    assert cut.choices[0].text.startswith(stop) and len(cut.choices[0].text) > len(stop)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          logit_bias={str(eos): 100}, extra_body={"min_tokens": 2})
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 3


def test_chat_logprobs_with_top_logprobs(client, engine):
    messages = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content and len(content) == 6
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)  # greedy
        assert c.bytes == list(c.token.encode()) and c.logprob <= 0
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_bos=False)  # as the server
    from lowbit.runtime.engine.sequence import SamplingParams

    ref = engine.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-5)
    # streamed: the same entries, chunk by chunk; logprobs without top_logprobs: no alternatives
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, stream=True, extra_body=NO_EOS)
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in streamed)


def test_json_schema_output_validates(client):
    for prompt in ("Hello there", "The quick brown fox", "Numbers 0 1 2"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=200, temperature=0, response_format=JSON_SCHEMA_FORMAT)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    sampled = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=200, temperature=0.8, seed=5,
                                        extra_body={"response_format": JSON_SCHEMA_FORMAT})
    jsonschema.validate(json.loads(sampled.choices[0].text), SCHEMA)
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Numbers 0 1 2"}],
                                            max_tokens=200, temperature=0.8, seed=5, stream=True,
                                            response_format=JSON_SCHEMA_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_length_cut(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=100, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    # max_tokens that ends the output before the grammar closes: "length", and the text is a prefix
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                         max_tokens=4, temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     extra_body={"response_format": {"type": "text"}, **NO_EOS})
    assert text.choices[0].finish_reason == "length"


BAD = [
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"160": 1}}, "logit_bias"),  # the tiny vocabulary is [0, 160)
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_values_are_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as chat_err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=fields)
    with pytest.raises(openai.BadRequestError) as completion_err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body=fields)
    for err in (chat_err.value, completion_err.value):
        assert err.status_code == 400 and err.param == param, err.body
        assert "\n" not in err.body["message"] and len(err.body["message"]) < 400
