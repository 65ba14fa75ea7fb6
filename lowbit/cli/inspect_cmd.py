"""`lowbit inspect CKPT [--base MODEL]`: per-layer formats, sizes and (with a base) weight error."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from lowbit.cli.common import console, print_json
from lowbit.cli.main import app


@app.command("inspect")
def inspect_command(
    checkpoint: Path = typer.Argument(..., metavar="CKPT", help="A quantized checkpoint: lowbit's, GPTQ, AWQ or compressed-tensors directory, or a GGUF file; demo name or hub id too."),
    base: Optional[str] = typer.Option(
        None, "--base",
        help="The float model CKPT was made from (demo name, directory or hub id): adds each layer's relative "
        "error ‖W−Ŵ‖/‖W‖ and sorts worst first.",
    ),
    top: Optional[int] = typer.Option(None, "--top", help="Show only the first N layers of the table (totals stay complete)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Per-layer format, shape, group, bits/weight (scales included) and bytes; totals against bf16."""
    from lowbit.compress.checkpoint_report import inspect_checkpoint

    with console.status("reading checkpoint"):
        report = inspect_checkpoint(checkpoint, base)
    if as_json:
        print_json(report.to_dict())
        return
    _print(report, top)


def _print(report, top: int | None) -> None:
    kind = "" if report.kind == "native" else f" ({report.kind})"
    table = Table(title=f"{report.path}{kind}" + (f" vs {report.base}" if report.base else ""), title_justify="left")
    table.add_column("layer", overflow="fold")  # full module names: they are what --skip and recipes match
    for column in ("format", "shape", "group", "bits/w", "bytes"):
        table.add_column(column, justify="left" if column in ("format", "group") else "right", no_wrap=True)
    if report.base:
        table.add_column("rel. error", justify="right")
    rows = report.rows if top is None else report.rows[:top]
    for r in rows:
        cells = [r.name, r.format, f"{r.shape[0]}×{r.shape[1]}", r.group, f"{r.bits_per_weight:.3f}", f"{r.bytes:,}"]
        if report.base:
            cells.append(f"{r.rel_error:.4f}")
        table.add_row(*cells)
    console.print(table)
    data = report.to_dict()
    q, t = data["quantized"], data["total"]
    formats = ", ".join(f"{k} ×{v}" for k, v in report.formats.items())
    console.print(f"quantized  {len(report.rows)} layers ({formats}): {q['params'] / 1e6:.1f} M weights, "
                  f"{q['bytes'] / 1e6:.1f} MB, {q['bits_per_weight']:.3f} bits/weight")
    if report.outliers:
        console.print(f"outliers   {report.outliers:,} weights kept in bf16 beside the format (48 bits each, in the bits/weight above)")
    if report.read_as_float:
        stored = ", ".join(sorted({f for f, _ in report.read_as_float.values()}))
        console.print(f"as float   {len(report.read_as_float)} layers stored as {stored}, which lowbit reads as float "
                      f"(in dense below; --json says why)")
    console.print(f"dense      {report.dense_params / 1e6:.1f} M params, {report.dense_bytes / 1e6:.1f} MB")
    console.print(f"total      {t['bytes'] / 1e6:.1f} MB, {t['bits_per_weight']:.3f} bits/weight; bf16 would be "
                  f"{t['bf16_bytes'] / 1e6:.1f} MB ({t['ratio_vs_bf16']:.1%} of it)")
