"""`lowbit calibrate`: layer-by-layer statistics of every Linear input → a STATS file.

The work happens in lowbit.compress.calibrate; this module parses options and prints.
"""

from __future__ import annotations

from typing import Optional

import typer

from lowbit.cli.common import THREADS_OPTION, apply_threads, console, expert_tokens_line, print_json, progress
from lowbit.cli.main import app


@app.command("calibrate")
def calibrate_command(
    model: str = typer.Argument(..., help="Float model: demo name (smollm2-135m), local directory, or hub id."),
    data: str = typer.Option(..., "--data", help="Calibration text: demo name (wiki-calib, shakespeare) or a UTF-8 file."),
    samples: int = typer.Option(128, "--samples", help="Number of token windows drawn from the text (without overlap)."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Tokens per window (BOS included when the tokenizer adds one; at "
                               "most the model's max_position_embeddings; --samples x --seqlen must fit in memory)."),
    seed: int = typer.Option(0, "--seed", help="Seed that picks the windows; same seed and inputs give the same bytes."),
    sink_weight: Optional[float] = typer.Option(
        None, "--sink-weight", metavar="W",
        help="How many tokens the first position of each window counts for in the statistics (it is the attention sink, which every later token reads). Default: seqlen / 32, at least 1 (16 for 512-token windows).",
    ),
    routed_experts: bool = typer.Option(False, "--routed-experts", help="Mixture-of-experts models: give each expert statistics from only the tokens the router sends it; an expert "
        "that gets none is quantized with RTN (a note says which). By default every calibration token also runs "
        "through every expert for the statistics (the layer's output still sums only the routed experts), so "
        "rarely routed experts are calibrated too."),
    output: str = typer.Option(..., "-o", "--output", help="STATS file to write (safetensors); reusable by any `lowbit quantize`."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object on stdout."),
) -> None:
    """Run MODEL one decoder layer at a time over calibration text and record, for every Linear
    input, the Hessian Σxxᵀ/n and the per-channel mean |x|, mean x² and max |x|. A killed run resumes when rerun."""

    from lowbit.formats.atomic import check_output_path
    from lowbit.compress.calibrate import calibrate, prepare_calibration

    apply_threads(threads)
    from pathlib import Path

    check_output_path(Path(output), overwrite, directory=False)
    from lowbit.compress.pipeline import check_calibration_windows
    from lowbit.formats.hf_files import model_dir, read_config
    from lowbit.formats.resolve import resolve_model

    # from config.json alone, before the text is read or any activation allocated
    source = model_dir(resolve_model(model))
    check_calibration_windows(read_config(source), samples, seqlen, sink_weight=sink_weight, name=source.name)
    with console.status("loading model and text"):
        inputs = prepare_calibration(model, data, samples=samples, seqlen=seqlen, seed=seed, sink_weight=sink_weight,
                                     all_experts=not routed_experts)
    with progress() as bar:
        task = bar.add_task("calibrate", total=inputs.model.num_layers, info="")

        def on_layer(done: int, total: int, replayed: bool) -> None:
            bar.update(task, completed=done, info="resuming" if replayed else f"layer {done - 1}")

        summary = calibrate(inputs, output, overwrite=overwrite, on_layer=on_layer)
    if as_json:
        print_json(summary)
    else:
        console.print(
            f"calibrated {summary['model']} on {summary['tokens']} tokens ({summary['samples']} x {summary['seqlen']}) "
            f"of {summary['data']}: {summary['sites']} input sites in {summary['layers']} layers, "
            f"{summary['bytes'] / 1e6:.1f} MB → {summary['output']} in {summary['seconds']:.1f} s"
        )
        if "expert_tokens" in summary:
            console.print(f"experts: {expert_tokens_line(summary['expert_tokens'])}")
