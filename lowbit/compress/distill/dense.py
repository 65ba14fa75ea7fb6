"""`lowbit distill TEACHER --data TEXT (--student-layers N | --drop-layers LIST | --student MODEL) -o OUT`:
a float student, every weight trained on the teacher's logits.

The student is the teacher with layers removed (shrink.py: by measured importance, the ranking
printed) or any float model with the teacher's tokenizer. It trains end to end on
KL(teacher || student) (train.py), with the teacher's logits made from its cached last hidden
states, and is written as an ordinary Hugging Face directory in the student's stored dtype
(config.json, model.safetensors, tokenizer files) that lowbit, transformers and `lowbit quantize`
read like any model. Resumable and deterministic as the quantized recovery is (recover.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.compress.distill import train
from lowbit.compress.distill.placement import make_placement
from lowbit.compress.distill.shrink import cut_teacher, layers_to_drop, parse_layer_list
from lowbit.compress.distill.state import load_state, restore
from lowbit.compress.distill.windows import Windows
from lowbit.compress.stats import config_hash
from lowbit.compress.workdir import WorkDir, work_dir_for
from lowbit.data.text import load_text
from lowbit.errors import LowbitError, UsageError
from lowbit.formats.atomic import atomic_dir, check_output_path
from lowbit.formats.checkpoint import copy_side_files
from lowbit.formats.foreign import detect_checkpoint_kind
from lowbit.formats.hf_files import model_dir, read_config, weight_files
from lowbit.formats.resolve import resolve_model
from lowbit.runtime.device import resolve_device
from lowbit.runtime.loader import load_model
from lowbit.runtime.tokenizer import load_tokenizer


@dataclass(slots=True)
class DenseOptions(train.TrainOptions):
    steps: int = 200
    lr: float = 1e-4
    student_layers: int | None = None
    drop_layers: str | None = None
    bf16: bool = False  # bf16 mixed precision of the student's matmuls (placement.py)

    def __post_init__(self) -> None:
        train.check_options(self)
        if self.student_layers is not None and self.drop_layers is not None:
            raise UsageError("give --student-layers or --drop-layers, not both")


@dataclass(slots=True)
class DenseJob:
    teacher_dir: Path
    teacher: torch.nn.Module
    student_dir: Path | None  # None: cut from the teacher (shrink.py)
    windows: Windows
    options: DenseOptions
    output: Path
    overwrite: bool
    work: WorkDir


def prepare_dense(teacher: str, data: str, output: str | Path, options: DenseOptions, student: str | None = None,
                  overwrite: bool = False) -> DenseJob:
    """Every input check before any training (output, device, tokenizer and vocabulary, text, layer choice)."""
    output = Path(output)
    resolve_device(options.device)
    check_output_path(output, overwrite)
    teacher_dir = model_dir(resolve_model(teacher))
    teacher_config = read_config(teacher_dir)
    if "quantization_config" in teacher_config:
        raise UsageError(f"teacher {teacher_dir} is quantized; distill from the float model")
    tokenizer = load_tokenizer(teacher_dir)
    text = load_text(data)
    student_dir = None
    if student is not None:
        student_dir = model_dir(resolve_model(student))
        _check_student(student_dir, teacher_config, tokenizer, text)
    elif options.student_layers is None and options.drop_layers is None:
        raise UsageError("give --student QCKPT/MODEL, --student-layers N or --drop-layers LIST")
    layers = int(teacher_config.get("num_hidden_layers", 0))
    if options.drop_layers is not None:
        parse_layer_list(options.drop_layers, layers)
    if options.student_layers is not None:
        layers_to_drop([0.0] * layers, options.student_layers)  # the range check, before any work
    windows = train.training_windows(tokenizer, text, data, options)
    fingerprint = {
        "job": "distill-dense", "teacher": config_hash(teacher_config),
        "student": None if student_dir is None else _files_digest(student_dir),
        "student_layers": options.student_layers, "drop_layers": options.drop_layers,
        "bf16": options.bf16, **train.data_fingerprint(text, options),
    }
    work = WorkDir(work_dir_for(output), fingerprint)
    model = load_model(teacher_dir, dtype=torch.float32)
    return DenseJob(teacher_dir=teacher_dir, teacher=model, student_dir=student_dir, windows=windows, options=options,
                    output=output, overwrite=overwrite, work=work)


def _check_student(student_dir: Path, teacher_config: dict, tokenizer, text: str) -> None:
    kind = detect_checkpoint_kind(student_dir)
    if kind != "hf":
        raise LowbitError(f"--student {student_dir} is a {kind} checkpoint; a float student is a Hugging Face directory")
    config = read_config(student_dir)
    if config.get("vocab_size") != teacher_config.get("vocab_size"):
        raise LowbitError(f"--student {student_dir} has a vocabulary of {config.get('vocab_size')} tokens, the teacher "
                          f"{teacher_config.get('vocab_size')}: distillation needs the teacher's tokenizer")
    if not (student_dir / "tokenizer.json").is_file():
        raise LowbitError(f"--student {student_dir} has no tokenizer.json to compare with the teacher's")
    probe = text[:4000]
    if load_tokenizer(student_dir).encode(probe) != tokenizer.encode(probe):
        raise LowbitError(f"--student {student_dir}'s tokenizer splits the text differently from the teacher's: "
                          "distillation needs the same tokens")


def _files_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for file in weight_files(directory):
        stat = file.stat()
        h.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(config_hash(read_config(directory)).encode())
    return h.hexdigest()[:16]


def _stored_dtype(directory: Path) -> torch.dtype:
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                dtype = f.get_slice(name).get_dtype()
                return {"BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
    return torch.float32


def run_dense(job: DenseJob, on_progress: train.ProgressFn | None = None) -> dict:
    began = time.perf_counter()
    opts = job.options
    placement = make_placement(opts.device, opts.bf16)
    job.teacher = placement.to(job.teacher)
    ids = placement.to(job.windows.train)
    teacher_final, importance = train.teacher_pass(
        job.teacher, ids, None if on_progress is None else lambda d, t: on_progress("teacher", d, t, None))
    dropped: list[int] = []
    source = job.student_dir
    if source is None:
        layers = len(importance)
        dropped = (parse_layer_list(opts.drop_layers, layers) if opts.drop_layers is not None
                   else layers_to_drop(importance, opts.student_layers))
        source = job.work.path / "initial"
        if not (source / "config.json").is_file():
            cut_teacher(job.teacher_dir, dropped, source)
    student = placement.to(load_model(source, dtype=torch.float32))
    student.requires_grad_(True)
    student.train()
    before = train.heldout_kld(student, job.teacher, job.windows, opts.seqlen, opts.eval_chunks)
    saved = load_state(job.work.path)
    done, losses, opt_state = 0, [], None
    if saved is not None and saved[2].get("stage") == "e2e":
        restore(train.trainable(student), saved[0])
        done, losses, opt_state = int(saved[2]["done"]), list(saved[2]["losses"]), saved[1]
        print(f"lowbit: resuming from {job.work.path}: end-to-end step {done} of {opts.steps}", file=sys.stderr, flush=True)
    steps = train.end_to_end(train.trainable(student), train.logits_kl(student, job.teacher, teacher_final, ids, placement),
                             windows=ids.shape[0], steps=opts.steps, lr=opts.lr, batch=opts.batch, seed=opts.seed,
                             save_every=opts.save_every, work_path=job.work.path, done=done, losses=losses,
                             opt_state=opt_state, on_progress=on_progress, placement=placement)
    after = train.heldout_kld(student, job.teacher, job.windows, opts.seqlen, opts.eval_chunks)
    write_hf(student, source, job.output, job.overwrite)
    job.work.remove()
    ranking = sorted(range(len(importance)), key=lambda i: (importance[i], -i))
    return {
        "teacher": str(job.teacher_dir), "student": str(job.student_dir) if job.student_dir else None,
        "output": str(job.output), "layers": student.config.num_hidden_layers, "dropped_layers": dropped,
        "importance": [{"layer": i, "importance": importance[i]} for i in ranking],
        "steps": steps, "batch": opts.batch, "lr": opts.lr, "bf16": opts.bf16, "device": str(placement.device),
        "samples": opts.samples, "seqlen": opts.seqlen,
        "seed": opts.seed, "train_tokens": int(ids.numel()), "tokens_seen": steps * opts.batch * opts.seqlen,
        "train_kld": train.train_kld(losses), "loss_curve": [round(v, 6) for v in losses],
        "heldout_kld_before": before, "heldout_kld_after": after,
        "heldout_tokens": len(job.windows.heldout), "seconds": round(time.perf_counter() - began, 2),
        "resumed": job.work.resumed,
        "bytes": sum(f.stat().st_size for f in job.output.rglob("*") if f.is_file()),
    }


def write_hf(model, source: Path, output: Path, overwrite: bool) -> None:
    """The trained model as a Hugging Face directory in the source's stored dtype, atomically."""
    dtype = _stored_dtype(source)
    config = read_config(source)
    state = {}
    for name, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if not torch.isfinite(tensor).all():
            raise LowbitError(f"trained weight {name} holds NaN/inf; nothing written")
        state[name] = tensor.detach().to("cpu", dtype).contiguous()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with atomic_dir(output, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(source, tmp)
