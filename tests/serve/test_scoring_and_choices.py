"""What lm-eval and vLLM clients send, through the official `openai` client on a real server:
echo + logprobs (prompt log-probs, equal to `lowbit eval`'s scoring of the same tokens),
max_tokens 0, vLLM's prompt_logprobs, the tokenizer endpoints, n and best_of; every bad value of
those fields is a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest
import torch

MODEL = "tiny"
PROMPT = "Hello world, the quick brown fox jumps over the lazy dog. A server answers many clients"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def eval_logprobs(tiny_model_dir):
    """ids -> log-probs of ids[1:], scored as `lowbit eval --dtype f32` scores a window (the server runs f32)."""
    from lowbit.runtime.evaluate import Window, _Accumulator, _score_window, _window_logits
    from lowbit.runtime.loader import load_model

    model = load_model(tiny_model_dir, torch.float32)

    def run(ids: list[int]) -> list[float]:
        acc = _Accumulator()
        with torch.inference_mode():
            logits = _window_logits(model, torch.tensor([ids]), Window(0, len(ids), 1))
        _score_window(logits, torch.tensor(ids[1:]), None, acc)
        return (-torch.cat(acc.nll)).tolist()

    return run


def close(a, b, tol=2e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


# -- prompt logprobs ------------------------------------------------------------------------------
def test_echo_logprobs_is_lm_eval_request_and_equals_eval(client, tokenizer, eval_logprobs):
    ids = tokenizer.encode(PROMPT)
    # exactly what lm-eval's local-completions sends for a loglikelihood request
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert close(lp.token_logprobs[1 : len(ids)], eval_logprobs(ids))
    for tok_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 1 and max(top.values()) >= tok_lp - 1e-12  # lm-eval's is_greedy reads these
    assert r.choices[0].text.startswith(tokenizer.decode(ids))
    assert r.usage.completion_tokens == 1

    # max_tokens 0: the prompt alone, same numbers, nothing generated
    zero = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    z = zero.choices[0]
    assert z.text == PROMPT and z.finish_reason == "length" and zero.usage.completion_tokens == 0
    assert len(z.logprobs.tokens) == len(ids) and close(z.logprobs.token_logprobs[1:], eval_logprobs(ids))
    assert all(len(top) == 2 for top in z.logprobs.top_logprobs[1:])
    assert z.logprobs.text_offset[0] == 0


def test_prompt_logprobs_after_a_prefix_cache_hit_and_vllm_shape(client, server, tokenizer, eval_logprobs):
    ids = tokenizer.encode(PROMPT)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # the prompt's blocks are now cached
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    got = []
    for tid, entry in zip(ids[1:], plp[1:]):
        mine = entry[str(tid)]
        got.append(mine["logprob"])
        assert mine["decoded_token"] == tokenizer.decode([tid])
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1 and len(entry) in (2, 3)  # the top 2, plus the token if not among them
        assert mine["rank"] == 1 + sum(1 for e in entry.values() if e["logprob"] > mine["logprob"]) or mine["rank"] > 3
    assert close(got, eval_logprobs(ids))
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, not read from the cache

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}]),
                                add_bos=False)
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and close([e[str(t)]["logprob"] for t, e in zip(chat_ids[1:], plp[1:])],
                                    eval_logprobs(chat_ids))


def test_echo_logprobs_stream(client, tokenizer, eval_logprobs):
    ids = tokenizer.encode(PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True, extra_body=NO_EOS))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert close(first.logprobs.token_logprobs[1:], eval_logprobs(ids))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                      temperature=0, extra_body=NO_EOS).choices[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    streamed_lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps[1:] == whole.logprobs.token_logprobs[1:]


# -- tokenizer endpoints --------------------------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info(server, tokenizer):
    status, body = server.request("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})
    got = json.loads(body)
    assert status == 200 and got["tokens"] == tokenizer.encode(PROMPT) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 256
    # lm-eval's remote tokenizer: no special tokens, and the EOS text is one token
    bare = json.loads(server.request("POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})[1])
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_bos=False)
    eos = json.loads(server.request("POST", "/tokenize", {"prompt": "</s>", "add_special_tokens": False,
                                                          "return_token_strs": True})[1])
    assert eos["tokens"] == [min(tokenizer.eos_ids)] and eos["token_strs"] == ["</s>"]
    messages = [{"role": "user", "content": "hi"}]
    chat = json.loads(server.request("POST", "/tokenize", {"messages": messages})[1])
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)
    text = json.loads(server.request("POST", "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})[1])
    assert text == {"prompt": PROMPT}
    status, body = server.request("GET", "/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 256
    models = json.loads(server.request("GET", "/v1/models")[1])
    assert models["data"][0]["max_model_len"] == 256


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
])
def test_bad_tokenizer_requests_name_the_field(server, path, body, param):
    status, text = server.request("POST", path, body)
    assert status in (400, 404) and json.loads(text)["error"]["param"] == param


# -- n and best_of --------------------------------------------------------------------------------
def test_n_choices_share_the_prompt_and_follow_seeds(client, server):
    before = server.metrics()["lowbit_prefix_cache_hits_total"]
    r = client.completions.create(model=MODEL, prompt=PROMPT + " again", max_tokens=6, n=3, seed=11, extra_body=NO_EOS)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert r.usage.completion_tokens == 18
    # the two siblings waited for the first one's prefill and reused its full prompt blocks
    prompt_len = r.usage.prompt_tokens
    assert server.metrics()["lowbit_prefix_cache_hits_total"] - before >= 2 * (prompt_len // 16) * 16 > 0
    # choice i is sampled with seed + i
    for i, text in enumerate(texts):
        alone = client.completions.create(model=MODEL, prompt=PROMPT + " again", max_tokens=6, seed=11 + i,
                                          extra_body=NO_EOS)
        assert alone.choices[0].text == text

    stream = client.completions.create(model=MODEL, prompt=PROMPT + " again", max_tokens=6, n=3, seed=11,
                                       stream=True, extra_body=NO_EOS)
    parts, finishes = {0: "", 1: "", 2: ""}, {}
    for c in stream:
        for choice in c.choices:
            parts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [parts[i] for i in range(3)] == texts and finishes == {0: "length", 1: "length", 2: "length"}

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, seed=3, extra_body=NO_EOS)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content != chat.choices[1].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            n=2, seed=3, stream=True, extra_body=NO_EOS)
    got = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            got[choice.index] += choice.delta.content or ""
    assert [got[0], got[1]] == [c.message.content for c in chat.choices]


def test_best_of_returns_the_most_likely(client):
    kw = dict(model=MODEL, prompt="The lazy dog", max_tokens=5, seed=7, extra_body=NO_EOS)
    every = client.completions.create(n=4, logprobs=0, **kw).choices
    totals = [sum(c.logprobs.token_logprobs) for c in every]
    best = client.completions.create(n=2, best_of=4, **kw).choices
    ranked = sorted(range(4), key=lambda i: totals[i], reverse=True)[:2]
    assert [c.text for c in best] == [every[i].text for i in ranked] and [c.index for c in best] == [0, 1]
    assert best[0].logprobs is None  # not asked for, though ranking needed them
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          n=1, seed=7, extra_body={"best_of": 3, **NO_EOS})
    assert len(chat.choices) == 1


@pytest.mark.parametrize("kw, param", [
    (dict(n=0), "n"),
    (dict(n=65), "n"),
    (dict(extra_body={"n": "2"}), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=0), "best_of"),
    (dict(n=1, best_of=2, stream=True), "best_of"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": "1"}), "prompt_logprobs"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"),  # without echo or prompt_logprobs nothing would come back
    (dict(echo=True, max_tokens=-1), "max_tokens"),
    (dict(extra_body={"echo": "yes"}), "echo"),
    (dict(echo=True, logprobs=21), "logprobs"),
])
def test_bad_values_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        result = client.completions.create(model=MODEL, prompt="Hello", **{"max_tokens": 2, **kw})
        if kw.get("stream"):
            list(result)
    assert err.value.status_code == 400 and err.value.body["param"] == param


@pytest.mark.parametrize("kw, param", [
    (dict(n=0), "n"),
    (dict(extra_body={"best_of": 1}, n=2), "best_of"),
    (dict(extra_body={"prompt_logprobs": 99}), "prompt_logprobs"),
])
def test_bad_chat_values_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
    assert err.value.body["param"] == param


# -- several prompts in one request (lm-eval's batch_size > 1) ------------------------------------
def test_several_prompts_answer_as_separate_requests_would(client, server, tokenizer, eval_logprobs):
    texts = [PROMPT, "The lazy dog sleeps", "A server answers"]
    ids = [tokenizer.encode(t) for t in texts]
    # what lm-eval sends with batch_size > 1: token-id prompts, echo, logprobs, max_tokens 0 or 1
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, t in zip(r.choices, ids):
        assert c.text == tokenizer.decode(t) and c.logprobs.token_logprobs[0] is None
        assert close(c.logprobs.token_logprobs[1:], eval_logprobs(t))
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 0

    # text and token-id prompts mixed, n = 2: choice p * n + j is prompt p's j-th, seeded seed + j
    mixed = [texts[1], ids[2]]
    batch = client.completions.create(model=MODEL, prompt=mixed, max_tokens=5, n=2, seed=5, extra_body=NO_EOS)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(mixed):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=2, seed=5, extra_body=NO_EOS)
        assert [c.text for c in batch.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices]
    assert batch.usage.completion_tokens == 20

    # best_of per prompt
    best = client.completions.create(model=MODEL, prompt=mixed, max_tokens=4, n=1, best_of=3, seed=2, extra_body=NO_EOS)
    for p, prompt in enumerate(mixed):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=1, best_of=3, seed=2, extra_body=NO_EOS)
        assert best.choices[p].text == alone.choices[0].text and best.choices[p].index == p

    # streamed: every choice's text, indices as in the whole answer, echo first per prompt
    whole = client.completions.create(model=MODEL, prompt=mixed, max_tokens=4, n=2, seed=9, echo=True, logprobs=0,
                                      extra_body=NO_EOS)
    got, finishes = {i: "" for i in range(4)}, {}
    for chunk in client.completions.create(model=MODEL, prompt=mixed, max_tokens=4, n=2, seed=9, echo=True,
                                           logprobs=0, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            got[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [got[i] for i in range(4)] == [c.text for c in whole.choices] and len(finishes) == 4
    assert whole.choices[2].text.startswith(tokenizer.decode(ids[2]))


@pytest.mark.parametrize("prompt, message", [
    (["Hello", ""], "prompt[1] must not be empty"),
    (["Hello", []], "prompt[1] must be a non-empty string or a non-empty list of token ids"),
    (["Hello", [1, "x"]], "prompt[1] must be a non-empty string or a non-empty list of token ids"),
    ([[1, 2], [10**9]], "in prompt[1] is outside the vocabulary"),
    ([], "prompt must be a non-empty string"),
    (["Hello"] * 1025, "at most 1024 prompts"),
])
def test_bad_prompt_lists_are_400_naming_the_prompt(client, prompt, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert err.value.body["param"] == "prompt" and message in err.value.body["message"]


def test_a_prompt_too_long_for_the_context_is_named(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[[5, 6], [5] * 5000], max_tokens=2)
    assert err.value.body["message"].startswith("the prompt[1] has 5000 tokens")
