"""The token windows a distillation trains on and the held-out text it is scored on.

Training windows are drawn without overlap from the training text by the seed
(compress/calibrate.py `calibration_samples`). Held out: the `--eval-data` text when given, else
the tail of the training text, which the training windows never touch (it is cut off first).
Which windows a step sees is a function of (seed, step) alone, so a resumed run replays it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.compress.calibrate import calibration_samples
from lowbit.errors import LowbitError


@dataclass(slots=True)
class Windows:
    train: torch.Tensor  # [samples, seqlen] token ids, BOS first when the tokenizer adds one
    heldout: list[int]  # held-out tokens, scored in `eval_chunks` windows of seqlen
    bos_id: int | None  # put first in each held-out window (llama-perplexity's rule), or None


def make_windows(tokenizer, text: str, *, samples: int, seqlen: int, seed: int, eval_chunks: int,
                 eval_text: str | None, what: str) -> Windows:
    ids = tokenizer.encode(text, add_bos=False)
    held_need = eval_chunks * seqlen
    if eval_text is None:
        if len(ids) < held_need + seqlen:
            raise LowbitError(f"{what} has {len(ids)} tokens: too little text for {eval_chunks} held-out window(s) "
                              f"of {seqlen} tokens and any training; give more text or --eval-data")
        train_ids, held = ids[: len(ids) - held_need], ids[len(ids) - held_need:]
    else:
        train_ids, held = ids, tokenizer.encode(eval_text, add_bos=False)
        if len(held) < held_need:
            raise LowbitError(f"--eval-data has {len(held)} tokens, fewer than --eval-chunks {eval_chunks} x "
                              f"--seqlen {seqlen} = {held_need}")
    train = calibration_samples(tokenizer, text, samples, seqlen, seed, what=what, ids=train_ids)
    bos = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    return Windows(train=train, heldout=held, bos_id=bos)


def step_indices(step: int, batch: int, count: int, seed: int, stream: int = 0) -> list[int]:
    """The `batch` sample indices of step `step`: consecutive places of a fresh permutation per pass
    over the `count` samples (seeded by seed, stream and the pass), so every sample is seen once a pass."""
    out = []
    for place in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(place, count)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + stream * 7919 + epoch)
        out.append(int(torch.randperm(count, generator=gen)[offset]))
    return out
