"""What every kind of distillation shares: the teacher's pass over the windows, the end-to-end
loop on KL(teacher || student), the optimizer, the held-out score, and the NaN policy."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowbit.compress.distill.layers import embed, head_logits, propagate
from lowbit.compress.distill.losses import kl_divergence
from lowbit.compress.distill.placement import Placement
from lowbit.compress.distill.state import restore_optimizer, save_state
from lowbit.compress.distill.windows import Windows, make_windows, step_indices
from lowbit.data.text import load_text
from lowbit.errors import LowbitError, UsageError
from lowbit.runtime.evaluate import chunk_windows, evaluate_tokens

# Zero points are in code units (0..15 for 4 bits) and only move when they cross a half: they get
# this many times the learning rate of the multipliers and norms.
ZERO_LR_FACTOR = 10.0
TRAIN_KLD_STEPS = 10  # the reported train KLD: the mean loss of the last this many steps

# progress(stage, done, total, loss): stage "block" / "teacher" (done = layers) or "distill" (done = steps)
ProgressFn = Callable[[str, int, int, "float | None"], None]


class NanLoss(LowbitError):
    pass


@dataclass(slots=True)
class TrainOptions:
    """What every distillation's options share: the loop's length and rate (each kind has its own
    defaults for these two), the training windows, the held-out score, where it trains."""
    steps: int = 200
    lr: float = 1e-4
    samples: int = 32
    seqlen: int = 512
    batch: int = 1
    seed: int = 0
    save_every: int = 25
    eval_chunks: int = 4
    eval_data: str | None = None
    device: str = "auto"  # where it trains (placement.py)

    def __post_init__(self) -> None:
        check_options(self)


def check_options(opts: TrainOptions) -> None:
    """The checks every distillation's options share (steps, windows, held-out chunks, lr, batch)."""
    if opts.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {opts.steps}")
    for name in ("samples", "batch", "save_every", "eval_chunks"):
        if getattr(opts, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.seqlen < 16 or opts.seqlen % 2:
        raise UsageError(f"--seqlen must be an even number >= 16, got {opts.seqlen}")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {opts.lr}")
    if opts.batch > opts.samples:
        raise UsageError(f"--batch {opts.batch} is more than --samples {opts.samples}")


def training_windows(tokenizer, text: str, data: str, opts: TrainOptions) -> Windows:
    """The training and held-out windows the options ask for (held-out from --eval-data when given)."""
    eval_text = load_text(opts.eval_data) if opts.eval_data is not None else None
    return make_windows(tokenizer, text, samples=opts.samples, seqlen=opts.seqlen, seed=opts.seed,
                        eval_chunks=opts.eval_chunks, eval_text=eval_text, what=f"--data '{data}'")


def data_fingerprint(text: str, opts: TrainOptions) -> dict:
    """What a work folder's fingerprint holds of the data and the windows (and the threads, whose
    sums round differently)."""
    return {"data_sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "samples": opts.samples,
            "seqlen": opts.seqlen, "seed": opts.seed, "batch": opts.batch, "threads": torch.get_num_threads(),
            **device_fingerprint(opts.device)}


def device_fingerprint(device: str) -> dict:
    """What a work folder's fingerprint adds for `--device`: nothing on the CPU (its runs resume
    as before), the device's type elsewhere (another device's arithmetic, another run)."""
    from lowbit.runtime.device import resolve_device

    kind = resolve_device(device).type
    return {} if kind == "cpu" else {"device": kind}


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def make_optimizer(params: dict[str, torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    plain = [p for n, p in params.items() if not n.endswith(".zeros")]
    zeros = [p for n, p in params.items() if n.endswith(".zeros")]
    groups = [{"params": plain, "lr": lr}]
    if zeros:
        groups.append({"params": zeros, "lr": lr * ZERO_LR_FACTOR})
    # foreach=False: the per-parameter loop, whose arithmetic does not depend on how tensors are grouped
    return torch.optim.Adam(groups, lr=lr, foreach=False)


def finite(params: dict[str, torch.nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params.values())


@torch.no_grad()
def teacher_pass(teacher, ids: torch.Tensor, on_layer: Callable[[int, int], None] | None = None
                 ) -> tuple[torch.Tensor, list[float]]:
    """(the teacher's last hidden states on the windows [S, T, D], each layer's importance).

    Importance of a layer: 1 − the mean cosine between its input and output hidden states over
    every position but the first (the attention sink, whose huge activations would decide it):
    how much the layer changes what passes through it. A layer near 0 is the first to drop."""
    h = embed(teacher, ids)
    importance = []
    layers = teacher.config.num_hidden_layers
    for i in range(layers):
        out = propagate(teacher, i, h)
        cos = torch.nn.functional.cosine_similarity(h[:, 1:].double(), out[:, 1:].double(), dim=-1)
        importance.append(float(1.0 - cos.mean()))
        h = out
        if on_layer is not None:
            on_layer(i + 1, layers)
    return h, importance


def heldout_kld(student, teacher, windows: Windows, seqlen: int, chunks: int) -> float:
    """`lowbit eval --base`'s mean KLD on the held-out windows (second half of each scored)."""
    planned = chunk_windows(len(windows.heldout), seqlen, chunks)
    was_training = student.training
    result = evaluate_tokens(student.eval(), windows.heldout, planned, bos_id=windows.bos_id, base_model=teacher)
    student.train(was_training)
    return float(result.kld.mean)


# loss_of(rows): the loss of one step on those training windows, a float32 scalar with a graph
LossFn = Callable[[list[int]], torch.Tensor]


def logits_kl(student, teacher, teacher_final: torch.Tensor, ids: torch.Tensor, placement: Placement) -> LossFn:
    """KL(teacher || student) on the windows' next-token distributions, the teacher's logits made
    from its cached last hidden states by its head (the student under placement's precision)."""

    def loss_of(rows: list[int]) -> torch.Tensor:
        with torch.no_grad():
            target = head_logits(teacher, teacher_final[rows])
        with placement.autocast():
            logits = student(ids[rows])
        return kl_divergence(logits, target)

    return loss_of


def end_to_end(params: dict[str, torch.nn.Parameter], loss_of: LossFn, *, windows: int, steps: int, lr: float,
               batch: int, seed: int, save_every: int, work_path, done: int, losses: list[float], opt_state,
               on_progress: ProgressFn | None, placement: Placement) -> int:
    """Steps done..steps of Adam on loss_of over `windows` training windows (step_indices picks each
    step's), the state saved every `save_every` steps and at the end."""
    if steps == 0 or done >= steps:
        return max(steps, done)
    optimizer = make_optimizer(params, lr)
    if opt_state:
        restore_optimizer(optimizer, opt_state)
    last_good = done
    for step in range(done, steps):
        loss = loss_of(step_indices(step, batch, windows, seed))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NanLoss(f"the loss became {value} at step {step + 1} (--lr {lr} too high?): stopped; the last "
                          f"good state (step {last_good}) is kept in {work_path} and a rerun resumes from it "
                          "(with a lower --lr if you like); nothing was written to the output")
        optimizer.zero_grad(set_to_none=True)
        placement.backward(loss)
        optimizer.step()
        losses.append(value)
        if ((step + 1) % save_every == 0 or step + 1 == steps) and finite(params):
            save_state(work_path, params, optimizer, {"stage": "e2e", "done": step + 1, "losses": losses})
            last_good = step + 1
        if on_progress is not None:
            window = losses[-TRAIN_KLD_STEPS:]
            on_progress("distill", step + 1, steps, sum(window) / len(window))
    return steps


def train_kld(losses: list[float]) -> float | None:
    tail = losses[-TRAIN_KLD_STEPS:]
    return sum(tail) / len(tail) if tail else None
