"""`lowbit distill TEACHER --data TEXT --student QCKPT -o OUT`: win back what quantization lost.

The student is a quantized checkpoint of the teacher. Its integer codes stay where RTN/GPTQ/AWQ
put them; what trains is what costs nothing at inference: each group's scales (and asymmetric
zero points), the norms and the biases (compress/distill/trainable.py, student.py).

1. Block by block (`block_steps` per layer): the teacher's and the student's hidden states run up
   the layers side by side; student layer i, fed the student's own stream (so it also learns to
   correct the layers below it), is trained so its output matches the teacher layer's output on
   the teacher's stream (normalized MSE), then both streams move up one layer.
2. End to end (`steps`): KL(teacher || student) of the next-token distributions on the training
   windows, `batch` windows a step, Adam with a constant learning rate.

Teacher logits: neither recomputed by a teacher forward every step nor cached as top-k. The block
stage leaves the teacher's last hidden states on every training window (hidden × 4 bytes a token:
2.3 KB for SmolLM2, 151 MB at 128 × 512 tokens, kept in memory and in the work folder); each step
computes the teacher's logits from them with its final norm and head alone. That costs one head
matmul instead of a whole teacher forward, and the KL is exact over the full vocabulary (top-k
would drop the tail and need k × 8 bytes a token on disk).

Resumable and deterministic: the work folder beside OUT keeps the trained tensors, Adam's state
and where the run stands (state.py); which windows a step sees depends on (seed, step) alone, so
a run killed and resumed writes the same bytes as one that was not. A NaN/inf loss stops the run
with the last good state kept there. OUT is written in the student's own format, atomically.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lowbit.compress.distill import train
from lowbit.compress.distill.layers import embed, propagate, run_layer
from lowbit.compress.distill.losses import normalized_mse
from lowbit.compress.distill.placement import Placement, make_placement
from lowbit.compress.distill.state import load_state, restore, save_state
from lowbit.compress.distill.train import NanLoss, make_optimizer, trainable
from lowbit.compress.distill.student import QuantStudent, open_student, write_student
from lowbit.compress.distill.windows import Windows, step_indices
from lowbit.compress.stats import config_hash
from lowbit.compress.workdir import WorkDir, work_dir_for
from lowbit.data.text import load_text
from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import check_output_path
from lowbit.formats.hf_files import model_dir, read_config
from lowbit.formats.resolve import resolve_model
from lowbit.runtime.device import resolve_device
from lowbit.runtime.loader import load_model
from lowbit.runtime.tokenizer import load_tokenizer

# progress(stage, done, total, loss): stage "block" (done = layers) or "distill" (done = steps)
ProgressFn = train.ProgressFn


@dataclass(slots=True)
class RecoverOptions(train.TrainOptions):
    steps: int = 100
    lr: float = 2e-4  # SmolLM2 int4, 40 steps: held-out KLD 0.0735 → 0.0691 at 2e-4, → 0.0707 at 1e-3
    block_steps: int = 20
    block_lr: float | None = None  # None: lr
    bf16: bool = False  # bf16 mixed precision of the student's matmuls (placement.py)

    def __post_init__(self) -> None:
        if self.block_steps < 0:
            raise UsageError(f"--block-steps must be >= 0, got {self.block_steps}")
        if self.block_lr is not None and not (math.isfinite(self.block_lr) and self.block_lr > 0):
            raise UsageError(f"--block-lr must be a positive number, got {self.block_lr}")
        train.check_options(self)


@dataclass(slots=True)
class RecoverJob:
    teacher_dir: Path
    teacher: torch.nn.Module
    student: QuantStudent
    windows: Windows
    options: RecoverOptions
    output: Path
    overwrite: bool
    work: WorkDir


def prepare_recover(teacher: str, data: str, student: str, output: str | Path, options: RecoverOptions,
                    overwrite: bool = False) -> RecoverJob:
    """Every input check, before any training: output path, teacher/student identity, tokenizers, text."""
    output = Path(output)
    check_output_path(output, overwrite, directory=not str(output).endswith(".gguf"))
    resolve_device(options.device)
    teacher_dir = model_dir(resolve_model(teacher))
    teacher_config = read_config(teacher_dir)
    if "quantization_config" in teacher_config:
        raise UsageError(f"teacher {teacher_dir} is quantized; the teacher is the float model the student came from")
    student_path = resolve_model(student)
    qstudent = open_student(student_path, teacher_config, teacher_dir.name)
    tokenizer = load_tokenizer(teacher_dir)
    text = load_text(data)
    _check_tokenizers(tokenizer, qstudent, text)
    windows = train.training_windows(tokenizer, text, data, options)
    max_pos = qstudent.model.config.max_position_embeddings
    if max_pos and options.seqlen > max_pos:
        raise UsageError(f"--seqlen {options.seqlen} exceeds the model's {max_pos} positions")
    fingerprint = {
        "job": "distill-recover", "teacher": config_hash(teacher_config), "student": _student_digest(qstudent),
        "block_steps": options.block_steps, "block_lr": options.block_lr or options.lr, "bf16": options.bf16,
        **train.data_fingerprint(text, options),
    }
    work = WorkDir(work_dir_for(output), fingerprint)
    model = load_model(teacher_dir, dtype=torch.float32)
    return RecoverJob(teacher_dir=teacher_dir, teacher=model, student=qstudent, windows=windows, options=options,
                      output=output, overwrite=overwrite, work=work)


def _student_digest(student: QuantStudent) -> str:
    """What the student's file says it is: its config and every module's format, plus a sum of its scales."""
    h = hashlib.sha256(str(sorted((m, qt.spec.label, qt.shape) for m, qt in student.checkpoint.qtensors.items())).encode())
    for module in sorted(student.checkpoint.qtensors):
        h.update(student.checkpoint.qtensors[module].scales.float().sum().numpy().tobytes())
    h.update(config_hash(student.checkpoint.config).encode())
    return h.hexdigest()[:16]


def _check_tokenizers(tokenizer, student: QuantStudent, text: str) -> None:
    source = student.checkpoint.source_dir
    if source is None or not (Path(source) / "tokenizer.json").is_file():
        return  # a GGUF student carries its vocabulary in the file; open_student compared its vocab_size
    theirs = load_tokenizer(source)
    probe = text[:4000]
    if tokenizer.encode(probe) != theirs.encode(probe):
        raise LowbitError(f"--student {student.path}'s tokenizer splits the text differently from the teacher's: "
                          "distillation needs the same tokens")


def heldout_kld(job: RecoverJob) -> float:
    return train.heldout_kld(job.student.model, job.teacher, job.windows, job.options.seqlen, job.options.eval_chunks)


def run_recover(job: RecoverJob, on_progress: ProgressFn | None = None) -> dict:
    began = time.perf_counter()
    opts = job.options
    placement = make_placement(opts.device, opts.bf16)
    job.teacher = placement.to(job.teacher)
    model = placement.to(job.student.model)
    ids = placement.to(job.windows.train)
    num_layers = model.config.num_hidden_layers
    params = trainable(model)
    before = heldout_kld(job)
    saved = load_state(job.work.path)
    stage, done, losses = "block", 0, []
    opt_state = None
    if saved is not None:
        restore(params, saved[0])
        stage, done, losses = saved[2]["stage"], int(saved[2]["done"]), list(saved[2].get("losses", []))
        opt_state = saved[1] if stage == "e2e" else None
        where = f"{done} of {num_layers} layers trained" if stage == "block" else f"end-to-end step {done} of {opts.steps}"
        # said at the start, as compress/workdir.py does, so a log shows why this run is quicker
        print(f"lowbit: resuming from {job.work.path}: {where}", file=sys.stderr, flush=True)
    block_losses = _block_stage(job, ids, placement, stage, done, on_progress)
    final = job.work.load_hidden("teacher")
    teacher_final = placement.to(final[0].clone())
    if stage == "block":
        done, losses = 0, []
    steps_done = train.end_to_end(
        train.trainable(model), train.logits_kl(model, job.teacher, teacher_final, ids, placement),
        windows=ids.shape[0], steps=opts.steps, lr=opts.lr, batch=opts.batch, seed=opts.seed,
        save_every=opts.save_every, work_path=job.work.path, done=done, losses=losses, opt_state=opt_state,
        on_progress=on_progress, placement=placement)
    after = heldout_kld(job)
    model.cpu()  # the writers read the trained tensors on the CPU
    write_student(job.student, job.output, overwrite=job.overwrite)
    job.work.remove()
    n_layers_trained = num_layers if opts.block_steps else 0
    return {
        "teacher": str(job.teacher_dir), "student": str(job.student.path), "output": str(job.output),
        "format": sorted({lin.spec.label for lin in job.student.linears.values()}),
        "trained": sorted({p for lin in job.student.linears.values() for p in lin.trained_parts} | {"norms", "biases"}),
        "block_steps": opts.block_steps, "steps": steps_done, "batch": opts.batch, "lr": opts.lr, "bf16": opts.bf16,
        "device": str(placement.device),
        "samples": opts.samples, "seqlen": opts.seqlen, "seed": opts.seed,
        "train_tokens": int(ids.numel()),
        "tokens_seen": (opts.block_steps * n_layers_trained + steps_done) * opts.batch * opts.seqlen,
        "block_nmse_last_layer": block_losses[-1] if block_losses else None,
        "train_kld": train.train_kld(losses), "loss_curve": [round(v, 6) for v in losses],
        "heldout_kld_before": before, "heldout_kld_after": after,
        "heldout_tokens": len(job.windows.heldout), "seconds": round(time.perf_counter() - began, 2),
        "resumed": job.work.resumed, "bytes": _bytes(job.output),
    }


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _block_stage(job: RecoverJob, ids: torch.Tensor, placement: Placement, stage: str, done: int,
                 on_progress) -> list[float]:
    """Both streams up the layers; trains layers >= `done` (stage "block"), replays the others.
    Leaves the teacher's last hidden states in the work folder (stream "teacher")."""
    opts, student, teacher = job.options, job.student.model, job.teacher
    if stage == "e2e" and job.work.load_hidden("teacher") is not None:
        return []
    num_layers = student.config.num_hidden_layers
    # the student's stream only up to the last layer that still trains (none: the teacher's pass alone)
    last = num_layers if stage == "block" and opts.block_steps else 0
    with torch.no_grad():
        h_t, h_s = embed(teacher, ids), embed(student, ids) if last else None
    losses: list[float] = []
    lr = opts.block_lr or opts.lr
    for i in range(num_layers):
        y_t = propagate(teacher, i, h_t)
        if i < last and i >= done:
            losses.append(_train_layer(job, i, h_s, y_t, lr, placement))
            save_state(job.work.path, trainable(student), None, {"stage": "block", "done": i + 1})
        if i + 1 < last:
            h_s = propagate(student, i, h_s)
        h_t = y_t
        if on_progress is not None:
            on_progress("block", i + 1, num_layers, losses[-1] if losses else None)
    job.work.save_hidden(h_t.cpu(), num_layers, stream="teacher")
    save_state(job.work.path, trainable(student), None, {"stage": "e2e", "done": 0, "losses": []})
    return losses


def _train_layer(job: RecoverJob, index: int, h_s: torch.Tensor, y_t: torch.Tensor, lr: float, placement: Placement) -> float:
    opts = job.options
    layer = job.student.model.model.layers[index]
    params = trainable(layer)
    if not params:
        return float("nan")
    optimizer = make_optimizer(params, lr)
    loss_value = float("nan")
    for step in range(opts.block_steps):
        batch = step_indices(step, opts.batch, h_s.shape[0], opts.seed, stream=1 + index)
        with placement.autocast():
            out = run_layer(job.student.model, index, h_s[batch])
        loss = normalized_mse(out.float(), y_t[batch])
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise NanLoss(f"the block loss of layer {index} became {loss_value} at step {step + 1} (--block-lr {lr} too high?): "
                          f"stopped; the last good state (layers below {index} trained) is kept in {job.work.path} and a "
                          "rerun resumes from it; nothing was written to the output")
        optimizer.zero_grad(set_to_none=True)
        placement.backward(loss)
        optimizer.step()
    with torch.no_grad():  # the layer's loss after its last step, on the last batch
        loss_value = float(normalized_mse(run_layer(job.student.model, index, h_s[batch]), y_t[batch]))
    return loss_value


def recover_options_record(options: RecoverOptions) -> dict:
    return asdict(options)
