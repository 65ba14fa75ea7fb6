"""Draft sources for speculative decoding: n-gram prompt lookup, or a smaller / quantized model.

`propose(items, drafting, unsure=None)` returns, for each (seq, k) in `drafting`, up to k draft
tokens, the distribution each was drawn from ([n, V] probabilities, or None for a deterministic
drafter such as n-gram lookup, whose p_draft is one-hot) and, with `unsure`, which of them the
draft model was unsure of (else None).

A draft model keeps its own paged KV pool with the SAME block geometry as the target's and
writes through the target's block tables, so prefix-cache hits, preemption and freeing need no
bookkeeping of their own: whenever the target computes a token the draft computes it too (the
prefill items of each step are mirrored into the draft's first pass). `done[request]` counts
the positions the draft has computed; it can trail the target by one token after a fully
accepted draft (the last draft token is proposed, never fed back), and the next pass catches up.

`self:layers=N` (LayerPrefixDrafter): the target's own first N layers + its final norm and head
draft, reading and writing the TARGET's paged KV of those layers. That is exact and needs no
cache of its own: a layer's KV at a position depends only on the tokens up to it through the layers
below, so the draft's KV of layers < N IS the target's; every slot the draft writes (the
sequence's last token and the drafted positions) is rewritten by the target's verify pass of the
same step before anything else reads it, so a rejected draft leaves nothing stale behind.

A token cascade (Engine(cascade=...)) uses the same drafters with `unsure` (logits [n, V] -> bool
[n]): the drafts go on through unsure positions, each flagged, and the target's pass over them
decides those positions as a verify would (engine._verify); the sure ones stand as drafted.
"""

from __future__ import annotations

import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine.model_runner import ModelRunner, Work
from lowbit.runtime.engine.paged_cache import PagedKVCache
from lowbit.runtime.engine.sampler import Sampler, draw, greedy, process_logits
from lowbit.runtime.engine.speculative import ngram_propose


class NgramDrafter:
    kind = "ngram"

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, items, drafting, unsure=None):
        return [(ngram_propose(seq.token_ids, k, self.max_ngram), None, None) for seq, k in drafting]

    def sync(self, seq) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def choose(logits: torch.Tensor, seqs) -> tuple[list[int], list[torch.Tensor | None]]:
    """Draw one token per row from the row's processed distribution; return the tokens and,
    for non-greedy rows, that distribution (what the rejection rule needs as p_draft)."""
    if all(s.params.greedy and not s.params.changes_logits for s in seqs):
        # the target verifies every token, so a draft row of NaNs only proposes a token to reject
        return greedy(logits).tolist(), [None] * len(seqs)
    tokens, probs = [], []
    for row, seq in enumerate(seqs):
        # the target's knobs (bias, penalties) on the draft too: a closer draft is accepted more often
        x = process_logits(logits[row : row + 1], [seq.params], [seq.token_ids], [seq.output_token_ids])
        if seq.params.greedy:
            tokens.append(int(x.argmax()))
            probs.append(None)
            continue
        p = x.softmax(dim=-1)[0]
        tokens.append(int(draw(p[None], [Sampler.generator(seq, p.device)])[0]))
        probs.append(p)
    return tokens, probs


def draft_tokens(runner: ModelRunner, works: list[Work], drafting, unsure=None, several: bool = True
                 ) -> tuple[list[tuple[list[int], torch.Tensor | None, list[bool] | None]], list[int]]:
    """Run `works` (the last one per drafting sequence yields its first draft logits), then feed
    each draft back until every sequence has its k drafts: greedy drafts with `several` in one C
    call of the steps every row still takes (ModelRunner.decode_steps: the same tokens), else one
    step at a time; with `unsure` (logits [n, V] -> bool [n], a token cascade), each draft is
    flagged unsure or not. Returns the proposals and, per sequence, the positions the draft model
    computed."""
    drafts = [[] for _ in drafting]
    probs = [[] for _ in drafting]
    flags = [[] for _ in drafting]
    active = list(range(len(drafting)))
    # greedy drafts without a cascade's flags need only each step's argmax: after the first pass
    # (which mirrors the target's step), the steps all rows still take run in one C call
    several = several and unsure is None and all(seq.params.greedy and not seq.params.changes_logits for seq, _ in drafting)
    while active:
        logits = runner.run(works).float()  # the draft may run in bf16; its probabilities are float32
        tokens, dists = choose(logits, [drafting[i][0] for i in active])
        doubts = unsure(logits).tolist() if unsure is not None else [False] * len(active)
        for i, t, p, doubt in zip(active, tokens, dists, doubts):
            drafts[i].append(t)
            probs[i].append(p)
            flags[i].append(doubt)
        active = [i for i in active if drafting[i][1] > len(drafts[i])]
        works = _next_works(drafting, drafts, active)
        steps = min((drafting[i][1] - len(drafts[i]) for i in active), default=0)
        head = runner.steps_head(len(active)) if several and steps > 1 else None
        if head is not None:
            got, _ = runner.decode_steps(works, steps, head)  # fewer where a step's logits were not finite
            for i, more in zip(active, got):
                drafts[i] += more
                probs[i] += [None] * len(more)
                flags[i] += [False] * len(more)
            active = [i for i in active if drafting[i][1] > len(drafts[i])]
            works = _next_works(drafting, drafts, active)
    proposals = [(d, None if not p or p[0] is None else torch.stack(p), f if unsure is not None else None)
                 for d, p, f in zip(drafts, probs, flags)]
    return proposals, [len(d) for d in drafts]


def _next_works(drafting, drafts: list[list[int]], active: list[int]) -> list[Work]:
    """Each active sequence's last draft, to be fed back at its position."""
    return [Work(drafting[i][0].block_table, drafting[i][0].num_tokens - 1 + len(drafts[i]), [drafts[i][-1]], 1)
            for i in active]


class ModelDrafter:
    kind = "model"

    def __init__(self, model, cache: PagedKVCache, several_steps: bool = True):
        self.model = model
        self.runner = ModelRunner(model, cache)
        self.done: dict[str, int] = {}
        self.several_steps = several_steps  # greedy drafts' later steps in one C call

    def propose(self, items, drafting, unsure=None):
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
        out, passes = draft_tokens(self.runner, works, drafting, unsure, self.several_steps)
        for (seq, _), n in zip(drafting, passes):
            self.done[seq.request_id] = seq.num_tokens - 1 + n
        return out

    def sync(self, seq) -> None:
        """After the target's verify: drafted positions past the accepted ones hold stale KV."""
        done = self.done.get(seq.request_id)
        if done is not None and done > seq.num_computed_tokens:
            self.done[seq.request_id] = seq.num_computed_tokens

    def forget(self, request_id: str) -> None:
        self.done.pop(request_id, None)


class LayerPrefixDrafter:
    """`self:layers=N`: the target's first N layers + final norm + head (draft_models.layer_prefix)
    draft over the target's own KV cache (see the module docstring): only the sequence's last
    token and the drafts run, nothing is mirrored or caught up."""

    kind = "layers"

    def __init__(self, view, cache: PagedKVCache, several_steps: bool = True):
        self.model = view
        self.runner = ModelRunner(view, cache)
        self.several_steps = several_steps

    def propose(self, items, drafting, unsure=None):
        if not drafting:
            return []
        works = [Work(seq.block_table, seq.num_tokens - 1, [seq.token_ids[-1]], 1) for seq, _ in drafting]
        return draft_tokens(self.runner, works, drafting, unsure, self.several_steps)[0]

    def sync(self, seq) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


LAYERS_PREFIX = "self:layers="


def parse_draft(draft: str | None) -> tuple[str, str | int | None]:
    """'ngram' -> ('ngram', None); 'self:layers=12' -> ('layers', 12); 'self:int4' -> ('self', 'int4');
    a path or name -> ('model', it). The layer count is checked against the model by the engine."""
    if draft is None:
        return "none", None
    if draft == "ngram":
        return "ngram", None
    if draft.startswith(LAYERS_PREFIX):
        count = draft[len(LAYERS_PREFIX) :]
        if not count.strip().lstrip("-").isdigit():
            raise UsageError(f"--draft {draft}: the layer count must be an integer, e.g. self:layers=12")
        return "layers", int(count)
    if draft.startswith("self:"):
        fmt = draft[len("self:") :]
        if not fmt:
            raise UsageError("--draft self:FORMAT needs a format, e.g. self:int4")
        return "self", fmt
    return "model", draft
