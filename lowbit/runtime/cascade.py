"""Token-level cascade: a cheap model answers the tokens it is sure of, the full model the rest.

The cheap model is any model with the full model's tokenizer (a distilled student, a quantized
copy) or `self:FORMAT`, the full model's own weights RTN-quantized (the --draft rule). A position
whose cheap-model confidence (runtime/early_exit.confidence_of: top-1 probability or top-1/top-2
margin) is strictly above the threshold takes the cheap model's logits, else the full model's. So
threshold 1.0 is the full model bit for bit, and 0.0 (top1) the cheap model everywhere.

- `CascadeLM` wraps the pair for `lowbit eval --cascade`: both models score the same window, the
  mixed logits come out, and `early_exit.FullLogits` hands the full model's to the evaluator as
  the KLD base (no second forward).
- Decoding (`generate` / `bench --cascade`) runs in the engine: `Engine(draft=CHEAP,
  cascade=CascadeSettings(...))` drafts `run` tokens with the cheap model, each flagged sure or
  unsure, and the model's one pass over them (n + 1 rows read the weights once) catches its cache
  up and decides the unsure ones as speculative decoding verifies drafts: where the model's token
  is the draft, it stands; at the first where it is not, the model's token replaces it and the
  run ends (what follows was drawn after the wrong token). Sure drafts stand unverified. So every
  position gets the rule above - sure: the cheap model's token, unsure: the model's - and an
  unsure position costs no step of its own (until 2026-12-05 the first unsure position ended the
  run and took a model pass alone: at threshold 0.9 a 0.7x "speedup"). Threshold 1.0 is the model
  bit for bit, as plain speculative decoding. Which model answered each token is counted in
  `CascadeStats` (an unsure draft the model kept counts as the model's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import UsageError
from lowbit.runtime.engine.paged_attention import SHORT_QUERY
from lowbit.runtime.early_exit import check_confidence, check_threshold, confidence_of


# The longest run of cheap tokens the engine's cascade emits before the model's pass, which then
# covers run + 1 rows. Chosen when only up to SHORT_QUERY rows took the one-call decode step
# (SmolLM2, AVX2: a pass over 8 rows 27 ms, over 9 rows 60 ms through the per-layer path); on the
# CPU every pass takes it now, and longer runs have not been measured since.
DEFAULT_RUN = SHORT_QUERY - 1


@dataclass(slots=True)
class CascadeSettings:
    threshold: float
    confidence: str = "top1"
    run: int = DEFAULT_RUN  # the engine's cascade: the model takes at least every (run + 1)-th token

    def __post_init__(self) -> None:
        self.threshold = check_threshold(self.threshold, "--cascade-threshold")
        check_confidence(self.confidence)
        if self.run < 1:
            raise UsageError(f"--cascade-run must be >= 1, got {self.run}")

    def unsure(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] cheap-model logits -> bool [n]: the rows whose token the full model takes."""
        return confidence_of(logits, self.confidence) <= self.threshold


@dataclass(slots=True)
class CascadeStats:
    cheap: int = 0
    full: int = 0

    def record(self, cheap: bool) -> None:
        if cheap:
            self.cheap += 1
        else:
            self.full += 1

    def as_dict(self) -> dict:
        n = self.cheap + self.full
        return {"positions": n, "cheap_rate": self.cheap / n if n else 0.0, "full_rate": self.full / n if n else 0.0}


def load_cheap_model(spec: str, path, tokenizer, dtype: torch.dtype, device) -> torch.nn.Module:
    """`self:FORMAT` (the full model's weights RTN-quantized) or a model with the same tokenizer."""
    from lowbit.runtime.engine.draft_models import load_draft_model, quantized_copy
    from lowbit.runtime.engine.drafter import parse_draft

    kind, arg = parse_draft(spec)
    if kind == "self":
        return quantized_copy(path, arg, dtype, device)
    if kind == "model":
        return load_draft_model(arg, tokenizer, dtype, device, role="--cascade model")
    raise UsageError(f"--cascade {spec}: give a model with the same tokenizer or self:FORMAT (e.g. self:int4); "
                     "the model's own early layers are --early-exit")


class CascadeLM:
    """`model(ids, logits_start=)` -> [1, R, V]: each row the cheap model's logits where its
    confidence clears the threshold, else the full model's. Rows but the last are counted."""

    def __init__(self, full, cheap, settings: CascadeSettings):
        self.model = full
        self.cheap = cheap
        self.config = full.config
        self.settings = settings
        self.stats = CascadeStats()
        self.last: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (ids, logits_start, full logits)

    def parameters(self):
        return self.model.parameters()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, logits_start: int = 0) -> torch.Tensor:
        full = self.model(input_ids, logits_start=logits_start).float()
        cheap = self.cheap(input_ids, logits_start=logits_start).float()
        self.last = (input_ids, logits_start, full)
        take = confidence_of(cheap, self.settings.confidence) > self.settings.threshold
        for taken in take[0, :-1].tolist():
            self.stats.record(taken)
        return torch.where(take[..., None], cheap, full)


def wrap_eval_job(job, cheap_spec: str, threshold: float, confidence: str = "top1") -> CascadeLM:
    """Make an eval job score the cascade; without a --base, KLD is against the full model itself."""
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.early_exit import FullLogits
    from lowbit.runtime.tokenizer import load_tokenizer

    settings = CascadeSettings(threshold, confidence)
    path = resolve_model(job.model_name)
    lm = job.causal_lm()
    device = lm.model.norm.weight.device
    cheap = load_cheap_model(cheap_spec, path, load_tokenizer(path), lm.model.norm.weight.dtype, device)
    cascade = CascadeLM(lm, cheap, settings)
    if job.base_model is None:
        job.base_model = FullLogits(cascade)
        job.base_name = f"{job.model_name} (the full model alone)"
    job.model = cascade
    return cascade
