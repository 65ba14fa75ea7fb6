"""The token cascade decoding one sequence over two contiguous KV caches, outside the engine: the
reference the engine's cascade (Engine(cascade=...)) is checked against.

The cheap model runs on every token, so its cache is always complete; the full model runs only when
the cheap one is unsure, and then over every token it has not seen yet in one batched forward."""

from __future__ import annotations

import torch

from lowbit.runtime.cascade import CascadeSettings, CascadeStats
from lowbit.runtime.early_exit import confidence_of


class CascadeDecoder:
    """`prefill` then `step` per token (module docstring)."""

    def __init__(self, full, cheap, settings: CascadeSettings, max_len: int):
        self.full, self.cheap, self.settings = full, cheap, settings
        self.full_cache = full.new_cache(1, max_len)
        self.cheap_cache = cheap.new_cache(1, max_len)
        self.unseen: list[int] = []  # tokens the full model has not run on yet
        self.stats = CascadeStats()

    def _device(self, model) -> torch.device:
        return model.model.norm.weight.device

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Both models over the prompt; the full model's next-token logits [V] (the prompt is one
        batched forward for it anyway, so the first token is always the full model's)."""
        n = len(prompt_ids)
        self.cheap(torch.tensor([prompt_ids], device=self._device(self.cheap)), cache=self.cheap_cache, logits_start=n - 1)
        logits = self.full(torch.tensor([prompt_ids], device=self._device(self.full)), cache=self.full_cache,
                           logits_start=n - 1)
        return logits[0, -1].float()

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        self.unseen.append(token)
        cheap = self.cheap(torch.tensor([[token]], device=self._device(self.cheap)), cache=self.cheap_cache)[0, -1].float()
        if float(confidence_of(cheap, self.settings.confidence)) > self.settings.threshold:
            self.stats.record(True)
            return cheap
        ids = torch.tensor([self.unseen], device=self._device(self.full))
        logits = self.full(ids, cache=self.full_cache, logits_start=len(self.unseen) - 1)[0, -1].float()
        self.unseen = []
        self.stats.record(False)
        return logits
