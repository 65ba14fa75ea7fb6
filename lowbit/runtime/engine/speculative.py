"""Speculative decoding, model-independent parts: verifying drafts, n-gram drafts, statistics.

A drafter proposes k tokens d[0..k-1] after a sequence's last token; the target model runs once
over [last, d0, ..., d(k-1)] and gives k+1 next-token distributions. Verification emits between
1 and k+1 tokens per target pass:
- greedy: keep the longest run where d[i] == argmax_target[i], then append argmax_target at the
  first disagreement (or the bonus position k). The output is exactly plain greedy decoding.
- sampling (Leviathan et al. / Chen et al.): accept d[i] with probability
  min(1, p_target(d[i]) / p_draft(d[i])); at the first rejection draw from
  normalize(max(0, p_target - p_draft)); if all are accepted draw a bonus from p_target[k].
  Each emitted token is then distributed exactly as p_target, whatever the draft distribution.
  A deterministic drafter (n-gram lookup) is the case p_draft = one-hot(d[i]).

Batched functions take rows padded to k drafts with `num_draft[b]` valid ones and return
tokens[B, k+1] (-1 past the emitted ones) and num_accepted[B]; row b emits
tokens[b, : num_accepted[b] + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _valid_mask(draft_tokens: torch.Tensor, num_draft: torch.Tensor | None) -> torch.Tensor:
    B, k = draft_tokens.shape
    if num_draft is None:
        return torch.ones(B, k, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(k, device=draft_tokens.device)[None, :] < num_draft.to(draft_tokens.device)[:, None]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _blank_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    keep = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= num_accepted[:, None]
    return tokens.masked_fill(~keep, -1)


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens[B, k], target_argmax[B, k+1] -> (tokens[B, k+1], num_accepted[B])."""
    k = draft_tokens.shape[1]
    agree = (draft_tokens == target_argmax[:, :k]) & _valid_mask(draft_tokens, num_draft)
    num_accepted = _leading_true(agree)
    # Accepted drafts equal the target's argmaxes, so the emitted run is the target's prefix.
    return _blank_after(target_argmax.clone(), num_accepted), num_accepted


def rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     num_draft: torch.Tensor | None = None, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens[B, k], target_probs[B, k+1, V], draft_probs[B, k, V] (None: a deterministic
    drafter) -> (tokens[B, k+1], num_accepted[B]). Probabilities need not be normalised exactly
    but must be the distributions the tokens were (or would be) sampled from."""
    B, k = draft_tokens.shape
    dev = target_probs.device
    valid = _valid_mask(draft_tokens, num_draft)
    safe_draft = draft_tokens.clamp(min=0)  # padding may be -1
    p_t = target_probs[:, :k].gather(2, safe_draft[..., None]).squeeze(2)
    p_d = (torch.ones_like(p_t) if draft_probs is None
           else draft_probs.gather(2, safe_draft[..., None]).squeeze(2))
    u = torch.rand(B, k, device=dev, generator=generator)
    accepted = (u * p_d < p_t) & valid  # u < p_t / p_d without dividing by a zero p_d
    num_accepted = _leading_true(accepted)

    rows = torch.arange(B, device=dev)
    final = target_probs[rows, num_accepted].float()  # bonus distribution where all were accepted
    rejected = num_accepted < valid.sum(dim=1)  # stopped at a real draft, not past the last one
    if rejected.any():
        at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            p_draft_at = torch.zeros_like(final).scatter_(1, safe_draft[rows, at][:, None], 1.0)
        else:
            p_draft_at = draft_probs[rows, at].float()
        residual = (final - p_draft_at).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # A rejection implies p_target < p_draft at the draft, so the residual has mass; the
        # fallback only guards against rounding.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final)
        final = torch.where(rejected[:, None], residual, final)
    last = torch.multinomial(final, 1, generator=generator).squeeze(1)

    tokens = torch.cat([draft_tokens, torch.full((B, 1), -1, device=dev, dtype=draft_tokens.dtype)], dim=1)
    tokens[rows, num_accepted] = last.to(tokens.dtype)
    return _blank_after(tokens, num_accepted), num_accepted


def emitted_tokens(tokens: torch.Tensor, num_accepted: torch.Tensor) -> list[list[int]]:
    return [row[: n + 1] for row, n in zip(tokens.tolist(), num_accepted.tolist())]


def ngram_propose(token_ids, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (longest n first,
    from max_ngram down to min_ngram) and propose up to k tokens that followed it; [] if none."""
    ids = np.asarray(token_ids, dtype=np.int64)
    L = len(ids)
    if k < 1:
        return []
    for n in range(min(max_ngram, L - 1), max(min_ngram, 1) - 1, -1):
        # Windows start at j <= L - 1 - n, so at least one token follows each candidate.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)
        hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []


class AdaptiveK:
    """Draft length that grows by one after a fully accepted draft and shrinks by one when
    fewer than half are accepted: long drafts when the drafter is right, cheap ones when not."""

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 8):
        self.k, self.k_min, self.k_max = k, k_min, k_max

    def update(self, num_draft: int, num_accepted: int) -> int:
        if num_draft and num_accepted == num_draft:
            self.k = min(self.k + 1, self.k_max)
        elif num_accepted * 2 < num_draft:
            self.k = max(self.k - 1, self.k_min)
        return self.k


@dataclass(slots=True)
class SpecStats:
    """Counts over target passes. mean_accepted_length = tokens emitted per target pass
    (accepted drafts + the one the target adds), the speedup bound when drafting is free."""

    num_passes: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_passes += 1
        self.num_drafted += num_draft
        self.num_accepted += num_accepted

    @property
    def mean_accepted_length(self) -> float:
        return (self.num_accepted + self.num_passes) / self.num_passes if self.num_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0
