"""Runs one flattened batch of (sequence chunk) work items through a model over the paged cache.

A work item is (block_table, start, token_ids, num_logits): compute token_ids at positions
start.. (writing their KV through the block table) and return the logits of its last
`num_logits` tokens (0: a prefill chunk that samples nothing, 1: a normal sample, 1 + k: a
speculative verify). All items go through the model as one sequence [1, T]; the paged cache's
attention keeps them apart. The lm_head runs only on the rows whose logits are wanted.

Prompt log-probs: a prefill chunk may also name `prompt_targets`, the prompt tokens its first
rows predict (row i predicts token start + i + 1). For those rows the runner returns, per row,
the target's log-probability, its rank and the `prompt_top` most likely tokens, computed slice by
slice (`PROMPT_ROWS` rows of logits at a time) in the same forward, so a long prompt never holds
[T, V] logits. The log-softmax is float64 over the float32 logits, as `lowbit eval` scores tokens
(runtime/evaluate.py), so the two agree to the forward's own rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.runtime.engine import decode_chain
from lowbit.runtime.engine.paged_attention import build_metadata, decode_steps_metadata
from lowbit.runtime.engine.paged_cache import PagedKVCache

PROMPT_ROWS = 64  # rows of [rows, V] logits alive at once while scoring a prompt
CHAIN_ENV = "LOWBIT_NO_CHAIN"  # any value: decode steps go layer by layer through Python (for comparisons)


def chain_enabled() -> bool:
    return not os.environ.get(CHAIN_ENV)


@dataclass(slots=True)
class Work:
    block_table: list[int]
    start: int
    token_ids: list[int]
    num_logits: int
    prompt_targets: list[int] | None = None  # tokens start+1 .. predicted by the first rows
    prompt_top: int = 0  # most likely alternatives returned per prompt row


@dataclass(slots=True)
class PromptLogprob:
    """One prompt token's log-probability under the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the prompt_top most likely (token id, logprob), most likely first


@dataclass(slots=True)
class RunOutput:
    logits: torch.Tensor | None  # [sum of num_logits, V] in work order
    prompt_logprobs: list[list[PromptLogprob] | None]  # per work: one entry per prompt target
    # forward(argmax=True) where the head's int8 copy decided them: each logit row's greedy token
    # [sum of num_logits], and logits None
    tokens: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.softcap = model.config.final_logit_softcapping
        self.num_forwards = 0
        # steps of short items through all decoder layers in one C call, where the model allows
        self.chained = decode_chain.build(model, cache) if chain_enabled() else None

    def run(self, works: list[Work]) -> torch.Tensor | None:
        """Logits [sum of num_logits, V] in work order (None when no item wants logits)."""
        return self.forward(works).logits

    @torch.inference_mode()
    def forward(self, works: list[Work], argmax: bool = False) -> RunOutput:
        """One step's forward: every item of the step in one flattened batch. argmax: the caller
        wants only each logit row's greedy token, which then comes through the head's int8 copy where
        the model has one (RunOutput.tokens, the same tokens; else the logits as usual). On the CPU (bf16 or
        float32 KV) every item, prefill chunks included, attends through the fused kernel and the
        step takes the one-call chain where the model has one (paged_attention.build_metadata);
        each item reads and writes only its own sequence's KV, and each row gets the numbers it
        would get alone. (Mixed steps used to run as two forwards, short items chained and prefill
        chunks layer by layer; the chain exists only with the fused attention, which now takes the
        chunks too, so one forward serves.)"""
        self.num_forwards += 1
        return self._forward(works, argmax)

    def _forward(self, works: list[Work], argmax: bool) -> RunOutput:
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        prompt_rows: list[tuple[int, int]] = []  # (first row in the flat batch, number of targets) per work
        plan = []
        max_position = 0
        for w in works:
            n = len(w.token_ids)
            row = len(ids)
            ids += w.token_ids
            positions += range(w.start, w.start + n)
            if w.num_logits:
                rows += range(row + n - w.num_logits, row + n)
            targets = len(w.prompt_targets) if w.prompt_targets else 0
            if targets > n:
                raise ValueError(f"{targets} prompt targets for a chunk of {n} tokens")
            prompt_rows.append((row, targets))
            plan.append((w.block_table, w.start, n))
            max_position = max(max_position, w.start + n - 1)
        cache = self.cache
        cache.meta = build_metadata(plan, cache.block_size, self.device, with_block_tables=self.device.type == "cuda",
                                    fused_decode=cache.fused_decode)
        try:
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            if self.chained is not None and self.chained.usable(cache.meta):
                h = self.chained.forward(ids, pos, max_position, cache.meta)
            else:
                input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
                h = self.model.model(input_ids, pos, max_position, cache)[0]
        finally:
            cache.meta = None
        prompt = [self._prompt_logprobs(h[row : row + count], w.prompt_targets, w.prompt_top) if count else None
                  for w, (row, count) in zip(works, prompt_rows)]
        if not rows:
            return RunOutput(None, prompt)
        if len(rows) != h.shape[0]:
            h = h[torch.tensor(rows, device=self.device)]
        if argmax and self.chained is not None and self.chained.ready():
            tokens = self.chained.screened_argmax(h)
            if tokens is not None:
                return RunOutput(None, prompt, tokens)
        return RunOutput(self._logits(h), prompt)

    def steps_head(self, rows: int):
        """The lm_head as the one-call step runs it after the layers, where greedy decode steps of
        `rows` rows can run several at a time in C (`decode_steps`); None where they cannot."""
        chained = self.chained
        if chained is None or not chained.ready() or not chained.fits(rows) or not chained.embeds_itself():
            return None
        return chained.head()

    @torch.inference_mode()
    def decode_steps(self, works: list[Work], steps: int, head) -> tuple[list[list[int]], int]:
        """`steps` greedy decode steps of single-token works in one C call (native/decode_layers.c
        lowbit_decode_steps): each work's token at its start, then the token each step chose, with
        the KV slots of every step already in its block table; per work the chosen tokens, and how
        many steps had finite logits (fewer than `steps`: NaN or inf logits). The tokens are the
        ones `steps` calls of `forward` and the greedy argmax would give (the same kernels in the
        same order)."""
        self.num_forwards += steps
        meta, positions, slots = decode_steps_metadata([(w.block_table, w.start) for w in works], steps,
                                                       self.cache.block_size)
        tokens, done = self.chained.decode_steps([w.token_ids[0] for w in works], steps, positions, slots, meta, head)
        return tokens[:done].t().tolist(), done

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # float32 logits (exact for bf16 ones): torch's CPU argmax/softmax over bf16 is much slower
        logits = self.model.lm_head(h).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _prompt_logprobs(self, h: torch.Tensor, targets: list[int], top: int) -> list[PromptLogprob]:
        out: list[PromptLogprob] = []
        for lo in range(0, len(targets), PROMPT_ROWS):
            hi = min(lo + PROMPT_ROWS, len(targets))
            logp = self._logits(h[lo:hi]).double().log_softmax(dim=-1)
            tgt = torch.tensor(targets[lo:hi], device=logp.device)
            chosen = logp.gather(1, tgt[:, None])
            if not bool(torch.isfinite(chosen).all()):
                raise LowbitError("the model's prompt log-probabilities are NaN or inf (corrupt weights, or "
                                  "activations that overflow)")
            # rank: 1 + the tokens strictly more likely (ties share the better rank, as vLLM counts)
            ranks = (logp > chosen).sum(dim=-1) + 1
            if top:
                top_vals, top_ids = logp.topk(top, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, (token, lp, rank) in enumerate(zip(targets[lo:hi], chosen[:, 0].tolist(), ranks.tolist())):
                alternatives = list(zip(top_ids[j], top_vals[j])) if top else []
                out.append(PromptLogprob(token, lp, rank, alternatives))
        return out
