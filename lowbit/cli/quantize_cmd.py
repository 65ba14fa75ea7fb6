"""`lowbit quantize MODEL --format F -o OUT`: a float checkpoint -> lowbit's native quantized checkpoint.

The work happens in lowbit.compress.pipeline.quantize_model; this module parses options and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lowbit.cli.common import THREADS_OPTION, apply_threads, console, expert_tokens_line, print_json, progress
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
        help="Columns per scale group for --format (e.g. 32, 64, 128; -1 = one scale per output channel; a group "
        "need not divide the columns, the last one is narrower). "
        "Default: the format's own (int4 128, nf4 64, mxfp4 32, nvfp4 16, int8/fp8 per channel).",
    ),
    method: str = typer.Option(
        "rtn", "--method",
        help="rtn (round to nearest with searched scales), gptq, awq or awq+gptq (these need --calib or --data; "
        "so does rtn with --keep-outliers / --keep-channels).",
    ),
    calib: Optional[Path] = typer.Option(
        None, "--calib", help="Calibration statistics from `lowbit calibrate` (for gptq / awq / awq+gptq, and for --keep-outliers)."
    ),
    data: Optional[str] = typer.Option(
        None, "--data",
        help="Calibrate sequentially on this text (demo name like wiki-calib, or a file): layer i sees the outputs "
        "of the already-quantized layers below it.",
    ),
    samples: int = typer.Option(128, "--samples", help="With --data: calibration sequences."),
    seqlen: int = typer.Option(2048, "--seqlen", help="With --data: tokens per calibration sequence (at most the "
                               "model's max_position_embeddings; --samples x --seqlen must fit in memory)."),
    seed: int = typer.Option(0, "--seed", help="With --data: seed that picks the calibration sequences."),
    sink_weight: Optional[float] = typer.Option(
        None, "--sink-weight", metavar="W",
        help="With --data: " + "How many tokens the first position of each window counts for in the statistics (it is the attention sink, which every later token reads). Default: seqlen / 32, at least 1 (16 for 512-token windows).",
    ),
    routed_experts: bool = typer.Option(
        False, "--routed-experts",
        help="With --data: " + "Mixture-of-experts models: give each expert statistics from only the tokens the router sends it; an expert "
        "that gets none is quantized with RTN (a note says which). By default every calibration token also runs "
        "through every expert for the statistics (the layer's output still sums only the routed experts), so "
        "rarely routed experts are calibrated too.",
    ),
    refit_rounds: int = typer.Option(
        1, "--refit-rounds", metavar="N",
        help="GPTQ: after choosing the codes, refit each group's scale by least squares on the calibration Hessian "
        "and run GPTQ again with those scales, N times; every row keeps whichever result has the least output error "
        "(int, nf4, fp8 per-channel and nvfp4 scales). 0 turns it off; each round costs one more GPTQ pass.",
    ),
    float_target: bool = typer.Option(
        False, "--float-target",
        help="GPTQ with --data: match each Linear's outputs to the float model's, not to the float layer's on the "
        "quantized model's inputs, so each layer also corrects the error of the layers below (asymmetric "
        "calibration, as in GPTAQ). Runs the float model beside the quantized one: about twice the time.",
    ),
    keep_outliers: float = typer.Option(
        0.0, "--keep-outliers", metavar="P",
        help="Keep the P % most salient weights of every quantized Linear in bf16, in a sparse side matrix added "
        "back at inference (48 bits each, counted in bits/weight; 0.5 adds 0.24 bits/weight). Needs --calib or --data.",
    ),
    keep_channels: float = typer.Option(
        0.0, "--keep-channels", metavar="P",
        help="Also keep whole input channels in bf16: the P % of columns with the largest E(x²)·‖W[:, k]‖² "
        "(same side matrix). Needs --calib or --data.",
    ),
    outlier_salience: str = typer.Option(
        "error", "--outlier-salience",
        help="How --keep-outliers ranks weights: act = |w|·sqrt(E(x²)); hessian = w² / (H⁻¹)kk (OBS); error = how much "
        "its group's rounding error drops when it leaves the group (picks the weights that stretch a group's range).",
    ),
    recipe: Optional[Path] = typer.Option(
        None, "--recipe",
        help="YAML or JSON file of rules {pattern, format, group_size, options}; the first rule matching a module "
        "name wins, unmatched modules use --format (or stay dense). See docs/quantize.md.",
    ),
    skip: list[str] = typer.Option(
        [], "--skip", help="Keep modules matching this pattern dense (fnmatch glob, or re:REGEX). Repeatable."
    ),
    quantize_head: bool = typer.Option(
        False, "--quantize-head", help="Also quantize lm_head. A head tied to the embeddings stays tied: "
        "the matrix is quantized once and the embedding rows are read from it (a recipe rule for lm_head "
        "picks its format, e.g. int8)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already exists."),
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object on stdout."),
) -> None:
    """Quantize every decoder Linear of MODEL (layer by layer) and write lowbit's native checkpoint."""
    from lowbit.compress.methods import get_method
    from lowbit.compress.options import CalibrationSource, GptqOptions, MethodOptions, OutlierOptions
    from lowbit.compress.pipeline import quantize_model
    from lowbit.compress.recipe import Recipe, load_recipe, single_format
    from lowbit.compress.workdir import work_dir_for
    from lowbit.formats.atomic import check_output_path
    from lowbit.quant.spec import parse_spec

    apply_threads(threads)
    if fmt is None and recipe is None:
        raise UsageError("give --format F (or a --recipe FILE)")
    check_output_path(output, overwrite)  # before the work folder is named after it, and before any loading
    if group_size is not None and fmt is None:
        raise UsageError("--group-size applies to --format; put group_size in the recipe's rules instead")
    if group_size is not None and (group_size == 0 or group_size < -1):
        # 0 and the other negatives used to mean per-channel silently; only -1 is documented to
        raise UsageError(f"--group-size must be -1 (one scale per output channel) or a positive group size, got {group_size}")
    rules = load_recipe(recipe).rules if recipe is not None else ()
    if fmt is not None:
        rules = rules + single_format(parse_spec(fmt, group_size)).rules
    plan = Recipe(tuple(rules))
    get_method(method)  # an unknown name is the error to report, before what goes with it
    outliers = OutlierOptions(keep_outliers=keep_outliers, keep_channels=keep_channels, salience=outlier_salience)
    source = None
    if routed_experts and data is None and calib is None:
        raise UsageError("--routed-experts goes with --data (it chooses how an MoE model's experts are calibrated)")
    if calib is not None or data is not None:
        source = CalibrationSource(calib=None if calib is None else str(calib), data=data, samples=samples,
                                   seqlen=seqlen, seed=seed, sink_weight=sink_weight, all_experts=not routed_experts)
    # The work folder beside the output holds per-layer progress, so a killed run resumes.
    options = MethodOptions(method=method, calibration=source, gptq=GptqOptions(refit=refit_rounds, float_target=float_target),
                            outliers=outliers, work_dir=str(work_dir_for(output)))

    # transient: an input error raised before the first layer leaves only its one line; no bar in logs/pipes
    with progress(transient=True, disable=as_json or not console.is_terminal) as bar:
        task = bar.add_task("quantizing", total=None, info="")

        def on_part(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, info=name)

        summary = quantize_model(model, plan, out_dir=output, method=method, skip=skip,
                                 quantize_head=quantize_head, overwrite=overwrite, progress=on_part,
                                 method_options=options)
    if as_json:
        print_json(summary.to_dict())
        return
    _print_summary(summary)


def _print_summary(summary) -> None:
    formats = ", ".join(f"{label} ×{count}" for label, count in summary.formats.items())
    console.print(f"quantized {summary.model} → {summary.output} with {summary.method} in {summary.seconds:.1f} s")
    console.print(f"  modules       {formats}")
    console.print(
        f"  bits/weight   {summary.linear_bits_per_weight:.3f} over the Linears ({summary.linear_params / 1e6:.1f} M weights), "
        f"{summary.bits_per_weight:.3f} overall ({summary.params / 1e6:.1f} M)"
    )
    ratio = summary.bytes_before / max(1, summary.bytes_after)
    if summary.outliers:
        extra = 48.0 * summary.outliers / max(1, summary.linear_params)
        console.print(f"  outliers      {summary.outliers:,} weights kept in bf16 (+{extra:.3f} bits/weight, included above)")
    console.print(
        f"  size          {summary.bytes_before / 1e6:.1f} MB → {summary.bytes_after / 1e6:.1f} MB ({ratio:.2f}× smaller)"
    )
    if summary.expert_tokens:
        console.print(f"  experts       {expert_tokens_line(summary.expert_tokens)}")
    for note in summary.notes:
        console.print(f"  note: {note}")
