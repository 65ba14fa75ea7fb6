"""A model-free engine with the real Engine's API, for server tests that must not depend on the
model runner (and to run them before it exists): FCFS batches of max_num_seqs, one token per
running request per step, KV blocks counted per token, stop strings, logprobs, aborts.

The "model" is a fixed rule: the next token is a hash of the last three tokens, so greedy text
depends only on the request, never on the batch, exactly as a correct engine's would.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from lowbit.errors import UsageError
from lowbit.runtime.tokenizer import load_tokenizer


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0


@dataclass(slots=True)
class _Req:
    request_id: str
    prompt: list[int]
    params: object
    out: list[int] = field(default_factory=list)
    text: str = ""  # text already sent
    rng: random.Random | None = None


class FakeEngine:
    BLOCK = 16

    def __init__(self, model, *, max_num_seqs=64, max_model_len=None, num_blocks=512, step_delay=0.002, **_):
        self.tokenizer = load_tokenizer(model)
        self.config = SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
        self.max_model_len = max_model_len or 256
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._aborts: set[str] = set()
        self._stats = EngineStats(kv_blocks_total=num_blocks)

    def add_request(self, request_id, prompt_ids, params) -> None:
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise UsageError(f"prompt + max_tokens exceed max_model_len {self.max_model_len}")
        rng = random.Random(params.seed) if params.seed is not None else random.Random()
        self.waiting.append(_Req(request_id, list(prompt_ids), params, rng=rng))

    def abort_request(self, request_id) -> None:
        self._aborts.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def stats(self) -> EngineStats:
        s = self._stats
        used = sum(math.ceil((len(r.prompt) + len(r.out)) / self.BLOCK) for r in self.running)
        return EngineStats(len(self.running), len(self.waiting), used / self.num_blocks, used, self.num_blocks,
                           s.prefix_cache_queries, 0, s.prompt_tokens_total, s.generation_tokens_total)

    def _next(self, r: _Req) -> tuple[int, float, list[tuple[int, float]]]:
        V = self.config.vocab_size
        ids = r.prompt + r.out
        scores = [((ids[-1] * 131 + ids[-2 if len(ids) > 1 else -1] * 31 + t * 17) % 97) / 10 for t in range(V)]
        m = max(scores)
        lse = m + math.log(sum(math.exp(s - m) for s in scores))
        lps = [s - lse for s in scores]
        order = sorted(range(V), key=lambda t: (-lps[t], t))
        if r.params.temperature == 0:
            tok = order[0]
        else:
            tok = r.rng.choices(range(V), weights=[math.exp(lp / r.params.temperature) for lp in lps])[0]
        n = r.params.logprobs or 0
        return tok, lps[tok], [(t, lps[t]) for t in order[:n]]

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        outs = []
        for rid in self._aborts:
            for pool in (self.waiting, self.running):
                for r in [r for r in pool if r.request_id == rid]:
                    pool.remove(r)
                    outs.append(RequestOutput(rid, [], "", True, "abort", None, len(r.prompt), len(r.out), 0))
        self._aborts.clear()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            self.running.append(r)
            self._stats.prompt_tokens_total += len(r.prompt)
            self._stats.prefix_cache_queries += len(r.prompt)
        for r in list(self.running):
            tok, lp, top = self._next(r)
            r.out.append(tok)
            self._stats.generation_tokens_total += 1
            p = r.params
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_ids):
                reason = "stop"
            text = self.tokenizer.decode([t for t in r.out if t not in self.tokenizer.eos_ids])
            for s in p.stop:
                if s in text:
                    text, reason = text[: text.index(s)], "stop"
            if reason is None and (len(r.out) >= p.max_tokens or len(r.prompt) + len(r.out) >= self.max_model_len):
                reason = "length"
            delta, r.text = text[len(r.text):], text
            logprobs = [(lp, top)] if p.logprobs is not None else None
            outs.append(RequestOutput(r.request_id, [tok], delta, reason is not None, reason, logprobs,
                                      len(r.prompt), len(r.out), 0))
            if reason is not None:
                self.running.remove(r)
        return outs
