"""The one thread that owns the Engine: it loads the model, then steps while there is work.

It may own more engines (serve --cascade's cheap model, by name): they are loaded and stepped by
the same thread, in turn, because OpenMP work started from a second thread gives the process two
thread pools, and libgomp then throttles its spin-waits (more pool threads than CPUs), which made
every decode step two to three times slower on a 2-core machine (docs/serve.md, "Query cascade").

The HTTP side never calls the engine. It sends commands (add, abort, stop) through a
thread-safe queue, and each request's outputs come back on that request's own asyncio queue,
all of one step's in a single `loop.call_soon_threadsafe` (one wake-up of the event loop per
step, not one per request), so the event loop is never blocked by a model step and the engine
is only ever touched from one thread. Commands are drained between steps, which is what makes a
disconnect cancel its request "at the next step".

States: loading -> ready -> stopped, or -> failed (load error or a crashed step; every open
request then gets an EngineFailure and /health answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowbit.errors import LowbitError
from lowbit.runtime.process_memory import resident_bytes

log = logging.getLogger("lowbit.serve")


class EngineFailure(Exception):
    """Delivered to a request's stream when the engine cannot serve it (crash or shutdown)."""


class EngineStopping(EngineFailure):
    """Delivered to the requests still open when the server stops (the drain after SIGTERM ran out)."""


class RequestRejected(Exception):
    """Delivered when add_request refused the request (a bad value the server could not pre-check)."""


class RequestStream:
    """A request's outbox on the event loop: the engine thread puts, the handler awaits get()."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _deliver(deliveries: list[tuple[RequestStream, Any]]) -> None:
    """Hand one step's outputs to their streams with one wake-up per event loop (there is one)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, out in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


MAIN = "model"  # the served model's engine; other engines have names of their own


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: Any
    stream: RequestStream
    share_prefix_with: str | None = None
    engine: str = MAIN


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _EndAll:
    message: str


class _Stop:
    pass


class EngineLoop:
    def __init__(self, build_engine: Callable[[], Any], on_load_failure: Callable[[], None] | None = None,
                 others: dict[str, tuple[Callable[[], Any], str]] | None = None):
        """others: {name: (builder, what it is, for errors)} engines loaded after the model's."""
        self._builders = {MAIN: (build_engine, "the model"), **(others or {})}
        self._on_load_failure = on_load_failure
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders state changes against submissions
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._owner: dict[str, Any] = {}  # request id -> the engine running it (engine thread only)
        self._thread = threading.Thread(target=self._run, name="lowbit-engine", daemon=True)
        self.state = "loading"
        self.error: str | None = None
        self.failed_during_load = False
        self.engine = None  # read-only facts for the server (tokenizer, max_model_len) once ready
        self.engines: dict[str, Any] = {}  # every engine by name, MAIN's first, once ready
        self.stats = None  # the latest Engine.stats() of MAIN's engine, replaced (never mutated) after each step

    # -- called from the server -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params, stream: RequestStream,
               share_prefix_with: str | None = None, engine: str = MAIN) -> None:
        """share_prefix_with: an earlier request id with the same prompt (the choices of n > 1);
        engine: which engine runs it (MAIN, or a name given in `others`)."""
        with self._lock:
            if self.state != "ready":
                raise EngineFailure(f"the engine is {self.state}")
            self._commands.put(_Add(request_id, prompt_ids, params, stream, share_prefix_with, engine))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def end_all(self, message: str) -> None:
        """Abort every open request at the next step; each stream gets EngineStopping(message)."""
        self._commands.put(_EndAll(message))

    def loading(self) -> bool:
        """Whether the engine thread is still loading the model (inside torch: not interruptible)."""
        return self._thread.is_alive() and self.state == "loading"

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, end the thread and wait for it (bounded)."""
        self._commands.put(_Stop())
        # A model still loading is not waited for: the thread is a daemon and dies with the process.
        if self._thread.is_alive() and self.state != "loading":
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engines = {}
        began = time.perf_counter()
        for name, (build, what) in self._builders.items():
            try:
                engines[name] = build()
            except BaseException as exc:  # noqa: BLE001 - any load failure must reach /health and the CLI
                log.error("could not load %s: %s", what, _one_line(exc))
                self.failed_during_load = True
                self._fail(exc, what if name != MAIN else None)
                if self._on_load_failure is not None:
                    self._on_load_failure()
                return
        self.engines = engines
        self.engine = engines[MAIN]
        self.stats = self.engine.stats()
        with self._lock:
            self.state = "ready"
        resident, _ = resident_bytes()
        held = f", {resident / 2**20:.0f} MiB resident (the KV cache counts as its blocks are written)" if resident else ""
        loaded = "model loaded" if len(engines) == 1 else f"{len(engines)} models loaded"
        log.info(f"{loaded} in {time.perf_counter() - began:.1f} s{held}; ready")
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a crashed step must not kill the server silently
            log.error("the engine failed: %s\n%s", _one_line(exc), traceback.format_exc())
            self._fail(exc)

    def _serve(self) -> None:
        while True:
            busy = any(engine.has_unfinished_requests() for engine in self.engines.values())
            commands = []
            try:
                # Idle: sleep until a command arrives. Busy: take whatever is queued, then step.
                commands.append(self._commands.get(block=not busy))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if isinstance(command, _Stop):
                    self._shutdown()
                    return
                self._apply(command)
            for engine in self.engines.values():  # in turn: one step each that has work
                if engine.has_unfinished_requests():
                    self._step(engine)
            self.stats = self.engine.stats()

    def _step(self, engine) -> None:
        deliveries = []
        for out in engine.step():
            stream = self._streams.get(out.request_id)
            if stream is not None:
                deliveries.append((stream, out))
                if out.finished:
                    del self._streams[out.request_id]
                    del self._owner[out.request_id]
        _deliver(deliveries)

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            engine = self.engines[command.engine]
            try:
                engine.add_request(command.request_id, command.prompt_ids, command.params,
                                   share_prefix_with=command.share_prefix_with)
            except LowbitError as exc:  # UsageError included: the request's fault, not the engine's
                command.stream.put(RequestRejected(_one_line(exc)))
                return
            self._streams[command.request_id] = command.stream
            self._owner[command.request_id] = engine
        elif isinstance(command, _Abort):
            # Only requests still running: aborting a finished id would be an unknown-id error.
            if self._streams.pop(command.request_id, None) is not None:
                self._owner.pop(command.request_id).abort_request(command.request_id)
        elif isinstance(command, _EndAll):
            self._end_all(command.message)

    def _end_all(self, message: str) -> None:
        for request_id, stream in self._streams.items():
            self._owner[request_id].abort_request(request_id)  # blocks freed at the next step
            stream.put(EngineStopping(message))
        self._streams.clear()
        self._owner.clear()

    def _shutdown(self) -> None:
        self._end_all("the server is shutting down")
        with self._lock:
            self.state = "stopped"

    def _fail(self, exc: BaseException, what: str | None = None) -> None:
        """what: the engine that failed to load when it is not the model's (named in the error)."""
        with self._lock:
            self.state = "failed"
            self.error = _one_line(exc) if what is None else f"{what}: {_one_line(exc)}"
            failure = EngineFailure(f"the engine failed: {self.error}")
            for stream in self._streams.values():
                stream.put(failure)
            self._streams.clear()
            while True:  # requests submitted but never added
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    command.stream.put(failure)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, LowbitError) else f"{type(exc).__name__}: {text}" if text else type(exc).__name__

