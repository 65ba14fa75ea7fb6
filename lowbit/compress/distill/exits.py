"""`lowbit distill TEACHER --data TEXT --exit-layers 12,20 -o OUT`: exit adapters, trained so that
an exit's logits match the teacher's own last layer.

Each exit L gets a low-rank residual adapter (runtime/exit_adapters.py) between the final norm and
the head: logits_L = head(adapter_L(norm(h_L))). Only the adapters train; the model is frozen.
The loss is the mean over exits of KL(full model || exit) on the training windows, so an exit's
confidence learns to mean "the full model would say the same" — what an exit threshold and a
self-speculative draft both need. The hidden states at every exit and after the last layer are
computed once (one teacher pass, kept in memory: samples × seqlen × hidden floats per exit), so a
step costs the head and the adapters, not the model.

OUT is the teacher's directory (files hard-linked where the file system allows, else copied) with
`exit_adapters.safetensors` beside them: every early-exit path reads it from there, and
`lowbit quantize OUT` carries it into the quantized checkpoint. Resumable and deterministic like
the other distillations (state.py, train.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowbit.compress.distill import train
from lowbit.compress.distill.layers import embed, head_logits, head_only, propagate
from lowbit.compress.distill.losses import kl_divergence
from lowbit.compress.distill.placement import make_placement
from lowbit.compress.distill.state import load_state, restore
from lowbit.compress.distill.windows import Windows
from lowbit.compress.stats import config_hash
from lowbit.compress.workdir import WorkDir, work_dir_for
from lowbit.data.text import load_text
from lowbit.errors import UsageError
from lowbit.formats.atomic import atomic_dir, check_output_path
from lowbit.formats.hf_files import model_dir, read_config
from lowbit.formats.resolve import resolve_model
from lowbit.runtime.early_exit import parse_exit_layers
from lowbit.runtime.exit_adapters import ADAPTERS_FILE, ExitAdapter, new_adapters, save_adapters
from lowbit.runtime.device import resolve_device
from lowbit.runtime.loader import load_model
from lowbit.runtime.tokenizer import load_tokenizer


@dataclass(slots=True, kw_only=True)
class ExitOptions(train.TrainOptions):
    layers: str
    rank: int = 64
    steps: int = 200
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise UsageError(f"--exit-rank must be >= 1, got {self.rank}")
        train.check_options(self)


@dataclass(slots=True)
class ExitJob:
    teacher_dir: Path
    teacher: nn.Module
    layers: tuple[int, ...]
    windows: Windows
    options: ExitOptions
    output: Path
    overwrite: bool
    work: WorkDir


def prepare_exits(teacher: str, data: str, output: str | Path, options: ExitOptions, overwrite: bool = False) -> ExitJob:
    """Every input check before any training: output, teacher, exit layers, text."""
    output = Path(output)
    check_output_path(output, overwrite)
    resolve_device(options.device)
    teacher_dir = model_dir(resolve_model(teacher))
    config = read_config(teacher_dir)
    if "quantization_config" in config:
        raise UsageError(f"teacher {teacher_dir} is quantized; train exit adapters on the float model, then quantize "
                         f"OUT (the adapters travel with it)")
    layers = parse_exit_layers(options.layers, int(config.get("num_hidden_layers", 0)))
    rank_limit = int(config.get("hidden_size", 0))
    if options.rank > rank_limit:
        raise UsageError(f"--exit-rank {options.rank} is more than the hidden size {rank_limit}")
    tokenizer = load_tokenizer(teacher_dir)
    text = load_text(data)
    windows = train.training_windows(tokenizer, text, data, options)
    fingerprint = {
        "job": "distill-exits", "teacher": config_hash(config), "layers": list(layers), "rank": options.rank,
        **train.data_fingerprint(text, options),
    }
    work = WorkDir(work_dir_for(output), fingerprint)
    model = load_model(teacher_dir, dtype=torch.float32).requires_grad_(False).eval()
    return ExitJob(teacher_dir=teacher_dir, teacher=model, layers=layers, windows=windows, options=options,
                   output=output, overwrite=overwrite, work=work)


@torch.no_grad()
def exit_pass(model, ids: torch.Tensor, layers: tuple[int, ...], on_layer=None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """({exit layer: hidden states after it [S, T, D]}, the last layer's output [S, T, D])."""
    h = embed(model, ids)
    taps: dict[int, torch.Tensor] = {}
    total = model.config.num_hidden_layers
    for i in range(total):
        h = propagate(model, i, h)  # a new tensor each layer, so a tap is never overwritten
        if i + 1 in layers:
            taps[i + 1] = h
        if on_layer is not None:
            on_layer(i + 1, total)
    return taps, h


def exit_logits(model, adapter: ExitAdapter | None, h: torch.Tensor) -> torch.Tensor:
    x = model.model.norm(h)
    return head_only(model, x if adapter is None else adapter(x))


def exits_kl(model, adapters: dict[int, ExitAdapter], taps: dict[int, torch.Tensor], final: torch.Tensor) -> train.LossFn:
    """The mean over exits of KL(full model || exit) on a step's windows."""

    def loss_of(rows: list[int]) -> torch.Tensor:
        with torch.no_grad():
            target = head_logits(model, final[rows])
        total = sum(kl_divergence(exit_logits(model, adapters[layer], taps[layer][rows]), target) for layer in adapters)
        return total / len(adapters)

    return loss_of


@torch.no_grad()
def heldout_scores(model, adapters: dict[int, ExitAdapter | None], windows: Windows, seqlen: int, chunks: int) -> dict:
    """Per exit, on the held-out windows' second halves (as `lowbit eval` scores): mean
    KL(full || exit) and how often the exit's top token is the full model's."""
    held = windows.heldout
    count = min(chunks, len(held) // seqlen)
    ids = torch.tensor([held[i * seqlen:(i + 1) * seqlen] for i in range(count)])
    if windows.bos_id is not None:
        ids[:, 0] = windows.bos_id
    taps, final = exit_pass(model, ids.to(model.lm_head.weight.device), tuple(adapters))
    scored = slice(seqlen // 2, seqlen - 1)  # positions that predict a token inside the window
    full = head_logits(model, final[:, scored])
    out = {}
    for layer, adapter in adapters.items():
        logits = exit_logits(model, adapter, taps[layer][:, scored])
        out[str(layer)] = {"kld": float(kl_divergence(logits, full)),
                           "same_top_pct": 100.0 * float((logits.argmax(-1) == full.argmax(-1)).float().mean())}
    return out


def run_exits(job: ExitJob, on_progress: train.ProgressFn | None = None) -> dict:
    began = time.perf_counter()
    opts = job.options
    placement = make_placement(opts.device)
    model = job.teacher = placement.to(job.teacher)
    ids = placement.to(job.windows.train)
    taps, final = exit_pass(model, ids, job.layers,
                            None if on_progress is None else lambda d, t: on_progress("teacher", d, t, None))
    adapters = {layer: placement.to(a) for layer, a in new_adapters(job.layers, model.config.hidden_size, opts.rank,
                                                                      opts.seed).items()}
    table = nn.ModuleDict({str(layer): a for layer, a in adapters.items()})
    params = train.trainable(table)
    before = heldout_scores(model, dict.fromkeys(job.layers), job.windows, opts.seqlen, opts.eval_chunks)
    saved = load_state(job.work.path)
    done, losses, opt_state = 0, [], None
    if saved is not None and saved[2].get("stage") == "e2e":
        restore(params, saved[0])
        done, losses, opt_state = int(saved[2]["done"]), list(saved[2]["losses"]), saved[1]
        print(f"lowbit: resuming from {job.work.path}: step {done} of {opts.steps}", file=sys.stderr, flush=True)
    steps = train.end_to_end(params, exits_kl(model, adapters, taps, final), windows=ids.shape[0], steps=opts.steps,
                             lr=opts.lr, batch=opts.batch, seed=opts.seed, save_every=opts.save_every,
                             work_path=job.work.path, done=done, losses=losses, opt_state=opt_state,
                             on_progress=on_progress, placement=placement)
    after = heldout_scores(model, adapters, job.windows, opts.seqlen, opts.eval_chunks)
    adapters = {layer: a.cpu() for layer, a in adapters.items()}  # written from the CPU
    write_with_adapters(job.teacher_dir, adapters, model.config, job.output, job.overwrite)
    job.work.remove()
    return {
        "teacher": str(job.teacher_dir), "output": str(job.output), "exit_layers": list(job.layers),
        "num_layers": model.config.num_hidden_layers, "rank": opts.rank, "steps": steps, "batch": opts.batch,
        "lr": opts.lr, "samples": opts.samples, "seqlen": opts.seqlen, "seed": opts.seed,
        "train_tokens": int(ids.numel()), "tokens_seen": steps * opts.batch * opts.seqlen,
        "train_kld": train.train_kld(losses), "loss_curve": [round(v, 6) for v in losses],
        "heldout_before": before, "heldout_after": after, "heldout_tokens": len(job.windows.heldout),
        "seconds": round(time.perf_counter() - began, 2), "resumed": job.work.resumed,
        "adapter_bytes": (job.output / ADAPTERS_FILE).stat().st_size,
    }


def write_with_adapters(source: Path, adapters: dict[int, ExitAdapter], config, output: Path, overwrite: bool) -> None:
    """OUT = the teacher's files (hard links where possible) + exit_adapters.safetensors, atomically."""
    with atomic_dir(output, overwrite=overwrite) as tmp:
        for file in sorted(source.iterdir()):
            if not file.is_file() or file.name == ADAPTERS_FILE:
                continue
            try:
                os.link(file, tmp / file.name)
            except OSError:
                shutil.copyfile(file, tmp / file.name)
        save_adapters(adapters, tmp / ADAPTERS_FILE, config.hidden_size, config.num_hidden_layers)
