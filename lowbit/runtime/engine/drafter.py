"""Draft sources for speculative decoding: n-gram prompt lookup, or a smaller / quantized model.

`propose(items, drafting)` returns, for each (seq, k) in `drafting`, up to k draft tokens and
the distribution each was drawn from ([n, V] probabilities, or None for a deterministic
drafter such as n-gram lookup, whose p_draft is one-hot).

A draft model keeps its own paged KV pool with the SAME block geometry as the target's and
writes through the target's block tables, so prefix-cache hits, preemption and freeing need no
bookkeeping of their own: whenever the target computes a token the draft computes it too (the
prefill items of each step are mirrored into the draft's first pass). `done[request]` counts
the positions the draft has computed; it can trail the target by one token after a fully
accepted draft (the last draft token is proposed, never fed back), and the next pass catches up.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine.model_runner import ModelRunner, Work
from lowbit.runtime.engine.paged_cache import PagedKVCache
from lowbit.runtime.engine.sampler import Sampler, process_logits
from lowbit.runtime.engine.speculative import ngram_propose


class NgramDrafter:
    kind = "ngram"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, items, drafting):
        return [(ngram_propose(seq.token_ids, k, self.max_ngram), None) for seq, k in drafting]

    def sync(self, seq) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def choose(logits: torch.Tensor, seqs) -> tuple[list[int], list[torch.Tensor | None]]:
    """Draw one token per row from the row's processed distribution; return the tokens and,
    for non-greedy rows, that distribution (what the rejection rule needs as p_draft)."""
    if all(s.params.greedy and not s.params.changes_logits for s in seqs):
        return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
    tokens, probs = [], []
    for row, seq in enumerate(seqs):
        # the target's knobs (bias, penalties) on the draft too: a closer draft is accepted more often
        x = process_logits(logits[row : row + 1], [seq.params], [seq.token_ids], [seq.output_token_ids])
        if seq.params.greedy:
            tokens.append(int(x.argmax()))
            probs.append(None)
            continue
        p = x.softmax(dim=-1)[0]
        q = torch.empty_like(p).exponential_(generator=Sampler.generator(seq, p.device))
        tokens.append(int((p / q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax()))
        probs.append(p)
    return tokens, probs


class ModelDrafter:
    kind = "model"

    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.runner = ModelRunner(model, cache)
        self.done: dict[str, int] = {}

    def propose(self, items, drafting):
        drafting_ids = {seq.request_id for seq, _ in drafting}
        works = []
        for item in items:  # mirror what the target computes this step
            seq = item.seq
            if seq.request_id in drafting_ids:
                continue
            end = item.start + item.num_new_tokens
            start = min(self.done.get(seq.request_id, item.start), item.start)
            works.append(Work(seq.block_table, start, seq.token_ids[start:end], 0))
            self.done[seq.request_id] = end
        for seq, _ in drafting:
            last = seq.num_tokens - 1
            start = min(self.done.get(seq.request_id, last), last)
            works.append(Work(seq.block_table, start, seq.token_ids[start:], 1))
        if not drafting:
            if works:
                self.runner.run(works)
            return []
        drafts = [[] for _ in drafting]
        probs = [[] for _ in drafting]
        active = list(range(len(drafting)))
        step = 0
        while active:
            logits = self.runner.run(works).float()  # the draft may run in bf16; its probabilities are float32
            tokens, dists = choose(logits, [drafting[i][0] for i in active])
            for i, t, p in zip(active, tokens, dists):
                drafts[i].append(t)
                probs[i].append(p)
            step += 1
            active = [i for i in active if drafting[i][1] > step]
            works = [Work(drafting[i][0].block_table, drafting[i][0].num_tokens - 1 + step, [drafts[i][-1]], 1)
                     for i in active]
        for (seq, k), d in zip(drafting, drafts):
            self.done[seq.request_id] = seq.num_tokens - 1 + len(d)
        out = []
        for d, p in zip(drafts, probs):
            out.append((d, None if p[0] is None else torch.stack(p)))
        return out

    def sync(self, seq) -> None:
        """After the target's verify: drafted positions past the accepted ones hold stale KV."""
        done = self.done.get(seq.request_id)
        if done is not None and done > seq.num_computed_tokens:
            self.done[seq.request_id] = seq.num_computed_tokens

    def forget(self, request_id: str) -> None:
        self.done.pop(request_id, None)


def parse_draft(draft: str | None) -> tuple[str, str | None]:
    """'ngram' -> ('ngram', None); 'self:int4' -> ('self', 'int4'); a path or name -> ('model', it)."""
    if draft is None:
        return "none", None
    if draft == "ngram":
        return "ngram", None
    if draft.startswith("self:"):
        fmt = draft[len("self:") :]
        if not fmt:
            raise UsageError("--draft self:FORMAT needs a format, e.g. self:int4")
        return "self", fmt
    return "model", draft
