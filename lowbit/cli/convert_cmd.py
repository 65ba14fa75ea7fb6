"""`lowbit convert IN -o OUT [--to FORMAT]`: turn a checkpoint of one format into another.

IN is a lowbit native checkpoint, a GPTQ / AWQ / compressed-tensors / Hugging Face directory,
or a GGUF file; the work happens in lowbit.formats.convert.
"""

from __future__ import annotations

from pathlib import Path

import typer

from lowbit.cli.common import console, print_json, progress
from lowbit.cli.main import app
from lowbit.errors import UsageError


@app.command("convert")
def convert_command(
    source: Path = typer.Argument(
        ..., metavar="IN",
        help="Checkpoint to convert: a lowbit native, GPTQ, AWQ, compressed-tensors or Hugging Face directory, or a GGUF file.",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (a .gguf file for --to gguf)."),
    to: str = typer.Option(
        None, "--to",
        help="Target format: native, compressed-tensors, gptq, awq, gguf or hf (dequantized). "
        "Default: hf for a GGUF input; required otherwise.",
    ),
    allow_requant: bool = typer.Option(
        False, "--allow-requant",
        help="Requantize weights the target cannot hold exactly (and report the error per layer) instead of refusing.",
    ),
    gguf_type: str = typer.Option(
        None, "--gguf-type",
        help="GGUF block type for projection weights: bf16, q8_0, q4_0, q4_k or mxfp4. Default: the type that holds "
        "each weight exactly, else q4_k (q8_0 for 8-bit weights).",
    ),
    dtype: str = typer.Option("bf16", "--dtype", help="Dense dtype for --to hf: bf16 (default), f16 or f32 (bfloat16, float16, float32 mean the same)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already exists."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a summary on stderr."),
) -> None:
    """Convert between lowbit's checkpoint and GGUF, GPTQ, AWQ, compressed-tensors and Hugging Face layouts."""
    from lowbit.formats.convert import convert, parse_target
    from lowbit.formats.foreign import detect_checkpoint_kind
    from lowbit.quant.dtypes import parse_dtype

    parse_dtype(dtype)  # a bad --dtype is a usage error before any work
    if not source.exists():
        from lowbit.formats.resolve import resolve_model

        source = resolve_model(str(source))  # a demo name or hub id, as every other command takes
    if to is None:
        if source.is_dir() or (source.exists() and detect_checkpoint_kind(source) != "gguf"):
            raise UsageError("--to FORMAT is required unless IN is a GGUF file (native, compressed-tensors, gptq, awq, gguf, hf)")
        to = "hf"
    parse_target(to)
    if to != "hf" and source.is_dir() and detect_checkpoint_kind(source) == "hf":
        # a float directory gets the loader's checks first (config fields lowbit cannot honour, an
        # MoE top-k above its experts, a missing or misshapen weight): one line, nothing written
        from lowbit.formats.source_tensors import SourceTensors
        from lowbit.formats.hf_files import read_config
        from lowbit.runtime.config import ModelConfig
        from lowbit.runtime.loader import check_weights_fit

        check_weights_fit(ModelConfig.from_dict(read_config(source)), SourceTensors(source).shapes, source)
    # no bar for --json or when stderr is not a terminal (logs, pipes): it would only add blank lines
    with progress(transient=True, disable=as_json or not console.is_terminal) as bar:
        task = bar.add_task("converting", total=None, info="")

        def on_tensor(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, info=name)

        result = convert(source, output, to, allow_requant=allow_requant, overwrite=overwrite,
                         gguf_type=gguf_type, dtype=dtype, progress=on_tensor)
    summary = result.to_dict()
    if result.target == "hf":
        summary["dtype"] = str(parse_dtype(dtype)).removeprefix("torch.")
    if as_json:
        print_json(summary)
        return
    for change in result.changes:
        console.print(
            f"requantized {change.module}: {change.source} → {change.target} ({change.reason}); "
            f"relative error {change.rel_error:.3e}"
        )
    for note in result.notes:
        console.print(f"note: {note}")
    exactness = "exact" if result.exact else ", ".join(_inexact(result))
    console.print(
        f"wrote {result.output} ({result.target}, {exactness}; {summary['bytes'] / 1e6:.1f} MB) "
        f"from {result.input_format} in {result.seconds:.1f} s"
    )


def _inexact(result) -> list[str]:
    """What made a conversion inexact, for its summary line."""
    parts = [f"{len(result.changes)} weight(s) requantized"] if result.changes else []
    if result.rounded and result.rounded.tensors:
        rounded = result.rounded
        parts.append(f"{rounded.tensors} tensor(s) rounded to {rounded.to_dict()['dtype']}, relative error up to "
                     f"{rounded.max_rel_error:.2e}; --dtype f32 keeps them exact")
    return parts
