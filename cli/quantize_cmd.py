"""`lowbit quantize MODEL --format F -o OUT`: a float checkpoint -> lowbit's native quantized checkpoint.

The work happens in lowbit.quant.pipeline.quantize_model; this module parses options and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lowbit.cli.common import console, print_json, progress
from lowbit.cli.main import app
from lowbit.errors import UsageError


@app.command("quantize")
def quantize_command(
    model: str = typer.Argument(..., help="Float model to quantize: demo name (smollm2-135m), local directory, or hub id."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory for the quantized checkpoint."),
    fmt: Optional[str] = typer.Option(
        None, "--format", "-f",
        help="Format for every Linear: int4, int4-asym, int8, int3, int2, nf4, nf4-dq, fp8, fp8-block128, mxfp4, "
        "mxfp4-roundup, nvfp4, ... (options may follow the name, e.g. int4-asym-g64). With --recipe: the format "
        "of modules no recipe rule matches.",
    ),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", "-g",
        help="Columns per scale group for --format (e.g. 32, 64, 128; -1 = one scale per output channel). "
        "Default: the format's own (int4 128, nf4 64, mxfp4 32, nvfp4 16, int8/fp8 per channel).",
    ),
    method: str = typer.Option(
        "rtn", "--method",
        help="rtn (round to nearest with searched scales), gptq, awq or awq+gptq (these need --calib or --data).",
    ),
    calib: Optional[Path] = typer.Option(
        None, "--calib", help="Calibration statistics from `lowbit calibrate` (for gptq / awq / awq+gptq)."
    ),
    data: Optional[str] = typer.Option(
        None, "--data",
        help="Calibrate sequentially on this text (demo name like wiki-calib, or a file): layer i sees the outputs "
        "of the already-quantized layers below it.",
    ),
    samples: int = typer.Option(128, "--samples", help="With --data: calibration sequences."),
    seqlen: int = typer.Option(2048, "--seqlen", help="With --data: tokens per calibration sequence."),
    seed: int = typer.Option(0, "--seed", help="With --data: seed that picks the calibration sequences."),
    recipe: Optional[Path] = typer.Option(
        None, "--recipe",
        help="YAML or JSON file of rules {pattern, format, group_size, options}; the first rule matching a module "
        "name wins, unmatched modules use --format (or stay dense). See docs/quantize.md.",
    ),
    skip: list[str] = typer.Option(
        [], "--skip", help="Keep modules matching this pattern dense (fnmatch glob, or re:REGEX). Repeatable."
    ),
    quantize_head: bool = typer.Option(
        False, "--quantize-head", help="Also quantize lm_head (refused when it is tied to the embeddings)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout."),
) -> None:
    """Quantize every decoder Linear of MODEL (layer by layer) and write lowbit's native checkpoint."""
    from lowbit.quant.pipeline import quantize_model
    from lowbit.quant.recipe import Recipe, load_recipe, single_format
    from lowbit.quant.spec import parse_spec

    if fmt is None and recipe is None:
        raise UsageError("give --format F (or a --recipe FILE)")
    if group_size is not None and fmt is None:
        raise UsageError("--group-size applies to --format; put group_size in the recipe's rules instead")
    rules = load_recipe(recipe).rules if recipe is not None else ()
    if fmt is not None:
        rules = rules + single_format(parse_spec(fmt, group_size)).rules
    plan = Recipe(tuple(rules))
    method_options = _method_options(method, calib, data, samples, seqlen, seed, output)

    # transient: an input error raised before the first layer leaves only its one line; no bar in logs/pipes
    with progress(transient=True, disable=as_json or not console.is_terminal) as bar:
        task = bar.add_task("quantizing", total=None, info="")

        def on_part(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, info=name)

        summary = quantize_model(model, plan, out_dir=output, method=method, skip=skip,
                                 quantize_head=quantize_head, overwrite=overwrite, progress=on_part,
                                 method_options=method_options)
    if as_json:
        print_json(summary.to_dict())
        return
    _print_summary(summary)


CALIBRATED_METHODS = ("gptq", "awq", "awq+gptq")


def _method_options(method, calib, data, samples, seqlen, seed, output) -> dict | None:
    if method not in CALIBRATED_METHODS:
        if calib is not None or data is not None:
            raise UsageError(f"--calib / --data go with --method gptq, awq or awq+gptq, not {method}")
        return None
    if (calib is None) == (data is None):
        raise UsageError(f"--method {method} needs exactly one of --calib STATS or --data TEXT")
    from lowbit.quant.workdir import work_dir_for

    # The work folder beside the output holds per-layer progress, so a killed run resumes.
    options: dict = {"work_dir": str(work_dir_for(output))}
    if calib is not None:
        options["calib"] = str(calib)
    else:
        options.update(data=data, samples=samples, seqlen=seqlen, seed=seed)
    return options


def _print_summary(summary) -> None:
    formats = ", ".join(f"{label} ×{count}" for label, count in summary.formats.items())
    console.print(f"quantized {summary.model} → {summary.output} with {summary.method} in {summary.seconds:.1f} s")
    console.print(f"  modules       {formats}")
    console.print(
        f"  bits/weight   {summary.linear_bits_per_weight:.3f} over the Linears ({summary.linear_params / 1e6:.1f} M weights), "
        f"{summary.bits_per_weight:.3f} overall ({summary.params / 1e6:.1f} M)"
    )
    ratio = summary.bytes_before / max(1, summary.bytes_after)
    console.print(
        f"  size          {summary.bytes_before / 1e6:.1f} MB → {summary.bytes_after / 1e6:.1f} MB ({ratio:.2f}× smaller)"
    )
    for note in summary.notes:
        console.print(f"  note: {note}")
