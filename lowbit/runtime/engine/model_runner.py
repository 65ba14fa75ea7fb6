"""Runs one flattened batch of (sequence chunk) work items through a model over the paged cache.

A work item is (block_table, start, token_ids, num_logits): compute token_ids at positions
start.. (writing their KV through the block table) and return the logits of its last
`num_logits` tokens (0: a prefill chunk that samples nothing, 1: a normal sample, 1 + k: a
speculative verify). All items go through the model as one sequence [1, T]; the paged cache's
attention keeps them apart. The lm_head runs only on the rows whose logits are wanted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.runtime.engine.paged_attention import build_metadata
from lowbit.runtime.engine.paged_cache import PagedKVCache


@dataclass(slots=True)
class Work:
    block_table: list[int]
    start: int
    token_ids: list[int]
    num_logits: int


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.softcap = model.config.final_logit_softcapping
        self.num_forwards = 0

    @torch.inference_mode()
    def run(self, works: list[Work]) -> torch.Tensor | None:
        """Logits [sum of num_logits, V] in work order (None when no item wants logits)."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        plan = []
        max_position = 0
        for w in works:
            n = len(w.token_ids)
            row = len(ids)
            ids += w.token_ids
            positions += range(w.start, w.start + n)
            if w.num_logits:
                rows += range(row + n - w.num_logits, row + n)
            plan.append((w.block_table, w.start, n))
            max_position = max(max_position, w.start + n - 1)
        cache = self.cache
        cache.meta = build_metadata(plan, cache.block_size, self.device, with_block_tables=self.device.type == "cuda",
                                    fused_decode=cache.fused_decode)
        try:
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            h = self.model.model(input_ids, pos, max_position, cache)[0]
        finally:
            cache.meta = None
        self.num_forwards += 1
        if not rows:
            return None
        if len(rows) != h.shape[0]:
            h = h[torch.tensor(rows, device=self.device)]
        # float32 logits (exact for bf16 ones): torch's CPU argmax/softmax over bf16 is much slower
        logits = self.model.lm_head(h).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
