"""`lowbit eval`: perplexity (llama-perplexity's method) and KL divergence against a base model."""

from __future__ import annotations

from typing import Optional

import typer

from lowbit.cli.common import THREADS_OPTION, apply_threads, console, print_json, progress
from lowbit.cli.kernel_options import DENSE_ACTIVATIONS_OPTION, INT4_ACTIVATIONS_OPTION, INT8_ACTIVATIONS_OPTION, KERNEL_OPTION, kernel_line, kernel_settings, kernel_summary
from lowbit.cli.main import app


@app.command("eval")
def eval_command(
    model: str = typer.Argument(..., help="Model to evaluate: demo name (smollm2-135m), local directory, or hub id."),
    data: str = typer.Option(..., "--data", help="Text: demo name (wiki-eval, wiki-calib, shakespeare) or a UTF-8 file."),
    ctx: int = typer.Option(2048, "--ctx", help="Tokens per chunk (even). Only the second half of each chunk is scored."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate at most this many chunks (windows with --stride)."),
    stride: Optional[int] = typer.Option(
        None, "--stride", help="Sliding-window mode: windows of --ctx tokens every S tokens, each scoring only new tokens."
    ),
    base: Optional[str] = typer.Option(
        None, "--base", help="Base model to compare against on the same chunks: adds KL divergence, same-top %, RMS Δp."
    ),
    early_exit: Optional[str] = typer.Option(
        None, "--early-exit", help="Exit layers, e.g. 12,20: each position takes the first exit (final norm + head "
        "on that layer's hidden state) whose confidence is above --exit-threshold. KLD is against the full model "
        "itself unless --base is given. See docs/early_exit.md."),
    exit_threshold: float = typer.Option(1.0, "--exit-threshold", help="Exit confidence threshold in [0, 1] "
                                         "(1 = never exit: the full model)."),
    exit_confidence: str = typer.Option("top1", "--exit-confidence", help="top1 (top-1 probability) or margin "
                                        "(top-1 minus top-2 probability); for --early-exit and --cascade."),
    cascade: Optional[str] = typer.Option(
        None, "--cascade", help="Token cascade: a cheap model (same tokenizer, or self:int4 for MODEL's own weights in "
        "int4) answers each position whose confidence is above --cascade-threshold, MODEL the rest. KLD is against "
        "MODEL itself unless --base is given. See docs/early_exit.md."),
    cascade_threshold: float = typer.Option(0.9, "--cascade-threshold", help="Cascade confidence threshold in [0, 1] "
                                            "(1 = never the cheap model)."),
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32 (default, needed for small KLDs) or bf16 (float32, bfloat16 mean the same)."),
    device: str = typer.Option("auto", "--device", help="auto (the first CUDA device when torch sees one, else "
                               "the CPU), cpu, cuda or cuda:N."),
    kernel: Optional[str] = KERNEL_OPTION,
    int4_activations: Optional[str] = INT4_ACTIVATIONS_OPTION,
    dense_activations: Optional[str] = DENSE_ACTIVATIONS_OPTION,
    int8_activations: Optional[str] = INT8_ACTIVATIONS_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Perplexity of MODEL on a text, comparable with llama.cpp's llama-perplexity; KLD with --base.
    --kernel, --int4-activations and --int8-activations apply to the quantized layers of MODEL and of --base."""
    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.evaluate import prepare, run

    from lowbit.runtime.early_exit import check_confidence, check_threshold, wrap_eval_job

    apply_threads(threads)
    settings = kernel_settings(kernel, int4_activations, dense_activations, int8_activations)
    if early_exit is not None and cascade is not None:
        from lowbit.errors import UsageError

        raise UsageError("--early-exit and --cascade do not combine: price one at a time")
    if early_exit is not None:  # before any loading
        check_threshold(exit_threshold)
        check_confidence(exit_confidence)
    if cascade is not None:
        check_threshold(cascade_threshold, "--cascade-threshold")
        check_confidence(exit_confidence)
    with use_settings(settings):
        with console.status("loading model and text"):
            job = prepare(model, data, ctx=ctx, chunks=chunks, stride=stride, base=base, dtype=dtype, device=device)
        kernels = kernel_summary(job.model)
        early = wrap_eval_job(job, early_exit, exit_threshold, exit_confidence) if early_exit is not None else None
        if cascade is not None:
            from lowbit.runtime.cascade import wrap_eval_job as wrap_cascade

            with console.status("loading the cascade's cheap model"):
                cheap = wrap_cascade(job, cascade, cascade_threshold, exit_confidence)
    with progress() as bar:
        task = bar.add_task("eval", total=len(job.windows), info="")

        def on_window(done: int, total: int, running_ppl: float) -> None:
            bar.update(task, completed=done, info=f"PPL {running_ppl:.4f}")

        report = run(job, on_window)

    exits = None
    if early is not None:
        exits = {"layers": list(early.settings.layers), "threshold": early.settings.threshold,
                 "confidence": early.settings.confidence, "adapted_layers": sorted(early.head.adapters),
                 **early.stats.as_dict()}
    cascaded = None
    if cascade is not None:
        cascaded = {"cheap": cascade, "threshold": cheap.settings.threshold, "confidence": cheap.settings.confidence,
                    **cheap.stats.as_dict()}
    if as_json:
        print_json({**_as_json(report), **({"early_exit": exits} if exits else {}),
                    **({"cascade": cascaded} if cascaded else {}), "kernels": kernels})
    else:
        _print_summary(report)
        if exits:
            rates = ", ".join(f"{k}: {100 * v:.1f} %" for k, v in exits["exit_rate"].items())
            console.print(f"early exit ({exits['confidence']} > {exits['threshold']}): {rates}; "
                          f"{exits['mean_layers']:.2f} of {exits['num_layers']} layers per token")
        if cascaded:
            console.print(f"cascade ({cascaded['confidence']} > {cascaded['threshold']}): {cascade} answered "
                          f"{100 * cascaded['cheap_rate']:.1f} % of positions, {model} {100 * cascaded['full_rate']:.1f} %")
        line = kernel_line(kernels)
        if line:
            console.print(line)


def _as_json(report) -> dict:
    result = report.result
    out = {
        "model": report.model,
        "data": report.data,
        "dtype": report.dtype,
        "device": report.device,
        "mode": result.mode,
        "ctx": result.ctx,
        "stride": result.stride,
        "chunks": result.windows,
        "tokens_total": result.tokens_total,
        "tokens_scored": result.tokens_scored,
        "ppl": result.ppl,
        "ppl_err": result.ppl_err,
    }
    if result.kld is not None:
        k = result.kld
        out["base"] = report.base
        out["kld"] = {
            "mean": k.mean,
            "err": k.err,
            "p99": k.p99,
            "p999": k.p999,
            "median": k.median,
            "max": k.max,
            "same_top_pct": k.same_top_pct,
            "same_top_err_pct": k.same_top_err_pct,
            "rms_dp_pct": k.rms_dp_pct,
            "rms_dp_err_pct": k.rms_dp_err_pct,
            "base_ppl": k.base_ppl,
            "base_ppl_err": k.base_ppl_err,
            "ppl_ratio": k.ppl_ratio,
        }
    out["timings"] = {"load_s": report.load_s, "eval_s": result.eval_s, "tokens_per_s": result.tokens_per_s}
    return out


def _print_summary(report) -> None:
    r = report.result
    windows = f"{r.windows} windows, stride {r.stride}" if r.mode == "stride" else f"{r.windows} chunks"
    console.print(f"[bold]{report.model}[/] on [bold]{report.data}[/]: ctx {r.ctx}, {windows}, {r.tokens_scored} tokens scored ({report.dtype})")
    console.print(f"PPL = [bold]{r.ppl:.4f}[/] ± {r.ppl_err:.4f}")
    if r.kld is not None:
        k = r.kld
        console.print(f"vs base [bold]{report.base}[/]: base PPL {k.base_ppl:.4f} ± {k.base_ppl_err:.4f}, PPL ratio {k.ppl_ratio:.5f}")
        console.print(f"  mean KLD     {k.mean:.6f} ± {k.err:.6f}")
        console.print(f"  99.0% KLD    {k.p99:.6f}")
        console.print(f"  99.9% KLD    {k.p999:.6f}")
        console.print(f"  same top     {k.same_top_pct:.3f} ± {k.same_top_err_pct:.3f} %")
        console.print(f"  RMS Δp       {k.rms_dp_pct:.3f} ± {k.rms_dp_err_pct:.3f} %")
    console.print(f"load {report.load_s:.1f} s, eval {r.eval_s:.1f} s ({r.tokens_per_s:.0f} tokens/s)")
