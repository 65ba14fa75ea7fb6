"""Answers: a request's RequestOutputs turned into OpenAI's JSON, as one body or as server-sent
events, for every choice of the request (n / best_of fan out to several engine sequences).

The echo and prompt-logprob shapes (legacy `logprobs` with a null first entry, vLLM's
`prompt_logprobs`), usage, and the finish reason of each choice are built here; app.py owns the
request's admission and life (Tracker) and hands an Answer the tracker to read outputs from.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
class Choice:
    """What one engine sequence of a request has produced so far."""

    index: int
    text: list[str]
    entries: list  # (token text, logprob, top) per reported token
    cumulative_logprob: float = 0.0
    last: Any = None  # the latest RequestOutput


class Answer:
    """Turns a request's RequestOutputs into OpenAI's JSON, whole or as SSE chunks.

    max_tokens 0 (echo or prompt_logprobs only) ran one token in the engine; it is dropped here,
    so the answer is the prompt alone, finish_reason "length"."""

    def __init__(self, server: Server, req: GenerationRequest, tracker: Tracker, tokenizer,
                 prompt_ids: list[int], prompt_text: str | None, max_tokens: int):
        self.server = server
        self.req = req
        self.tracker = tracker
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.score_only = max_tokens == 0
        self.created = protocol.now()
        self.choices = {engine_id: Choice(i, [], []) for i, engine_id in enumerate(tracker.engine_ids)}
        self.prompt_logprobs = None  # the PromptLogprob list, once the first sequence has it

    def _record(self, out) -> tuple[Choice, str, list]:
        """Fold one output into its choice; returns (choice, new text, new logprob entries)."""
        choice = self.choices[out.request_id]
        choice.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
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

    def _prompt_entries(self) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
        """The echoed prompt's tokens for the legacy logprobs shape (the first has no logprob)."""
        decode, top_n = self.tokenizer.decode, self.req.logprobs or 0
        lps = self.prompt_logprobs or [None] * len(self.prompt_ids)
        out = []
        for tid, e in zip(self.prompt_ids, lps):
            if e is None:
                out.append((decode([tid]), None, None))
            else:
                out.append((decode([tid]), e.logprob, [(decode([t]), l) for t, l in e.top[:top_n]]))
        return out

    def _echo_text(self) -> str:
        if not self.req.echo:
            return ""
        return self.prompt_text if self.prompt_text is not None else self.tokenizer.decode(self.prompt_ids)

    def _echo_logprobs(self) -> dict[str, Any] | None:
        if not (self.req.echo and self.req.logprobs is not None):
            return None
        return protocol.completion_logprobs(self._prompt_entries(), 0)

    def _vllm_prompt_logprobs(self) -> list | None:
        if self.req.prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        top = self.req.prompt_logprobs
        trimmed = [e if e is None or len(e.top) <= top else _with_top(e, top) for e in self.prompt_logprobs]
        return protocol.vllm_prompt_logprobs(trimmed, self.tokenizer.decode)

    def _finish_reason(self, choice: Choice) -> str | None:
        return "length" if self.score_only else choice.last.finish_reason

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.tracker.request_id, "object": kind, "created": self.created,
                "model": self.server.config.model_name}

    def _usage(self) -> dict[str, Any]:
        lasts = [c.last for c in self.choices.values() if c.last is not None]
        generated = 0 if self.score_only else sum(o.num_generated_tokens for o in lasts)
        # every sequence generated is counted (best_of's too); the prompt once, with the first
        # sequence's cache hits (the others reuse its blocks)
        return protocol.usage(len(self.prompt_ids), generated, lasts[0].num_cached_tokens if lasts else 0)

    def _returned(self) -> list[Choice]:
        """The n choices answered: all of them, or with best_of > n the n with the highest
        cumulative logprob (vLLM's rule), most likely first."""
        choices = list(self.choices.values())
        if self.req.best_of > self.req.n:
            choices = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[: self.req.n]
        return choices

    # -- whole ----------------------------------------------------------------------------------
    async def whole(self, request: Request) -> Response:
        watcher = asyncio.ensure_future(_watch_disconnect(request, self.tracker.stream))
        try:
            async for out in self.tracker.outputs():
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
            prompt_lps = self._vllm_prompt_logprobs()
            if prompt_lps is not None:
                body["prompt_logprobs"] = prompt_lps  # vLLM puts a chat request's at the top level
            return JSONResponse(body)
        echo, echo_lps, prompt_lps = self._echo_text(), self._echo_logprobs(), self._vllm_prompt_logprobs()
        choices = []
        for i, c in enumerate(self._returned()):
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = protocol.join_logprobs(echo_lps, protocol.completion_logprobs(c.entries, len(echo)))
            choice = {"index": i, "text": echo + "".join(c.text), "logprobs": logprobs,
                      "finish_reason": self._finish_reason(c)}
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
        return JSONResponse({**self._envelope("text_completion"), "choices": choices, "usage": use})

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

        # the echo goes first; with its logprobs it waits for the first sequence's prompt logprobs,
        # which come with that sequence's first output (before any sibling's: they wait for its prefill)
        echo_pending = not chat and self.req.echo

        def echo_chunks() -> list[str]:
            echo = self._echo_text()
            out = [chunk(c.index, echo, None, [], logprobs=self._echo_logprobs()) for c in self.choices.values()]
            for index in offsets:
                offsets[index] += len(echo)
            return out

        try:
            if chat:
                for c in self.choices.values():
                    yield chunk(c.index, "", None, [], role=True)
            elif echo_pending and not self.req.wants_prompt_logprobs:
                for event in echo_chunks():
                    yield event
                echo_pending = False
            async for out in self.tracker.outputs():
                choice, text, entries = self._record(out)
                if echo_pending:
                    for event in echo_chunks():
                        yield event
                    echo_pending = False
                if not text and not entries and not out.finished:
                    continue  # a prefill chunk or held-back bytes: nothing to say yet
                finish = self._finish_reason(choice) if out.finished else None
                yield chunk(choice.index, text, finish, entries)
                offsets[choice.index] += len(text)
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


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _watch_disconnect(request: Request, stream: RequestStream) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.queue.put_nowait(DISCONNECTED)
            return
