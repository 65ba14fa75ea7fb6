"""Query-level cascade for `lowbit serve --cascade CHEAP`: a request runs on the cheap model first,
and is run again on the full model when the cheap answer's mean confidence is not above the
threshold.

Confidence of an answer = the mean, over every token its sequences generated, of the probability
the cheap model gave the token it emitted (under greedy decoding that is its top-1 probability, the
token cascade's measure). The cheap run always asks the engine for the chosen token's logprob
(`logprobs=0`, nearly free: one log-softmax row per token); the answer shows logprobs only when the
client asked for them.

The cheap answer is held until it is complete, since it may be thrown away: a streamed request's
first token waits for the whole cheap answer (or, escalated, for the full model's first token).
Scoring requests (max_tokens 0: echo / prompt_logprobs only) are the full model's alone: a score is
a measurement of the served model, not an answer to cascade.

The cheap model is a second engine of the server's one EngineLoop (engine_loop.py: one thread for
all OpenMP work), stepped in turn with the model's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from lowbit.runtime.server.answer import DISCONNECTED, watch_disconnect
from lowbit.runtime.server.engine_loop import EngineFailure, EngineLoop, EngineStopping, RequestRejected, RequestStream
from lowbit.runtime.server.protocol import APIError, bad_request


@dataclass(slots=True)
class CascadeRoute:
    """Which model answered a request, and the cheap answer's confidence that decided it."""

    answered_by: str  # "cheap" | "full"
    cheap_confidence: float  # the cheap answer's mean token probability (rounded to 6 digits)

    def as_dict(self) -> dict:
        return {"answered_by": self.answered_by, "cheap_confidence": self.cheap_confidence}


CHEAP = "cheap"  # the cheap model's engine in the server's EngineLoop


class QueryCascade:
    """The threshold, the engine loop that holds the cheap model's engine, and the counts /metrics reports."""

    def __init__(self, loop: EngineLoop, threshold: float):
        self.loop = loop
        self.threshold = threshold
        self.answered = {"cheap": 0, "full": 0}
        self.escalations = 0

    async def try_cheap(self, request: Request, engine_ids: list[str], prompt_ids: list[list[int]], params: list,
                        share_with: list[str | None]) -> tuple[list, float]:
        """Run the request's sequences on the cheap model to the end: (all their outputs, in
        arrival order, and the answer's confidence). Raises APIError (rejected, engine down) or
        ClientDisconnect; whatever is still running then is aborted."""
        stream = RequestStream(asyncio.get_running_loop())
        open_ids = set(engine_ids)
        watcher = asyncio.ensure_future(watch_disconnect(request, stream))
        outs = []
        try:
            for engine_id, ids, sampling, share in zip(engine_ids, prompt_ids, params, share_with):
                chosen = sampling if sampling.logprobs is not None else dataclasses.replace(sampling, logprobs=0)
                self.loop.submit(engine_id, ids, chosen, stream, share_prefix_with=share, engine=CHEAP)
            while open_ids:
                item = await stream.queue.get()
                if item is DISCONNECTED:
                    raise ClientDisconnect()
                if isinstance(item, RequestRejected):
                    raise bad_request(str(item))
                if isinstance(item, EngineFailure):
                    open_ids.clear()  # the loop ended them already
                    code = "shutting_down" if isinstance(item, EngineStopping) else "engine_unavailable"
                    raise APIError(503, str(item), type="server_error", code=code)
                outs.append(item)
                if item.finished:
                    open_ids.discard(item.request_id)
        except EngineFailure as exc:  # submit() on a loop that is not ready
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        finally:
            watcher.cancel()
            for engine_id in open_ids:
                self.loop.abort(engine_id)
        return outs, answer_confidence(outs)

    def decide(self, confidence: float) -> CascadeRoute:
        """The cheap answer stands when its confidence is strictly above the threshold (so 1.0
        always escalates: the full model answers everything, as with the token cascade)."""
        cheap = confidence > self.threshold
        self.answered["cheap" if cheap else "full"] += 1
        self.escalations += not cheap
        return CascadeRoute("cheap" if cheap else "full", round(confidence, 6))

    def metrics_lines(self) -> list[str]:
        lines = ["# HELP lowbit_cascade_requests_total Requests answered, by the model that answered them "
                 "(--cascade; scoring requests go to the full model and are not counted).",
                 "# TYPE lowbit_cascade_requests_total counter"]
        lines += [f'lowbit_cascade_requests_total{{answered_by="{k}"}} {v}' for k, v in self.answered.items()]
        lines += ["# HELP lowbit_cascade_escalations_total Requests the cheap model answered with too little "
                  "confidence, run again on the full model.",
                  "# TYPE lowbit_cascade_escalations_total counter", f"lowbit_cascade_escalations_total {self.escalations}"]
        return lines


def answer_confidence(outs: list) -> float:
    """Mean probability of the emitted tokens over every sequence's generated tokens (1.0 for an
    answer with none, which cannot happen: the engine generates at least one)."""
    logprobs = [lp for out in outs if out.logprobs for lp, _ in out.logprobs]
    if not logprobs:
        return 1.0
    return sum(math.exp(lp) for lp in logprobs) / len(logprobs)
