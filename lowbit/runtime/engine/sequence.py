"""A request as the engine sees it: its tokens, its sampling knobs, and where its KV cache lives.

The prompt and the generated tokens are kept in ONE list (`token_ids`) because the model, the
prefix cache and recompute-after-preemption all treat them alike; `num_prompt_tokens` marks the
boundary. `num_computed_tokens` counts the tokens whose keys and values are in the cache, so the
work left for a sequence is always `token_ids[num_computed_tokens:]`: the rest of the prompt
while prefilling, the one freshly sampled token while decoding, everything after a preemption.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from lowbit.errors import UsageError

MAX_LOGPROBS = 20


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"  # done; see finish_reason ("stop", "length" or "abort")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling knobs; the defaults sample from the model's plain distribution.

    temperature 0 means greedy. top_k 0, top_p 1 and min_p 0 switch those filters off.
    logprobs=None returns none; logprobs=n returns the chosen token's and the n most likely.
    prompt_logprobs=n does the same for every prompt token after the first (None: none).
    logit_bias {token id: bias in [-100, 100]} is added to those logits; presence_penalty and
    frequency_penalty (in [-2, 2], OpenAI's) are over the GENERATED tokens only; min_tokens holds
    back EOS and stop_token_ids (and stop strings) until that many tokens were generated.
    guided_json: a JSON Schema (JSON text) the output must match; masks the logits per step
    (lowbit/runtime/engine/guided.py). See sampler.py for the order all of these are applied in.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    guided_json: str | None = None

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature}")
        # upper bounds: torch's int64 ops overflow on larger values, inside the engine's loop
        _check(_is_int(self.top_k) and 0 <= self.top_k < 2**31, f"top_k must be an integer in [0, 2**31) (0 = off), got {self.top_k}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed}")
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens < 2**31, f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(0 <= t < 2**31 for t in self.stop_token_ids), "stop token ids must be in [0, 2**31)")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self._check_logit_extras()

    def _check_logit_extras(self) -> None:
        # OpenAI's ranges; token ids are checked against the vocabulary by Engine.add_request
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias must be a mapping of token id -> bias")
            _check(all(_is_int(t) and 0 <= t < 2**31 for t in self.logit_bias),
                   "logit_bias keys must be token ids in [0, 2**31)")
            _check(all(_finite(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
                   "logit_bias values must be numbers in [-100, 100]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {value}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(self.guided_json is None or isinstance(self.guided_json, str),
               "guided_json must be a JSON Schema as JSON text")

    @property
    def changes_logits(self) -> bool:
        """True when something besides temperature and the filters changes the logits, so a greedy
        row cannot take the plain argmax."""
        return (self.repetition_penalty != 1.0 or self.logit_bias is not None or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.min_tokens > 0 or self.guided_json is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Sequence:
    """One request's state. The scheduler and the block manager mutate it; nobody else should."""

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "params", "status", "finish_reason",
        "block_table", "num_computed_tokens", "num_cached_tokens", "num_hashed_blocks",
        "arrival", "generator", "logprobs",
    )

    def __init__(self, request_id: str, prompt_token_ids, params: SamplingParams | None = None):
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise UsageError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.params = params if params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        # Tokens whose KV is in the cache (computed or found in the prefix cache).
        self.num_computed_tokens = 0
        # Of those, how many the prefix cache supplied at the last allocation.
        self.num_cached_tokens = 0
        # Leading blocks of block_table whose hash is known (full and computed).
        self.num_hashed_blocks = 0
        self.arrival = -1  # set by Scheduler.add; orders FCFS and picks preemption victims
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.logprobs: list = []  # one TokenLogprobs per generated token when requested

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
