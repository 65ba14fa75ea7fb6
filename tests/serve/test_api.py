"""The OpenAI API through the official `openai` client against a real server on the tiny model.

References: greedy text and logprobs from the checkpoint run by transformers (a plain argmax loop
on full recomputes), token counts from the tokenizer, the chat prompt from the template.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    """(prompt ids, n) -> (n greedy ids, their log-softmax rows) from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def run(ids: list[int], n: int):
        ids, out, rows = list(ids), [], []
        with torch.no_grad():
            for _ in range(n):
                logp = model(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
                tok = int(logp.argmax())
                out.append(tok)
                rows.append(logp)
                ids.append(tok)
        return out, rows

    return run


def stream_text(chunks, chat: bool) -> tuple[str, list[str], object]:
    parts, reasons, usage = [], [], None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return "".join(parts), reasons, usage


def test_models_lists_the_served_name(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_is_transformers_greedy_with_right_usage(client, tokenizer, hf_greedy):
    prompt = "Hello world, the quick fox"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
    expected, _ = hf_greedy(ids, 12)
    assert r.choices[0].text == tokenizer.decode(expected)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    # The same prompt as token ids is the same request.
    r_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body=NO_EOS)
    assert r_ids.choices[0].text == r.choices[0].text


@pytest.mark.parametrize("chat", [False, True])
def test_stream_joins_to_the_whole_text_with_one_finish_reason(client, chat):
    kw = dict(model=MODEL, max_tokens=20, temperature=0, extra_body=NO_EOS)
    if chat:
        kw["messages"] = [{"role": "user", "content": "Say hello to the client"}]
        whole = client.chat.completions.create(**kw)
        text, usage = whole.choices[0].message.content, whole.usage
        chunks = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    else:
        kw["prompt"] = "A server answers"
        whole = client.completions.create(**kw)
        text, usage = whole.choices[0].text, whole.usage
        chunks = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    joined, reasons, stream_usage = stream_text(chunks, chat)
    assert len(text) > 0 and joined == text
    assert reasons == ["length"]
    assert stream_usage is not None and stream_usage.completion_tokens == 20
    assert stream_usage.prompt_tokens == usage.prompt_tokens


def test_chat_prompt_is_the_checkpoint_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=NO_EOS)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].message.content == same.choices[0].text


def test_logprobs_are_the_models(client, tokenizer, hf_greedy):
    prompt = "Numbers 0 1 2"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    expected, rows = hf_greedy(ids, 5)
    assert lp.tokens == [tokenizer.decode([t]) for t in expected]
    for got, top, tok, row in zip(lp.token_logprobs, lp.top_logprobs, expected, rows):
        assert math.isclose(got, float(row[tok]), abs_tol=1e-4)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(got, abs=1e-6)  # greedy = most likely
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_echo_stop_and_seed(client):
    base = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=16, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=16, temperature=0, echo=True,
                                       extra_body=NO_EOS).choices[0].text
    assert echoed == "The lazy dog" + base
    stop = base[5:8]
    cut = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body=NO_EOS).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"
    seeded = [client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=7,
                                        extra_body=NO_EOS).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_32_concurrent_clients_each_get_their_text_alone(client, server):
    prompts = [f"client {i}: hello {i * 7 % 10} world" for i in range(32)]

    def ask(prompt: str, stream: bool) -> str:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=NO_EOS)
        if stream:
            return stream_text(client.completions.create(**kw, stream=True), chat=False)[0]
        return client.completions.create(**kw).choices[0].text

    alone = [ask(p, stream=False) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda ip: ask(ip[1], stream=ip[0] % 2 == 0), enumerate(prompts)))
    assert together == alone
    assert len(set(alone)) > 1  # the prompts really differ in what they produce
    m = server.metrics()
    assert m["lowbit_requests_in_flight"] == 0
    assert m['lowbit_requests_finished_total{finish_reason="length"}'] >= 64
