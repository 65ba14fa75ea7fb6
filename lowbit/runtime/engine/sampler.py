"""Batched sampling from logits[B, V] with each row's own SamplingParams.

Processing order (Hugging Face's): repetition penalty -> temperature -> top-k -> top-p -> min-p,
then a draw. Greedy rows (temperature 0) take the argmax after the repetition penalty.
- repetition penalty, over prompt + generated ids: a positive logit is divided by it, a negative
  one multiplied (so a penalty > 1 always makes a seen token less likely).
- top-k keeps exactly k tokens (ties at the k-th value broken by sort order).
- top-p keeps the smallest most-likely set whose mass reaches p: a token stays when the mass of
  the tokens ranked above it is < p (computed after top-k, on the renormalised distribution).
- min-p drops tokens whose probability is < min_p times the most likely token's.

The draw is an exponential race: argmax(p / q) with q ~ Exp(1) is a sample from p. A seeded row
draws its q from its own torch.Generator (on the Sequence), so a seed gives the same tokens
whatever else is in the batch; unseeded rows share torch's global generator. Generators live on
the logits' device, so CPU and GPU runs of one seed differ.

Logprobs are from the RAW model distribution (log-softmax of the logits before any penalty,
temperature or filter), as vLLM does by default and OpenAI's API reports: they describe the
model, not the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.runtime.engine.sequence import SamplingParams, Sequence


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]]) -> None:
    """In place, on the rows whose penalty is not 1."""
    for row, (p, history) in enumerate(zip(params, histories)):
        if p.repetition_penalty == 1.0 or not history:
            continue
        ids = torch.tensor(sorted(set(history)), device=logits.device, dtype=torch.long)
        seen = logits[row, ids]
        logits[row, ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]]) -> torch.Tensor:
    """float32 logits after penalty, temperature and the filters (removed tokens at -inf).

    softmax of the result is the distribution a non-greedy row samples from; the speculative
    rejection rule needs exactly this as p_target.
    """
    x = logits.float().clone()
    apply_repetition_penalty(x, params, histories)
    B, V = x.shape
    dev = x.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    x /= temps[:, None]

    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=dev)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev)
        drop = rank >= top_k[:, None]
        if any(p.top_p < 1 for p in params):
            probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_above = probs.cumsum(dim=-1) - probs
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            drop |= mass_above >= top_p[:, None]
        x.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))

    if any(p.min_p > 0 for p in params):
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        x.masked_fill_(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
           generators: list[torch.Generator | None] | None = None) -> SamplerOutput:
    """One token per row. histories[i] = the row's prompt + generated ids (for the penalty)."""
    B = logits.shape[0]
    if len(params) != B or len(histories) != B:
        raise ValueError(f"{B} logit rows but {len(params)} params and {len(histories)} histories")
    generators = generators or [None] * B
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        chosen = logits.argmax(dim=-1)
    else:
        x = process_logits(logits, params, histories)
        chosen = x.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            probs = x[random_rows].softmax(dim=-1)
            q = torch.empty_like(probs).exponential_()
            for j, row in enumerate(random_rows):
                if generators[row] is not None:
                    q[j].exponential_(generator=generators[row])
            q.clamp_(min=torch.finfo(q.dtype).tiny)  # a 0 would make 0/0 = NaN, which argmax picks
            chosen[random_rows] = (probs / q).argmax(dim=-1)
    token_ids = chosen.tolist()
    return SamplerOutput(token_ids, _logprobs(logits, params, token_ids))


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    lp = logits[rows].float().log_softmax(dim=-1)
    n_max = max(params[i].logprobs for i in rows)
    top_vals, top_ids = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
    for j, row in enumerate(rows):
        n = params[row].logprobs
        top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
        result[row] = TokenLogprobs(token_ids[row], lp[j, token_ids[row]].item(), top)
    return result


class Sampler:
    """sample() over Sequences: gathers params and histories, keeps each seeded row's generator."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        params = [s.params for s in seqs]
        histories = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
        return sample(logits, params, histories, [self.generator(s, logits.device) for s in seqs])

    @staticmethod
    def generator(seq: Sequence, device) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
        return seq.generator
