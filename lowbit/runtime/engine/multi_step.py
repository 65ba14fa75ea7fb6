"""Greedy decode steps several at a time: when a step's sequences would only take their argmax
token between steps, the engine runs `steps` of them in one C call (native/decode_layers.c
lowbit_decode_steps) and appends each sequence's tokens as a speculative verify's accepted ones.

Why: on a CPU a decode step's Python (scheduling, metadata, sampling, bookkeeping) ran ~0.3 ms of
a ~3.4 ms SmolLM2 int4 token, its code and data cold after each token's weights streamed through
the caches; in C the steps follow each other with nothing between. The tokens are the single
steps' own (the same kernels, the same argmax), so nothing here may change an output: only plain
greedy rows (no logit processing, no log-probs, no guided grammar) take it, and tokens past a
stop are dropped by the scheduler as rejected drafts are.

A call of n steps delays what arrives meanwhile by up to n steps, so it is taken only while no
request waits, and its steps are as many as fit in CALL_BUDGET_S at the rows' last measured step
time (`StepClock`; the first decode step of a row count runs alone and is timed): SmolLM2 int4
takes 8 at one sequence (~3 ms a step), 3 at 16 (~12 ms). `LOWBIT_DECODE_STEPS` sets the most
steps a call (1: one at a time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lowbit.errors import UsageError
from lowbit.runtime.engine.sequence import SamplingParams, Sequence

STEPS_ENV = "LOWBIT_DECODE_STEPS"
DEFAULT_STEPS = 8  # SmolLM2 int4 at one sequence: the Python left per token ~0.04 ms at 8
CALL_BUDGET_S = 0.04  # the longest a call should keep a request that arrives meanwhile waiting


def steps_from_env() -> int:
    """The most steps one call may take (LOWBIT_DECODE_STEPS, default DEFAULT_STEPS)."""
    raw = os.environ.get(STEPS_ENV)
    if raw is None or raw == "":
        return DEFAULT_STEPS
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise UsageError(f"{STEPS_ENV} must be a whole number >= 1, got {raw!r}")
    return steps


def plain_greedy(params: SamplingParams) -> bool:
    """A row whose next token is its logits' argmax and nothing else is asked of the step."""
    return (params.greedy and not params.changes_logits and params.logprobs is None
            and params.guided_json is None)


def steps_for(seqs: list[Sequence], most: int, max_model_len: int) -> int:
    """How many steps every sequence can take before one of them must stop for its length
    (max_tokens, or the model's length: no token is computed past it)."""
    room = min(min(s.params.max_tokens - s.num_output_tokens, max_model_len - s.num_tokens) for s in seqs)
    return max(1, min(most, room))


@dataclass(slots=True)
class StepClock:
    """The last measured seconds of one decode step, by the step's row count."""

    seconds: dict[int, float] = field(default_factory=dict)

    def record(self, rows: int, steps: int, elapsed: float) -> None:
        self.seconds[rows] = elapsed / steps

    def steps_within(self, rows: int, most: int, budget: float = CALL_BUDGET_S) -> int:
        """The steps of `rows` rows that fit in `budget` (at most `most`); 1 while unmeasured."""
        per = self.seconds.get(rows)
        if per is None:
            return 1
        return max(1, min(most, int(budget / per))) if per > 0 else most
