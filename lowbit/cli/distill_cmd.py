"""`lowbit distill`: train a student on a teacher's outputs (lowbit.compress.distill does the work)."""

from __future__ import annotations

from typing import Optional

import typer

from lowbit.cli.common import THREADS_OPTION, apply_threads, console, print_json, progress
from lowbit.cli.main import app


@app.command("distill")
def distill_command(
    teacher: str = typer.Argument(..., help="Float teacher model: demo name (smollm2-135m), local directory, or hub id."),
    data: str = typer.Option(..., "--data", help="Training text: demo name (wiki-calib, shakespeare) or a UTF-8 file."),
    student: Optional[str] = typer.Option(None, "--student", metavar="MODEL", help="A quantized checkpoint of TEACHER (from `lowbit quantize`, "
                                          "or GPTQ/AWQ/compressed-tensors/GGUF): its scales, norms and biases train and OUT "
                                          "keeps its format and bits. Or a float model with TEACHER's tokenizer: every weight trains."),
    student_layers: Optional[int] = typer.Option(None, "--student-layers", metavar="N", help="Student = TEACHER with only its N "
                                                 "most important layers (1 - cos(input, output) on the windows; the ranking is printed); every weight trains; OUT is a Hugging Face directory."),
    drop_layers: Optional[str] = typer.Option(None, "--drop-layers", metavar="LIST", help="Student = TEACHER without these layers "
                                              "(e.g. 3,5,20-24); otherwise as --student-layers."),
    exit_layers: Optional[str] = typer.Option(None, "--exit-layers", metavar="LIST", help="Train early-exit adapters at these "
                                              "layers (e.g. 12,20) instead of a student: each exit's logits learn the full model's; "
                                              "OUT is TEACHER with exit_adapters.safetensors beside it, which --early-exit and "
                                              "--draft self:layers=N use (docs/early_exit.md)."),
    exit_rank: int = typer.Option(64, "--exit-rank", metavar="N", help="Rank of each exit adapter (x + up(down(x)))."),
    output: str = typer.Option(..., "-o", "--output", help="Output checkpoint (a directory; a .gguf file for a GGUF student)."),
    steps: Optional[int] = typer.Option(None, "--steps", metavar="N", help="End-to-end steps on KL(teacher || student); 0 skips "
                                        "the stage. Default: 100 for a quantized student, 200 for a float one or exit adapters."),
    block_steps: Optional[int] = typer.Option(None, "--block-steps", metavar="N", help="Quantized student: steps per decoder layer "
                                              "of the block-wise stage (each layer's output matched to the teacher's); 0 skips it. Default 20."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Adam learning rate. Default: 2e-4 for a quantized student (its scales "
                                       "train as multipliers of their stored values, so 2e-4 moves a scale about 0.02 % a step), 1e-4 for a float one, "
                                       "1e-3 for exit adapters."),
    block_lr: Optional[float] = typer.Option(None, "--block-lr", help="Learning rate of the block-wise stage (default: --lr)."),
    samples: int = typer.Option(32, "--samples", metavar="N", help="Training windows drawn from the text (without overlap); "
                                "steps cycle through them, a fresh order each pass."),
    seqlen: int = typer.Option(512, "--seqlen", metavar="N", help="Tokens per window (BOS included when the tokenizer adds one)."),
    batch: int = typer.Option(1, "--batch", metavar="N", help="Windows per step."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the windows and their order; same seed and inputs give the same bytes."),
    save_every: int = typer.Option(25, "--save-every", metavar="N", help="Save the resumable state every N end-to-end steps "
                                   "(each layer of the block stage is saved too); a killed run resumes when rerun."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Held-out text for the KLD before/after (default: the "
                                            "tail of --data, which training never sees)."),
    eval_chunks: int = typer.Option(4, "--eval-chunks", metavar="N", help="Held-out windows of --seqlen tokens (second half scored, as `lowbit eval`)."),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast of the student's matmuls (losses stay float32): about 1.8x "
                              "faster a step on a CPU with AVX512-BF16; a different, still deterministic, result."),
    device: str = typer.Option("auto", "--device", metavar="auto|cpu|cuda[:N]", help="Where to train, through accelerate: auto "
                               "takes the first CUDA device torch sees, else the CPU. With --bf16, accelerate's bf16 mixed "
                               "precision on that device."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already exists."),
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout."),
) -> None:
    """Train a student on TEACHER's outputs. With a quantized --student: win back what quantization
    lost (its scales, zero points, norms and biases train, its integer codes stay; block by block,
    then end to end on the KL divergence of the logits); OUT has the student's format and bits.
    With --student-layers / --drop-layers (a cut of TEACHER) or a float --student: every weight
    trains on the KL divergence; OUT is a Hugging Face directory. A killed run resumes when rerun."""
    apply_threads(threads)
    if exit_layers is not None:
        if student is not None or student_layers is not None or drop_layers is not None or block_steps is not None or block_lr is not None or bf16:
            from lowbit.errors import UsageError

            raise UsageError("--exit-layers trains adapters on TEACHER itself: it does not combine with --student, "
                             "--student-layers, --drop-layers, --block-steps, --block-lr or --bf16")
        summary = _exits(teacher, data, exit_layers, exit_rank, output, steps, lr, samples, seqlen, batch, seed, save_every,
                         eval_chunks, eval_data, overwrite, device=device)
        if as_json:
            print_json(summary)
        else:
            for layer, after in summary["heldout_after"].items():
                before = summary["heldout_before"][layer]
                console.print(f"exit {layer}: held-out KLD to the full model {before['kld']:.3f} → {after['kld']:.3f}, "
                              f"same top {before['same_top_pct']:.1f} % → {after['same_top_pct']:.1f} %")
            console.print(f"trained {len(summary['exit_layers'])} exit adapter(s) (rank {summary['rank']}) on "
                          f"{summary['train_tokens']} tokens of {data}, {summary['steps']} steps → {summary['output']} "
                          f"in {summary['seconds']:.0f} s")
        return
    quantized = student is not None and student_layers is None and drop_layers is None and _is_quantized(student)
    if quantized:
        summary = _recover(teacher, data, student, output, steps, block_steps, lr, block_lr, samples, seqlen, batch, seed,
                           save_every, eval_chunks, eval_data, overwrite, bf16, device=device)
    else:
        if block_steps is not None or block_lr is not None:
            from lowbit.errors import UsageError

            raise UsageError("--block-steps and --block-lr apply to a quantized --student only")
        summary = _dense(teacher, data, student, student_layers, drop_layers, output, steps, lr, samples, seqlen, batch,
                         seed, save_every, eval_chunks, eval_data, overwrite, bf16, device=device)
    if "importance" in summary:
        ranking = ", ".join(f"{r['layer']} {r['importance']:.4f}" for r in summary["importance"])
        console.print(f"layer importance (1 - cos(input, output)), least first: {ranking}")
        if summary["dropped_layers"]:
            console.print(f"dropped layers {summary['dropped_layers']}: the student has {summary['layers']}")
    if as_json:
        print_json(summary)
    else:
        console.print(
            f"distilled {summary['student'] or 'a ' + str(summary['layers']) + '-layer cut of ' + summary['teacher']} on "
            f"{summary['train_tokens']} tokens of {data}: "
            + (f"{summary['block_steps']} steps a layer, then " if quantized else "")
            + f"{summary['steps']} end to end; held-out KLD {summary['heldout_kld_before']:.4f} → "
            f"{summary['heldout_kld_after']:.4f} → {summary['output']} ({summary['bytes'] / 1e6:.1f} MB) in {summary['seconds']:.0f} s"
        )


def _is_quantized(student: str) -> bool:
    from lowbit.formats.foreign import detect_checkpoint_kind
    from lowbit.formats.resolve import resolve_model

    return detect_checkpoint_kind(resolve_model(student)) != "hf"


def _bar_callback(bar):
    tasks: dict[str, int] = {}
    names = {"block": "block-wise", "teacher": "teacher pass", "distill": "end-to-end"}

    def on_progress(stage: str, done: int, total: int, loss: float | None) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(names[stage], total=total, info="")
        what = "nmse" if stage == "block" else "KL"
        bar.update(tasks[stage], completed=done, info="" if loss is None else f"{what} {loss:.4f}")

    return on_progress


def _recover(teacher, data, student, output, steps, block_steps, lr, block_lr, samples, seqlen, batch, seed, save_every,
             eval_chunks, eval_data, overwrite, bf16, device="auto") -> dict:
    from lowbit.compress.distill.recover import RecoverOptions, prepare_recover, run_recover

    options = RecoverOptions(steps=100 if steps is None else steps, block_steps=20 if block_steps is None else block_steps,
                             lr=2e-4 if lr is None else lr, block_lr=block_lr, samples=samples, seqlen=seqlen, batch=batch,
                             seed=seed, save_every=save_every, eval_chunks=eval_chunks, eval_data=eval_data, bf16=bf16,
                             device=device)
    with console.status("loading teacher, student and text"):
        job = prepare_recover(teacher, data, student, output, options, overwrite=overwrite)
    with progress() as bar:
        return run_recover(job, _bar_callback(bar))


def _exits(teacher, data, layers, rank, output, steps, lr, samples, seqlen, batch, seed, save_every, eval_chunks, eval_data,
           overwrite, device="auto") -> dict:
    from lowbit.compress.distill.exits import ExitOptions, prepare_exits, run_exits

    options = ExitOptions(layers=layers, rank=rank, steps=200 if steps is None else steps, lr=1e-3 if lr is None else lr,
                          samples=samples, seqlen=seqlen, batch=batch, seed=seed, save_every=save_every,
                          eval_chunks=eval_chunks, eval_data=eval_data, device=device)
    with console.status("loading teacher and text"):
        job = prepare_exits(teacher, data, output, options, overwrite=overwrite)
    with progress() as bar:
        return run_exits(job, _bar_callback(bar))


def _dense(teacher, data, student, student_layers, drop_layers, output, steps, lr, samples, seqlen, batch, seed, save_every,
           eval_chunks, eval_data, overwrite, bf16, device="auto") -> dict:
    from lowbit.compress.distill.dense import DenseOptions, prepare_dense, run_dense

    if student is not None and (student_layers is not None or drop_layers is not None):
        from lowbit.errors import UsageError

        raise UsageError("--student-layers / --drop-layers cut the teacher; they do not combine with --student")
    options = DenseOptions(steps=200 if steps is None else steps, lr=1e-4 if lr is None else lr, samples=samples,
                           seqlen=seqlen, batch=batch, seed=seed, save_every=save_every, eval_chunks=eval_chunks,
                           eval_data=eval_data, student_layers=student_layers, drop_layers=drop_layers, bf16=bf16,
                           device=device)
    with console.status("loading teacher and text"):
        job = prepare_dense(teacher, data, output, options, student=student, overwrite=overwrite)
    with progress() as bar:
        return run_dense(job, _bar_callback(bar))
