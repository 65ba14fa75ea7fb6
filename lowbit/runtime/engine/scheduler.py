"""Continuous batching: which sequences run in the next model step, and how many tokens each.

Every step is one mixed batch under a token budget (`max_num_batched_tokens`):
  1. decodes of running sequences (one token each), oldest first;
  2. the next prefill chunk of running sequences still prefilling, oldest first, under the
     smaller `max_prefill_tokens` (or 16 per decode in the step, if more) when any other
     sequence runs or waits (prompts then go through
     one after another, so the first answers after its own prefill, not after everyone's, and
     the running decodes are not stalled for all of them; a lone prompt takes the whole budget);
  3. new or preempted sequences from the waiting queue, strictly first come first served (the
     head of the queue blocks those behind it), while there are blocks, budget and room under
     `max_num_seqs`.
A prompt longer than the remaining budget is prefilled in chunks over several steps; its blocks
are allocated in full when it is admitted, so a prefill never runs out of blocks midway.

Preemption by recompute: when a decode needs a new block and none is free, the most recently
arrived running sequence is preempted: its blocks are freed (its computed full blocks stay in
the prefix cache), it goes back to the FRONT of the waiting queue, and on readmission it is
prefilled again over prompt + generated tokens, mostly from the prefix cache if nothing evicted
them. No new sequence is admitted in a step that preempted.

Two engine hooks shape admission:
  - `needs_prompt_logits(seq)`: such a sequence skips the prefix-cache lookup, so every prompt
    token is computed and its log-prob can be read off the forward (its blocks are still
    registered for others);
  - `add(seq, share_prefix_with=parent)`: the sequences of one request with n > 1 share its
    prompt. A sibling waits (at the head it blocks the queue, as any head does) until the parent
    has finished its prefill and registered its blocks, then is admitted on prefix-cache hits,
    so the prompt's KV is computed once. The parent is always ahead of its siblings (added
    first; a preempted parent goes back to the front), so the wait always ends.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lowbit.errors import LowbitError, UsageError
from lowbit.runtime.engine.block_manager import BlockManager
from lowbit.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token to compute (= seq.num_computed_tokens)
    num_new_tokens: int  # tokens token_ids[start : start + num_new_tokens] run this step
    samples: bool  # the step reaches the sequence's last token, so its logits are sampled

    @classmethod
    def plan(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # aborted or out of room this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items


# With other work in the step, prompt tokens it may prefill per decode it runs (when that is more
# than max_prefill_tokens). guidellm, 64 streams, int4 SmolLM2 on 2 cores: a flat 128 cut output
# tok/s from 137 to 117, 8 per decode gave 125, 16 gave 133 (bf16 in float32: 72.5 and 72.8).
PREFILL_TOKENS_PER_DECODE = 16


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 eos_token_ids=(), max_model_len: int | None = None, max_prefill_tokens: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise UsageError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_num_batched_tokens if max_prefill_tokens is None else max_prefill_tokens
        if self.max_prefill_tokens < 1:
            raise UsageError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by request id
        # Engine hook for stop strings: called after each appended token, True finishes ("stop").
        self.stop_checker: Callable[[Sequence], bool] | None = None
        # Engine hook: True for a sequence whose prompt must be computed in full (prompt logprobs).
        self.needs_prompt_logits: Callable[[Sequence], bool] | None = None
        self._prefix_parent: dict[str, Sequence] = {}  # waiting sibling's request id -> its parent
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._aborts: set[str] = set()

    def add(self, seq: Sequence, share_prefix_with: str | None = None) -> None:
        """Queue seq; with share_prefix_with (the id of a queued or running request), seq is not
        admitted before that request's prefill is done, so it reuses its cached prompt blocks."""
        if seq.request_id in self.requests:
            raise UsageError(f"request id {seq.request_id!r} is already in use")
        # a parent already finished (or unknown) holds nothing back: its blocks are cached, if any
        parent = self.requests.get(share_prefix_with) if share_prefix_with is not None else None
        bm = self.block_manager
        if bm.blocks_needed(seq.num_tokens + 1) > bm.num_blocks:
            raise LowbitError(f"a prompt of {seq.num_tokens} tokens does not fit the KV cache "
                              f"({bm.num_blocks} blocks of {bm.block_size} tokens); give it more memory")
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        if parent is not None:
            self._prefix_parent[seq.request_id] = parent

    def abort(self, request_id: str) -> None:
        """Finish a request with reason "abort"; its blocks are freed at the next schedule()."""
        self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._apply_aborts(out)
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. decodes, oldest first; make room by preempting the newest.
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not bm.can_append(seq):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    self._finish(seq, "length")  # the whole pool cannot hold it
                    out.finished.append(seq)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.append_slot(seq)
            out.items.append(ScheduledSeq.plan(seq, 1))
            budget -= 1

        # 2. prefill chunks of running sequences that are still prefilling.
        if len(self.running) + len(self.waiting) > 1:
            # grows with the decodes riding along, so under heavy load prompts keep pace with the
            # streams that finish (64 decodes: 1024 tokens a step)
            budget = min(budget, max(self.max_prefill_tokens, PREFILL_TOKENS_PER_DECODE * len(out.items)))
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and budget > 0:
                n = min(remaining, budget)
                out.items.append(ScheduledSeq.plan(seq, n))
                budget -= n

        # 3. admissions, strictly FCFS.
        while (not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not self._held(self.waiting[0])
               and bm.can_allocate(self.waiting[0], self._use_prefix_cache(self.waiting[0]))):
            seq = self.waiting.popleft()
            bm.allocate(seq, self._use_prefix_cache(seq))  # sets num_computed_tokens to the cached prefix
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.items.append(ScheduledSeq.plan(seq, n))
            budget -= n

        # Nothing runs and the head cannot be admitted: it outgrew the whole pool while running.
        if not self.running and not out.items and not out.preempted and self.waiting and not self._held(self.waiting[0]):
            seq = self.waiting[0]
            self._finish(seq, "length")
            out.finished.append(seq)
        return out

    def postprocess(self, out: SchedulerOutput, token_ids: list[list[int]]) -> list[Sequence]:
        """Record a finished step: token_ids[i] are the tokens emitted for out.items[i] (empty
        for a prefill chunk that did not reach the end, one token for a normal sample, the
        accepted drafts + one for a speculative verify). Returns the sequences that finished;
        their blocks are already freed.

        The KV of every emitted token except the last is in the cache afterwards, so a verify
        step that ran the last token + k drafts (item.num_new_tokens = 1 + k) and accepted a of
        them leaves num_computed_tokens = start + 1 + a; rejected drafts' KV is ignored.
        """
        if len(token_ids) != len(out.items):
            raise ValueError(f"{len(token_ids)} token lists for {len(out.items)} scheduled sequences")
        finished = []
        for item, new_tokens in zip(out.items, token_ids):
            seq = item.seq
            if item.samples != bool(new_tokens):
                raise ValueError(f"{seq.request_id}: expected {'a' if item.samples else 'no'} sampled token")
            reason = None
            for token in new_tokens:
                seq.append_token(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    break  # tokens after a stop are dropped
            seq.num_computed_tokens = min(item.start + item.num_new_tokens, seq.num_tokens - 1)
            self.block_manager.register_computed(seq)  # before _finish frees: keep them cached
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # -- internals ----------------------------------------------------------------------------
    def _use_prefix_cache(self, seq: Sequence) -> bool:
        return self.needs_prompt_logits is None or not self.needs_prompt_logits(seq)

    def _held(self, seq: Sequence) -> bool:
        """A sibling whose parent has not finished its prefill yet (see the module docstring)."""
        parent = self._prefix_parent.get(seq.request_id)
        if parent is None:
            return False
        if parent.is_finished or parent.num_output_tokens > 0:  # prefill done: its full blocks are cached
            del self._prefix_parent[seq.request_id]
            return False
        return True

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if self.stop_checker is not None and self.stop_checker(seq):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.requests.pop(seq.request_id, None)
        self._prefix_parent.pop(seq.request_id, None)

    def _apply_aborts(self, out: SchedulerOutput) -> None:
        for request_id in self._aborts:
            seq = self.requests.get(request_id)
            if seq is not None:
                self._finish(seq, "abort")
                out.finished.append(seq)
        self._aborts.clear()
