"""`lowbit eval`'s forward on the engine's path: a window runs as one prefill through the
ModelRunner over a paged KV cache of its own, so each row's logits are the ones `generate` and
`serve` compute for that token (their prompt log-probabilities included), bit for bit.

Why not the model's own forward: both are float32, but they attend differently (SDPA over the
window against the engine's row-by-row fused kernel), and where activations are rounded — bf16
x for bf16 weights, int8 x for int4/int8 weights, the CPU defaults — a last-bit difference in one
attention output moves a rounding, and the scores drift apart by up to 0.1 nats a token (SmolLM2
int4: 0.35 % of a document's log-likelihood). Scoring on the serving path keeps the promise that
an lm-eval perplexity through `lowbit serve` equals `lowbit eval`'s."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.runtime.engine.model_runner import ModelRunner, Work
from lowbit.runtime.engine.paged_cache import PagedKVCache, resolve_kv_dtype

BLOCK_SIZE = 16  # the engine's default block (Engine(block_size=16))


class WindowScorer(nn.Module):
    """Calls like CausalLM.forward for one window: (ids [1, T], logits_start) -> logits
    [1, T - logits_start, V] (float32). The window's cache is reused window after window."""

    def __init__(self, model: nn.Module, max_tokens: int):
        super().__init__()
        self.lm = model  # a child: parameters(), modules() and kernel summaries see the model
        self.config = model.config
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        dtype = model.model.norm.weight.dtype  # the compute dtype (as CausalLM.new_cache reads it)
        device = model.model.norm.weight.device
        # the engine's cache storage (resolve_kv_dtype: a bf16 checkpoint's keys and values in bf16),
        # so a window's scores stay the ones generate and serve compute
        kv_dtype = resolve_kv_dtype(None, dtype, device, model.config)
        self.cache = PagedKVCache(model.config, num_blocks, BLOCK_SIZE, dtype, device, kv_dtype)
        self.runner = ModelRunner(model, self.cache)
        self.block_table = list(range(num_blocks))

    def forward(self, input_ids: torch.Tensor, logits_start: int = 0) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError(f"WindowScorer takes one window at a time, got a batch of {input_ids.shape[0]}")
        ids = input_ids[0].tolist()
        if len(ids) > len(self.block_table) * BLOCK_SIZE:
            raise ValueError(f"a window of {len(ids)} tokens exceeds the scorer's {len(self.block_table) * BLOCK_SIZE}")
        logits = self.runner.run([Work(self.block_table, 0, ids, len(ids) - logits_start)])
        return logits.unsqueeze(0)
