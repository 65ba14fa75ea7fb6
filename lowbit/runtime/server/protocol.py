"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Requests are validated by hand rather than by a schema library so that every refusal names the
offending parameter in OpenAI's error object ({"error": {"message", "type", "param", "code"}})
with one clear sentence. Numeric ranges are SamplingParams' own checks (one source of truth);
this module checks types, shapes and the parameters SamplingParams does not know.

The body must be strict JSON in UTF-8: no NaN/Infinity literals, no lone surrogate escapes (no
UTF-8 string could carry them to the tokenizer or back out), bounded nesting. Numbers are checked
to be finite and integers bounded before they reach a tensor; a value quoted in an error message
is cut short (`show`), so a refusal is always one short line.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from lowbit.errors import UsageError
from lowbit.runtime.engine.sequence import MAX_LOGPROBS, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_CHOICES = 64  # n and best_of: each choice is one sequence in the engine's running batch
MAX_PROMPTS = 1024  # prompts in one completions request (lm-eval sends its batch as one)
# top_k and token counts go into int64 tensors (and make no sense past a vocabulary or a context):
# a bigger value must be a 400 here, not an overflow that stops the engine thread.
MAX_INT_PARAM = 2**31 - 1
_SHOW_CHARS = 40  # a value quoted in an error message: enough to recognise, never the whole body


class APIError(Exception):
    """An HTTP error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(slots=True)
class GenerationRequest:
    """A validated request, before tokenization: prompts (completions) or messages (chat)."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]] | None = None  # each a non-empty text or list of token ids
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None  # None: the rest of the context (chat) / 16 (completions)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-n alternatives per token; None = no logprobs
    prompt_logprobs: int | None = None  # vLLM's: top-n alternatives per prompt token; None = none
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated, of which the n with the highest cumulative logprob are returned

    @property
    def wants_prompt_logprobs(self) -> bool:
        """echo with logprobs (the legacy shape) or vLLM's prompt_logprobs."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)

    def sampling_params(self, max_tokens: int, seed_offset: int = 0, prompt_logprobs: bool = False) -> SamplingParams:
        """Engine params for one sequence: seed_offset is added to a seed (sequence i of a request with
        n > 1 draws with seed + i); prompt_logprobs asks for the prompt's logprobs (one sequence per
        request does). max_tokens is at least 1 in the engine (0 is answered by dropping the token)."""
        sampling = dict(self.sampling)
        if seed_offset and sampling.get("seed") is not None:
            sampling["seed"] = (sampling["seed"] + seed_offset) % 2**63
        logprobs = self.logprobs
        if self.best_of > self.n and logprobs is None:
            logprobs = 0  # ranking needs each token's logprob
        top = max(self.logprobs or 0, self.prompt_logprobs or 0)
        try:
            return SamplingParams(max_tokens=max(max_tokens, 1), logprobs=logprobs,
                                  prompt_logprobs=top if prompt_logprobs else None, **sampling)
        except UsageError as exc:
            message = str(exc)
            first = message.split()[0] if message else None
            raise bad_request(message, param=first if first in _SAMPLING_FIELDS else None) from None


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens",
                    "stop", "stop_token_ids", "logprobs", "ignore_eos", "logit_bias", "presence_penalty",
                    "frequency_penalty", "min_tokens")


def show(value: Any) -> str:
    """repr(value) cut to a few dozen characters, for error messages (one line, bounded)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_SHOW_CHARS:
        # repr of a 4000-digit int is long (and past 4300 digits an error): say its size instead
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


# -- parsing ----------------------------------------------------------------------------------
def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); no UTF-16/32 guessing
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN / Infinity, or an integer past Python's digit limit
        raise bad_request(f"the request body is not valid JSON: {' '.join(str(exc).split()[:12])}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, value in body.items():
        _check_encodable(key, value)
    return body


def _check_encodable(key: str, value: Any) -> None:
    # A \ud800 escape is valid JSON but no UTF-8 string: the tokenizer and every response writer
    # would fail on it, so it is refused here, naming the field it is in.
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("a field name contains a lone UTF-16 surrogate escape") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{show(key)} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff)", key) from None
    except RecursionError:
        raise bad_request(f"{show(key)} is nested too deeply", key) from None


def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    req = GenerationRequest(chat=False, model=_model(body))
    req.prompts = _prompts(body.get("prompt"))
    req.echo = _bool(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        req.logprobs = logprobs
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    req.prompt_logprobs = _prompt_logprobs(body)
    # max_tokens 0: score the prompt only (lm-eval's loglikelihood requests), so it needs echo or
    # prompt_logprobs, else the answer would be empty
    req.max_tokens = _max_tokens(body, "max_tokens", 0 if req.echo or req.prompt_logprobs is not None else 1,
                                 " (0 only with echo or prompt_logprobs: then the prompt is the answer)")
    _common(body, req)
    _choices(body, req)
    if len(req.prompts) * req.best_of > MAX_PROMPTS:
        raise bad_request(f"{len(req.prompts)} prompts x best_of {req.best_of} is more than the {MAX_PROMPTS} "
                          f"sequences one request may start", "prompt")
    return req


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    req = GenerationRequest(chat=True, model=_model(body))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    if _bool(body, "logprobs"):
        top = body.get("top_logprobs", 0)
        if top is None:
            top = 0
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        req.logprobs = top
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _max_tokens(body, name)
    req.prompt_logprobs = _prompt_logprobs(body)
    _common(body, req)
    _choices(body, req)
    return req


def _prompts(prompt: Any) -> list[str | list[int]]:
    """vLLM's shapes: a string, a list of token ids, or a list of strings and token-id lists."""
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt
    else:
        raise bad_request("prompt must be a non-empty string, a non-empty list of token ids, or a list of those",
                          "prompt")
    if len(batch) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts in one request, got {len(batch)}", "prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{where} must not be empty", "prompt")
            out.append(p)
        elif p and all(_is_int(t) for t in p):
            out.append(list(p))
        else:
            raise bad_request(f"{where} must be a non-empty string or a non-empty list of token ids", "prompt")
    return out


def _common(body: dict[str, Any], req: GenerationRequest) -> None:
    req.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not req.stream:
            raise bad_request("stream_options needs stream: true", "stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise bad_request("stream_options.include_usage must be true or false", "stream_options")
        req.include_usage = bool(include)
    sampling: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None:
            number = _finite_float(value)
            if number is None:
                raise bad_request(f"{name} must be a finite number, got {show(value)}", name)
            sampling[name] = number
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or not -1 <= top_k <= MAX_INT_PARAM:
            raise bad_request(f"top_k must be an integer in [-1, {MAX_INT_PARAM}] (0 or -1 = off), "
                              f"got {show(top_k)}", "top_k")
        sampling["top_k"] = max(top_k, 0)  # -1 is vLLM's spelling of "off"
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed < 2**63:
            raise bad_request(f"seed must be an integer in [0, 2**63), got {show(seed)}", "seed")
        sampling["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        sampling["stop"] = tuple(stops)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t <= MAX_INT_PARAM for t in stop_ids):
            raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
        sampling["stop_token_ids"] = tuple(stop_ids)
    if body.get("ignore_eos") is not None:
        sampling["ignore_eos"] = _bool(body, "ignore_eos")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_int(min_tokens) or not 0 <= min_tokens <= MAX_INT_PARAM:
            raise bad_request(f"min_tokens must be an integer in [0, {MAX_INT_PARAM}], got {show(min_tokens)}",
                              "min_tokens")
        sampling["min_tokens"] = min_tokens  # <= max_tokens: SamplingParams checks it
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        sampling["logit_bias"] = bias
    schema = _response_format(body.get("response_format"))
    if schema is not None:
        sampling["guided_json"] = schema
    req.sampling = sampling


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's {"token id as a string": bias in [-100, 100]} as {id: bias}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids (as strings) to numbers in [-100, 100]",
                          "logit_bias")
    bias = {}
    for key, b in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) > MAX_INT_PARAM:
            raise bad_request(f"logit_bias keys must be token ids, got {show(key)}", "logit_bias")
        number = _finite_float(b)
        if number is None or not -100 <= number <= 100:
            raise bad_request(f"logit_bias[{show(key)}] must be a number in [-100, 100], got {show(b)}", "logit_bias")
        bias[int(key)] = number
    return bias


def check_logit_bias(req: GenerationRequest, vocab_size: int) -> None:
    """logit_bias ids must be in the model's vocabulary (known only once the engine is)."""
    bias = req.sampling.get("logit_bias") or {}
    bad = next((t for t in bias if t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})", "logit_bias")


def _response_format(value: Any) -> str | None:
    """response_format -> the JSON Schema (as JSON text) the output must match, or None for text."""
    from lowbit.runtime.engine import guided

    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return guided.JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise bad_request("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema", "response_format")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be true or false", "response_format")
    if spec.get("schema") is None:
        raise bad_request("response_format.json_schema.schema is required (the JSON Schema to follow)",
                          "response_format")
    try:
        text = guided.schema_text(spec["schema"])
        guided.check_schema(text)
    except UsageError as exc:
        raise bad_request(f"response_format.json_schema.schema: {exc}", "response_format") from None
    return text


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text can be served
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {**m, "content": content}


def _max_tokens(body: dict[str, Any], name: str, least: int = 1, zero_hint: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not least <= value <= MAX_INT_PARAM:
        why = zero_hint if value == 0 else ""
        raise bad_request(f"{name} must be an integer in [{least}, {MAX_INT_PARAM}], got {show(value)}{why}", name)
    return value


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    value = body.get("prompt_logprobs")
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {show(value)}",
                          "prompt_logprobs")
    return value


def _choices(body: dict[str, Any], req: GenerationRequest) -> None:
    """n and best_of (vLLM's rule: best_of >= n sequences, the n most likely returned)."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or not 1 <= value <= MAX_CHOICES):
            raise bad_request(f"{name} must be an integer in [1, {MAX_CHOICES}], got {show(value)}", name)
    req.n = body.get("n") or 1
    best_of = body.get("best_of")
    req.best_of = req.n if best_of is None else best_of
    if req.best_of < req.n:
        raise bad_request(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
    if req.best_of > req.n and req.stream:
        raise bad_request("best_of > n cannot be streamed: the best sequences are known only at the end",
                          "best_of")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM (echo with logprobs does stream)
        raise bad_request("prompt_logprobs cannot be streamed", "prompt_logprobs")


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite_float(x: Any) -> float | None:
    """float(x) for a JSON number that is a finite float64; None for anything else (1e999 parses
    as inf, and float(10**400) overflows)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return None
    try:
        number = float(x)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass(slots=True)
class TokenizeRequest:
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # prompt: the tokenizer's BOS rule; messages: default false (the template writes BOS)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    req = TokenizeRequest()
    if "messages" in body and body.get("prompt") is None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
        req.messages = [_message(m, i) for i, m in enumerate(messages)]
        req.add_special_tokens = False
        if body.get("add_generation_prompt") is not None:
            req.add_generation_prompt = _bool(body, "add_generation_prompt")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string (or send messages)", "prompt")
        req.prompt = prompt
    if body.get("add_special_tokens") is not None:
        req.add_special_tokens = _bool(body, "add_special_tokens")
    req.return_token_strs = _bool(body, "return_token_strs")
    return req


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t <= MAX_INT_PARAM for t in tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    return tokens


# -- responses --------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(entries: list[tuple[str, float | None, list[tuple[str, float]] | None]],
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists. entries = (token text, logprob, top [(text, lp)]);
    the first echoed prompt token has logprob and top None (nothing predicts it)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for text, lp, top in entries:
        tokens.append(text)
        token_logprobs.append(lp)
        top_logprobs.append(dict(top) if top is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def join_logprobs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first if second is None else second
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(entries: list, decode) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top alternatives (rank 1 = most likely)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": decode([e.token_id])}}
        for rank, (token, lp) in enumerate(e.top, 1):
            item.setdefault(str(token), {"logprob": lp, "rank": rank, "decoded_token": decode([token])})
        out.append(item)
    return out


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    def item(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(text, lp), "top_logprobs": [item(t, l) for t, l in top]} for text, lp, top in entries],
            "refusal": None}
