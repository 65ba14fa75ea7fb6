"""The HTTP layer: a Starlette app speaking OpenAI's API over one EngineLoop, run by uvicorn.

Request life: read the body (size-limited) -> validate (protocol.py) -> tokenize (chat template
for chat) -> check the context and the admission limit -> submit to the engine thread -> answer
from the request's output queue, as one JSON body or as server-sent events. Whatever ends a
request early (client gone, error, shutdown) runs `Tracker.close()`, which aborts it in the
engine so its KV blocks go back to the pool at the next step.

Admission: at most max_running + max_queue requests are in flight; beyond that the answer is
429 at once, so memory never grows with the offered load.

Shutdown (SIGTERM, or SIGINT: exit 0, or 130): uvicorn stops accepting connections, new requests on open ones get 503, and
the requests in flight get --shutdown-timeout seconds; whatever is still open then is ended by
the engine loop (a stream gets an error event and [DONE], a whole answer a 503), never cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from lowbit.errors import LowbitError
from lowbit.runtime.server import protocol
from lowbit.runtime.server.answer import DISCONNECTED, Answer, Prompt, SSEResponse
from lowbit.runtime.server.engine_loop import EngineFailure, EngineLoop, EngineStopping, RequestRejected, RequestStream
from lowbit.runtime.server.metrics import Metrics
from lowbit.runtime.server.protocol import APIError, GenerationRequest, bad_request
from lowbit.runtime.server.query_cascade import CHEAP, CascadeRoute, QueryCascade

log = logging.getLogger("lowbit.serve")

_DRAIN_GRACE_S = 5.0  # after the drain deadline, time for the ended requests' last bytes to go out


@dataclass(slots=True)
class ServerConfig:
    model_name: str  # the id clients must send as "model"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_running: int = 64
    max_queue: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM

    @property
    def max_in_flight(self) -> int:
        return self.max_running + self.max_queue


class Tracker:
    """One admitted request: its output queue, its latency figures, and its single cleanup.

    A request with n > 1 (or best_of) is several engine requests (`engine_ids`) sharing this one
    queue; outputs carry their engine id, and the request is done when all of them are."""

    def __init__(self, server: Server, request_id: str, loop: asyncio.AbstractEventLoop, engine_ids: list[str]):
        self.server = server
        self.request_id = request_id
        self.engine_ids = engine_ids
        self.open = set(engine_ids)  # engine requests not finished yet
        self.stream = RequestStream(loop)
        self.arrival = time.perf_counter()
        self.first_token = False
        self.last_token_time: dict[str, float] = {}
        self.rejected = False
        self.closed = False

    @property
    def finished(self) -> bool:
        return not self.open

    async def arrivals(self) -> AsyncIterator[list[Any]]:
        """RequestOutputs as they arrive, each time all that is queued (so a stream that fell
        behind the engine catches up in one write), until the last finished one; raises on engine
        failure or a vanished client, after yielding the outputs that came before it."""
        while self.open:
            items = [await self.stream.queue.get()]
            while not self.stream.queue.empty():
                items.append(self.stream.queue.get_nowait())
            outs, failure = [], None
            for item in items:
                if not self.open:
                    break  # finished: whatever came after (a disconnect) is moot
                failure = self._failure(item)
                if failure is not None:
                    break
                self._time(item)
                outs.append(item)
            if outs:
                yield outs
            if failure is not None:
                raise failure

    def _failure(self, item: Any) -> Exception | None:
        """The exception a queued item means for the handler, or None for a RequestOutput."""
        if item is DISCONNECTED:
            return ClientDisconnect()
        if isinstance(item, RequestRejected):
            self.rejected = True  # close() aborts the siblings that did enter the engine
            return bad_request(str(item))
        if isinstance(item, EngineFailure):
            self.open.clear()  # the engine loop aborted them already
            stopping = isinstance(item, EngineStopping)
            if stopping:
                self.server.metrics.finished["abort"] += 1  # ended by the shutdown: counted as aborts
            code = "shutting_down" if stopping else "engine_unavailable"
            return APIError(503, str(item), type="server_error", code=code)
        return None

    def _time(self, out) -> None:
        now = time.perf_counter()
        metrics = self.server.metrics
        n = len(out.new_token_ids)
        if n:
            last = self.last_token_time.get(out.request_id)
            if last is None:
                if not self.first_token:
                    self.first_token = True
                    metrics.ttft.observe(now - self.arrival)
                if n > 1:  # several tokens at once (speculation): spread the gap over them
                    metrics.itl.observe(0.0, n - 1)
            else:
                metrics.itl.observe((now - last) / n, n)
            self.last_token_time[out.request_id] = now
        if out.finished:
            self.open.discard(out.request_id)
            metrics.finished[out.finish_reason or "stop"] += 1
            if not self.open:
                metrics.e2e.observe(now - self.arrival)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.metrics.in_flight -= 1
        for engine_id in self.open:  # aborting an id the engine never took is a no-op
            self.server.engine_loop.abort(engine_id)
            if not self.rejected:
                self.server.metrics.finished["abort"] += 1
        self.open.clear()


class Server:
    def __init__(self, config: ServerConfig, engine_loop: EngineLoop, cascade: QueryCascade | None = None):
        self.config = config
        self.engine_loop = engine_loop
        self.cascade = cascade
        self.metrics = Metrics()
        self.stopping = False
        self.created = protocol.now()

    def begin_drain(self) -> None:
        """Shutdown has begun (SIGTERM): uvicorn stopped accepting connections; refuse new requests
        on open ones too, and give those in flight shutdown_timeout seconds before they are ended
        with an error event (streams) or a 503, so no client sees a cut connection."""
        if self.stopping:
            return
        self.stopping = True
        log.info("shutting down: %d request(s) in flight get %g s to finish", self.metrics.in_flight,
                 self.config.shutdown_timeout)
        asyncio.get_running_loop().call_later(self.config.shutdown_timeout, self.engine_loop.end_all,
                                              "the server is shutting down")

    # -- plumbing -------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def require_ready(self) -> Any:
        loop = self.engine_loop
        if self.stopping:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if loop.state == "loading":
            raise APIError(503, "the model is still loading; retry when /health answers 200",
                           type="server_error", code="model_loading")
        if loop.state != "ready":
            raise APIError(503, f"the engine is {loop.state}: {loop.error}", type="server_error",
                           code="engine_unavailable")
        return loop.engine

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def error_response(self, exc: APIError) -> JSONResponse:
        self.metrics.errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    # -- endpoints ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        loop = self.engine_loop
        if self.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if loop.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": loop.state}
        if loop.error:
            body["error"] = loop.error
        return JSONResponse(body, status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        text = self.metrics.render(self.engine_loop.stats)
        if self.cascade is not None:
            text += "\n".join(self.cascade.metrics_lines()) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as exc:
            return self.error_response(exc)
        card = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "lowbit"}
        engine = self.engine_loop.engine
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    # -- tokenizer endpoints (vLLM's shapes; lm-eval's remote tokenizer uses all three) ----------
    async def tokenize(self, request: Request) -> Response:
        try:
            self.authorize(request)
            engine = self.require_ready()
            body = protocol.parse_json_body(await self.read_body(request))
            self._check_model(body)
            req = protocol.parse_tokenize(body)
            ids = await asyncio.to_thread(_tokenize_only, engine.tokenizer, req)
        except APIError as exc:
            return self.error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        except LowbitError as exc:
            return self.error_response(bad_request(str(exc)))
        strs = [engine.tokenizer.backend.id_to_token(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        try:
            self.authorize(request)
            engine = self.require_ready()
            body = protocol.parse_json_body(await self.read_body(request))
            self._check_model(body)
            ids = protocol.parse_detokenize(body)
            bad = next((t for t in ids if not 0 <= t < _vocab_size(engine)), None)
            if bad is not None:
                raise bad_request(f"token id {protocol.show(bad)} is outside the vocabulary "
                                  f"[0, {_vocab_size(engine)})", "tokens")
            text = await asyncio.to_thread(engine.tokenizer.decode, ids)
        except APIError as exc:
            return self.error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> Response:
        try:
            self.authorize(request)
            engine = self.require_ready()
        except APIError as exc:
            return self.error_response(exc)
        tok = engine.tokenizer
        info: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": engine.max_model_len,
                                "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[key] = tok.special_tokens.get(key)  # present even when None: clients test for the key
        return JSONResponse(info)

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"model {protocol.show(model)} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        try:
            self.authorize(request)
            engine = self.require_ready()
            body = protocol.parse_json_body(await self.read_body(request))
            req = protocol.parse_chat(body) if chat else protocol.parse_completion(body)
            if req.model is not None and req.model != self.config.model_name:
                raise APIError(404, f"model {protocol.show(req.model)} does not exist; this server serves "
                                    f"{self.config.model_name!r}", param="model", code="model_not_found")
            prompts = await asyncio.to_thread(_tokenize, engine.tokenizer, req)
            protocol.check_logit_bias(req, _vocab_size(engine))
            # One engine sequence per choice (best_of of them per prompt); a prompt's first sequence
            # computes its logprobs when asked (the others would only repeat them) and the others
            # wait for its prefill, then reuse its prompt blocks from the prefix cache. Sequence i
            # of a prompt has seed + i (every prompt the same seeds, as separate requests would).
            params = []
            for p, prompt in enumerate(prompts):
                name = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
                _check_token_ids(prompt.ids, _vocab_size(engine), name)
                max_tokens = _max_tokens(req, prompt, engine.max_model_len, name)
                params += [req.sampling_params(max_tokens, seed_offset=i, prompt_logprobs=i == 0 and req.wants_prompt_logprobs)
                           for i in range(req.best_of)]
            if self.metrics.in_flight >= self.config.max_in_flight:
                raise APIError(429, f"the server is at its limit of {self.config.max_in_flight} requests "
                                    f"(--max-running + --max-queue); retry later", type="rate_limit_error",
                               code="queue_full")
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            per = req.best_of
            if len(params) == 1:
                engine_ids = [request_id]
            elif len(prompts) == 1:
                engine_ids = [f"{request_id}-{i}" for i in range(per)]
            else:
                engine_ids = [f"{request_id}-{p}-{i}" for p in range(len(prompts)) for i in range(per)]
            # sequence i shares prompt i // per with the prompt's first sequence, engine_ids[i - i % per]
            prompt_ids = [prompts[i // per].ids for i in range(len(engine_ids))]
            share_with = [engine_ids[i - i % per] if i % per else None for i in range(len(engine_ids))]
            if self.cascade is not None and req.max_tokens != 0:
                return await self._cascaded(request, req, prompts, request_id, engine_ids, prompt_ids, params,
                                            share_with)
            tracker = Tracker(self, request_id, asyncio.get_running_loop(), engine_ids)
            self._submit(tracker, prompt_ids, params, share_with)
            self.metrics.in_flight += 1
        except APIError as exc:
            return self.error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        except EngineFailure as exc:
            return self.error_response(APIError(503, str(exc), type="server_error", code="engine_unavailable"))
        except LowbitError as exc:  # a chat template that refuses the messages, for one
            return self.error_response(bad_request(str(exc)))

        return await self._answer(request, req, tracker, engine.tokenizer, prompts, None)

    def _submit(self, tracker: Tracker, prompt_ids: list[list[int]], params: list, share_with: list) -> None:
        for engine_id, ids, sampling, share in zip(tracker.engine_ids, prompt_ids, params, share_with):
            self.engine_loop.submit(engine_id, ids, sampling, tracker.stream, share_prefix_with=share)

    async def _answer(self, request: Request, req: GenerationRequest, tracker: Tracker, tokenizer,
                      prompts: list[Prompt], route: CascadeRoute | None) -> Response:
        answer = Answer(self, req, tracker, tokenizer, prompts, route)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **answer.headers()}
            return SSEResponse(answer.events(), tracker, media_type="text/event-stream", headers=headers)
        return await answer.whole(request)

    async def _cascaded(self, request: Request, req: GenerationRequest, prompts: list[Prompt], request_id: str,
                        engine_ids: list[str], prompt_ids: list[list[int]], params: list, share_with: list) -> Response:
        """--cascade: the cheap model answers the whole request first; the answer stands when its
        confidence clears the threshold, else the full model answers (query_cascade.py). Time to
        first token counts from the arrival, so the cheap run is part of it."""
        arrival = time.perf_counter()
        self.metrics.in_flight += 1
        try:
            outs, confidence = await self.cascade.try_cheap(request, engine_ids, prompt_ids, params, share_with)
        except APIError as exc:
            self.metrics.in_flight -= 1
            return self.error_response(exc)
        except ClientDisconnect:
            self.metrics.in_flight -= 1
            return Response(status_code=499)
        route = self.cascade.decide(confidence)
        cheap = route.answered_by == "cheap"
        tracker = Tracker(self, request_id, asyncio.get_running_loop(), engine_ids)
        tracker.arrival = arrival
        if cheap:
            for out in outs:  # finished already: the answer reads them as if they were arriving
                tracker.stream.queue.put_nowait(out)
        else:
            try:
                self._submit(tracker, prompt_ids, params, share_with)
            except EngineFailure as exc:
                tracker.close()
                return self.error_response(APIError(503, str(exc), type="server_error", code="engine_unavailable"))
        return await self._answer(request, req, tracker, self.engine_loop.engine.tokenizer, prompts, route)


def _tokenize(tokenizer, req: GenerationRequest) -> list[Prompt]:
    if req.chat:
        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - messages are client data: a template that trips on a
            # field of a type it did not expect (or raise_exception) is the request's fault, not a 500
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise bad_request(f"the chat template cannot render these messages: {reason}", "messages") from None
        # The template writes any BOS itself (as transformers' apply_chat_template(tokenize=True)).
        return [Prompt(tokenizer.encode(text, add_bos=False), text)]
    prompts = []
    for i, p in enumerate(req.prompts):
        if not isinstance(p, str):
            prompts.append(Prompt(list(p), None))
            continue
        ids = tokenizer.encode(p)
        if not ids:
            where = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            raise bad_request(f"{where} encodes to no tokens", "prompt")
        prompts.append(Prompt(ids, p))
    return prompts


def _max_tokens(req: GenerationRequest, prompt: Prompt, max_model_len: int, name: str) -> int:
    """The prompt's max_tokens: as asked, else the default (completions) or the rest of the context
    (chat); 400 when the prompt and it do not fit the context."""
    room = max_model_len - len(prompt.ids)
    if req.max_tokens is None:
        max_tokens = min(protocol.DEFAULT_COMPLETION_MAX_TOKENS if not req.chat else room, room)
    else:
        max_tokens = req.max_tokens
    # max_tokens 0 still runs one sampled token in the engine (then dropped): it needs the room
    if room < 1 or max(max_tokens, 1) > room:
        raise bad_request(f"the {name} has {len(prompt.ids)} tokens and max_tokens is {max_tokens}, "
                          f"more than the context of {max_model_len} tokens allows",
                          "max_tokens" if room >= 1 else ("messages" if req.chat else "prompt"),
                          "context_length_exceeded")
    return max_tokens


def _tokenize_only(tokenizer, req: protocol.TokenizeRequest) -> list[int]:
    if req.messages is not None:
        try:
            text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
        except LowbitError:
            raise
        except Exception as exc:  # noqa: BLE001 - client data tripping the template: a 400, as in generate
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise bad_request(f"the chat template cannot render these messages: {reason}", "messages") from None
        return tokenizer.encode(text, add_bos=req.add_special_tokens and tokenizer.add_bos)
    # add_special_tokens: the tokenizer's own BOS rule (as /v1/completions tokenizes); false: none
    return tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)


def _vocab_size(engine) -> int:
    size = getattr(getattr(engine, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else engine.tokenizer.vocab_size


def _check_token_ids(ids: list[int], vocab_size: int, name: str = "prompt") -> None:
    if not ids:
        raise bad_request(f"the {name} is empty", "prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        where = "" if name == "prompt" else f" in {name}"
        raise bad_request(f"token id {protocol.show(bad)}{where} is outside the vocabulary [0, {vocab_size})", "prompt")


def create_app(config: ServerConfig, engine_loop: EngineLoop, cascade: QueryCascade | None = None) -> Starlette:
    server = Server(config, engine_loop, cascade)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        where = f"{request.method} {request.url.path}"
        where = where if len(where) <= 100 else where[:97] + "..."  # a fuzzer's 10 kB path stays out of logs
        return server.error_response(APIError(exc.status_code, f"{where}: {exc.detail}", code=code))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start()  # loads the model in the background: the socket binds meanwhile
        try:
            yield
        finally:
            server.stopping = True
            await asyncio.to_thread(engine_loop.stop)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    # No 307 from /v1/completions/ to /v1/completions: its Location is built from the client's Host
    # header and its body is empty; a JSON 404 is the one error shape.
    app.router.redirect_slashes = False
    app.state.server = server
    return app


@dataclass(slots=True, frozen=True)
class Stopped:
    """How serve() ended: by SIGINT (Ctrl-C; the CLI exits 130) or SIGTERM, and whether the model
    was still loading then (its thread is inside torch: the interpreter's shutdown around it aborts
    the process, std::terminate, so the CLI leaves without waiting for it)."""

    interrupted: bool
    loading: bool


def serve(config: ServerConfig, build_engine, build_cheap_engine=None, cascade_threshold: float = 0.0,
          cheap_name: str = "") -> Stopped:
    """Bind, load the model in the background, serve until SIGTERM/SIGINT; graceful shutdown.
    build_cheap_engine: --cascade's cheap model (query_cascade.py), loaded beside the model.

    Raises LowbitError if a model fails to load (after the server has stopped)."""
    import uvicorn

    holder: dict[str, uvicorn.Server] = {}

    def stop_on_load_failure() -> None:
        holder["server"].should_exit = True

    # --cascade's cheap model is a second engine of the same loop (engine_loop.py says why one thread)
    others = {CHEAP: (build_cheap_engine, f"the cheap model ({cheap_name})")} if build_cheap_engine else None
    engine_loop = EngineLoop(build_engine, on_load_failure=stop_on_load_failure, others=others)
    cascade = QueryCascade(engine_loop, cascade_threshold) if build_cheap_engine else None
    app = create_app(config, engine_loop, cascade)

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.server.begin_drain()
            await super().shutdown(sockets)

    # uvicorn's own deadline is a backstop past ours: it cancels the handlers, cutting connections.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="info", access_log=False,
                               timeout_graceful_shutdown=config.shutdown_timeout + _DRAIN_GRACE_S, lifespan="on",
                               http=_json_h11_protocol(), ws="none", log_config=None)
    server = DrainingServer(uv_config)
    holder["server"] = server
    _configure_logging()
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; quiet handlers
    # turn that into a normal return, so a clean shutdown exits 0 (SIGTERM) or 130 (SIGINT). With
    # Python's own SIGINT handler in place, asyncio's runner had raised KeyboardInterrupt into the
    # still-open lifespan, and uvicorn logged that traceback on every Ctrl-C.
    interrupted: list[int] = []

    def on_signal(signum, frame) -> None:
        # before uvicorn installs its own handlers (and when it re-raises): stop the server too
        interrupted.append(signum)
        server.handle_exit(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
        # uvicorn logged the reason (and exits 1 or 3) when it cannot bind
        raise LowbitError(f"could not listen on {config.host}:{config.port} (see the error above)") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if engine_loop.failed_during_load:
        error = engine_loop.error
        raise LowbitError(f"could not load {error}" if error.startswith("the cheap model") else
                          f"could not load the model: {error}")
    loading = engine_loop.loading()
    if loading:
        log.info("stopped while the model was loading")
    return Stopped(signal.SIGINT in interrupted, loading)


def _json_h11_protocol():
    """uvicorn's h11 protocol, but a request h11 cannot parse (bad request line, 16 kB of headers,
    a malformed Content-Length) is answered with OpenAI's JSON error object rather than plain text,
    so clients see one error shape whatever was wrong."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps(bad_request("the request is not valid HTTP/1.1 (request line, headers or framing)",
                                  code="invalid_http").body()).encode()

    class JsonH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # the app answered already: hang up
                self.transport.close()
                return
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JsonH11Protocol


def _configure_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("lowbit.serve", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
