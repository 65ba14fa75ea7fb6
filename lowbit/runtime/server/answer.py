"""Answers: a request's RequestOutputs turned into OpenAI's JSON, as one body or as server-sent
events, for every choice of the request (n / best_of fan out to several engine sequences, and a
completions request may carry several prompts: choice p * n + j is prompt p's j-th, as in vLLM).

The echo and prompt-logprob shapes (legacy `logprobs` with a null first entry, vLLM's
`prompt_logprobs`), usage, and the finish reason of each choice are built here; app.py owns the
request's admission and life (Tracker) and hands an Answer the tracker to read outputs from.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lowbit.runtime.server import protocol
from lowbit.runtime.server.engine_loop import RequestStream
from lowbit.runtime.server.protocol import APIError, GenerationRequest

if TYPE_CHECKING:  # app.py imports this module: the types only, to annotate
    from lowbit.runtime.server.app import Server, Tracker

DISCONNECTED = object()  # put on a request's queue by the disconnect watcher


class SSEResponse(StreamingResponse):
    """A StreamingResponse whose request is closed however the response ends, even if the
    client left before the first event (then the body generator never starts)."""

    def __init__(self, content, tracker: Tracker, **kwargs):
        super().__init__(content, **kwargs)
        self.tracker = tracker

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.tracker.close()


@dataclass(slots=True)
class Prompt:
    """One prompt of a request, tokenized, and the prompt logprobs its first sequence reports."""

    ids: list[int]
    text: str | None  # as sent, or None when it came as token ids (the echo decodes them)
    logprobs: list | None = None  # PromptLogprob per token, once the first sequence has them


@dataclass(slots=True)
class Choice:
    """What one engine sequence of a request has produced so far."""

    index: int  # in the streamed answer: prompt p's sequence j is p * n + j (best_of == n there)
    prompt: Prompt
    text: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)  # (token text, logprob, top) per reported token
    cumulative_logprob: float = 0.0
    last: Any = None  # the latest RequestOutput


class Answer:
    """Turns a request's RequestOutputs into OpenAI's JSON, whole or as SSE chunks.

    max_tokens 0 (echo or prompt_logprobs only) ran one token in the engine; it is dropped here,
    so the answer is the prompt alone, finish_reason "length"."""

    def __init__(self, server: Server, req: GenerationRequest, tracker: Tracker, tokenizer, prompts: list[Prompt],
                 route=None):
        """tracker.engine_ids: best_of sequences per prompt, prompt by prompt, each prompt's first
        sequence first (the one that reports its prompt logprobs and cache hits). route: under
        --cascade, the query_cascade.CascadeRoute that says which model answered (in every body and chunk)."""
        self.server = server
        self.route = route
        self.req = req
        self.tracker = tracker
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.score_only = req.max_tokens == 0
        self.created = protocol.now()
        per = req.best_of
        self.choices = {engine_id: Choice(i // per * req.n + i % per, prompts[i // per])
                        for i, engine_id in enumerate(tracker.engine_ids)}

    def _record(self, out) -> tuple[Choice, str, list]:
        """Fold one output into its choice; returns (choice, new text, new logprob entries)."""
        choice = self.choices[out.request_id]
        choice.last = out
        if out.prompt_logprobs is not None:
            choice.prompt.logprobs = out.prompt_logprobs
        if self.score_only:
            return choice, "", []
        if out.logprobs:
            choice.cumulative_logprob += sum(lp for lp, _ in out.logprobs)
        entries = self._entries(out)
        choice.text.append(out.text_delta)
        choice.entries += entries
        return choice, out.text_delta, entries

    def _entries(self, out) -> list[tuple[str, float, list[tuple[str, float]]]]:
        if self.req.logprobs is None or not out.logprobs:
            return []
        decode = self.tokenizer.decode
        return [(decode([tid]), lp, [(decode([t]), l) for t, l in top])
                for tid, (lp, top) in zip(out.new_token_ids, out.logprobs)]

    def _prompt_entries(self, prompt: Prompt) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
        """The echoed prompt's tokens for the legacy logprobs shape (the first has no logprob)."""
        decode, top_n = self.tokenizer.decode, self.req.logprobs or 0
        lps = prompt.logprobs or [None] * len(prompt.ids)
        out = []
        for tid, e in zip(prompt.ids, lps):
            if e is None:
                out.append((decode([tid]), None, None))
            else:
                out.append((decode([tid]), e.logprob, [(decode([t]), l) for t, l in e.top[:top_n]]))
        return out

    def _echo_text(self, prompt: Prompt) -> str:
        if not self.req.echo:
            return ""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)

    def _echo_logprobs(self, prompt: Prompt) -> dict[str, Any] | None:
        if not (self.req.echo and self.req.logprobs is not None):
            return None
        return protocol.completion_logprobs(self._prompt_entries(prompt), 0)

    def _vllm_prompt_logprobs(self, prompt: Prompt) -> list | None:
        if self.req.prompt_logprobs is None or prompt.logprobs is None:
            return None
        top = self.req.prompt_logprobs
        trimmed = [e if e is None or len(e.top) <= top else _with_top(e, top) for e in prompt.logprobs]
        return protocol.vllm_prompt_logprobs(trimmed, self.tokenizer.decode)

    def _finish_reason(self, choice: Choice) -> str | None:
        return "length" if self.score_only else choice.last.finish_reason

    def headers(self) -> dict[str, str]:
        """Under --cascade, X-Lowbit-Answered-By: cheap | full (the body's "cascade" says it too)."""
        return {} if self.route is None else {"X-Lowbit-Answered-By": self.route.answered_by}

    def _envelope(self, kind: str) -> dict[str, Any]:
        envelope = {"id": self.tracker.request_id, "object": kind, "created": self.created,
                    "model": self.server.config.model_name}
        if self.route is not None:
            envelope["cascade"] = self.route.as_dict()
        return envelope

    def _usage(self) -> dict[str, Any]:
        lasts = [c.last for c in self.choices.values() if c.last is not None]
        generated = 0 if self.score_only else sum(o.num_generated_tokens for o in lasts)
        # every sequence generated is counted (best_of's too); each prompt once, with its first
        # sequence's cache hits (the others reuse its blocks)
        firsts = list(self.choices.values())[:: self.req.best_of]
        cached = sum(c.last.num_cached_tokens for c in firsts if c.last is not None)
        return protocol.usage(sum(len(p.ids) for p in self.prompts), generated, cached)

    def _returned(self) -> list[Choice]:
        """The n choices answered per prompt, prompt by prompt: all of them, or with best_of > n
        the n with the highest cumulative logprob (vLLM's rule), most likely first."""
        choices = list(self.choices.values())
        per, n = self.req.best_of, self.req.n
        groups = [choices[i : i + per] for i in range(0, len(choices), per)]
        if per > n:
            groups = [sorted(g, key=lambda c: c.cumulative_logprob, reverse=True)[:n] for g in groups]
        return [c for g in groups for c in g]

    # -- whole ----------------------------------------------------------------------------------
    async def whole(self, request: Request) -> Response:
        watcher = asyncio.ensure_future(watch_disconnect(request, self.tracker.stream))
        try:
            async for outs in self.tracker.arrivals():
                for out in outs:
                    self._record(out)
        except APIError as exc:
            return self.server.error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        finally:
            watcher.cancel()
            self.tracker.close()
        use = self._usage()
        if self.req.chat:
            body = {**self._envelope("chat.completion"), "choices": [
                {"index": i, "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
                 "logprobs": protocol.chat_logprobs(c.entries) if self.req.logprobs is not None else None,
                 "finish_reason": self._finish_reason(c)}
                for i, c in enumerate(self._returned())], "usage": use}
            prompt_lps = self._vllm_prompt_logprobs(self.prompts[0])
            if prompt_lps is not None:
                body["prompt_logprobs"] = prompt_lps  # vLLM puts a chat request's at the top level
            return JSONResponse(body, headers=self.headers())
        choices = []
        for i, c in enumerate(self._returned()):
            echo, echo_lps, prompt_lps = self._echo_text(c.prompt), self._echo_logprobs(c.prompt), self._vllm_prompt_logprobs(c.prompt)
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = protocol.join_logprobs(echo_lps, protocol.completion_logprobs(c.entries, len(echo)))
            choice = {"index": i, "text": echo + "".join(c.text), "logprobs": logprobs,
                      "finish_reason": self._finish_reason(c)}
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
        return JSONResponse({**self._envelope("text_completion"), "choices": choices, "usage": use},
                            headers=self.headers())

    # -- streamed -------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[str]:
        """Chunks of every choice as its tokens come (best_of > n is never streamed: protocol.py)."""
        chat, usage_on = self.req.chat, self.req.include_usage
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = {c.index: 0 for c in self.choices.values()}

        def chunk(index: int, delta_text: str | None, finish: str | None, entries, role: bool = False,
                  logprobs: dict | None = None) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                lps = protocol.chat_logprobs(entries) if entries else None
                choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                if logprobs is None and entries:
                    logprobs = protocol.completion_logprobs(entries, offsets[index])
                choice = {"index": index, "text": delta_text or "", "logprobs": logprobs, "finish_reason": finish}
            payload = {**self._envelope(kind), "choices": [choice]}
            if usage_on:
                payload["usage"] = None
            return _sse(payload)

        # a prompt's echo goes first; with its logprobs it waits for the prompt's first sequence's
        # prompt logprobs, which come with that sequence's first output (before any sibling's:
        # they wait for its prefill)
        echo_pending = {id(p) for p in self.prompts} if not chat and self.req.echo else set()

        def echo_chunks(prompt: Prompt) -> list[str]:
            echo_pending.discard(id(prompt))
            echo, logprobs = self._echo_text(prompt), self._echo_logprobs(prompt)
            out = []
            for c in self.choices.values():
                if c.prompt is prompt:
                    out.append(chunk(c.index, echo, None, [], logprobs=logprobs))
                    offsets[c.index] += len(echo)
            return out

        try:
            if chat:
                for c in self.choices.values():
                    yield chunk(c.index, "", None, [], role=True)
            elif echo_pending and not self.req.wants_prompt_logprobs:
                for prompt in self.prompts:
                    for event in echo_chunks(prompt):
                        yield event
            async for outs in self.tracker.arrivals():
                events = []  # what arrived together goes out in one write
                for out in outs:
                    choice, text, entries = self._record(out)
                    if id(choice.prompt) in echo_pending:
                        events.extend(echo_chunks(choice.prompt))
                    if not text and not entries and not out.finished:
                        continue  # a prefill chunk or held-back bytes: nothing to say yet
                    finish = self._finish_reason(choice) if out.finished else None
                    events.append(chunk(choice.index, text, finish, entries))
                    offsets[choice.index] += len(text)
                if events:
                    yield "".join(events)
            if usage_on:
                yield _sse({**self._envelope(kind), "choices": [], "usage": self._usage()})
        except APIError as exc:
            self.server.metrics.errors[exc.status] += 1
            yield _sse(exc.body())
        finally:
            self.tracker.close()
        yield "data: [DONE]\n\n"


def _with_top(entry, top: int):
    """A PromptLogprob with only its `top` first alternatives (the engine computed the widest asked)."""
    return type(entry)(entry.token_id, entry.logprob, entry.rank, entry.top[:top])


# Line breaks to clients that split an event stream with str.splitlines(): JSON leaves NEL, LINE
# SEPARATOR and PARAGRAPH SEPARATOR unescaped, and a generated token containing one cut guidellm's
# event in two (a JSONDecodeError, counted as a failed request). Escaped, the JSON is the same.
_SPLITTERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_SPLITTERS)}\n\n"


async def watch_disconnect(request: Request, stream: RequestStream) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.queue.put_nowait(DISCONNECTED)
            return
