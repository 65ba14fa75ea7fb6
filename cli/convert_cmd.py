"""`lowbit convert IN -o OUT`: turn a checkpoint of one format into another.

The command looks at what IN is and dispatches; today the one supported input is a GGUF
file, which becomes a Hugging Face-style directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from lowbit.cli.common import console, print_json, progress
from lowbit.cli.main import app
from lowbit.errors import LowbitError, UsageError


def _input_kind(path: Path) -> str:
    if not path.exists():
        raise LowbitError(f"input not found: {path}")
    if path.is_file():
        with path.open("rb") as fh:
            if fh.read(4) == b"GGUF" or path.suffix.lower() == ".gguf":
                return "gguf"
    raise UsageError(f"cannot convert {path}: lowbit convert reads only GGUF files (*.gguf) so far")


@app.command("convert")
def convert_command(
    source: Path = typer.Argument(..., metavar="IN", help="Checkpoint to convert: a GGUF file (*.gguf)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (a Hugging Face-style checkpoint)."),
    dtype: str = typer.Option(
        "bf16", "--dtype", help="Weight dtype written to model.safetensors: bf16, f16 or f32 (GGUF blocks are dequantized)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it already exists."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of a summary on stderr."),
) -> None:
    """Convert a GGUF file into a Hugging Face directory: config.json, safetensors, tokenizer, chat template."""
    from lowbit.formats.gguf_import import convert_gguf, parse_dtype

    parse_dtype(dtype)  # a bad --dtype is a usage error before any work
    kind = _input_kind(source)
    started = time.perf_counter()
    if kind == "gguf":
        # no bar for --json or when stderr is not a terminal (logs, pipes): it would only add blank lines
        with progress(transient=True, disable=as_json or not console.is_terminal) as bar:
            task = bar.add_task("converting", total=None, info="")

            def on_tensor(done: int, total: int, name: str) -> None:
                bar.update(task, completed=done, total=total, info=name)

            out = convert_gguf(source, output, dtype=dtype, overwrite=overwrite, progress=on_tensor)
    seconds = time.perf_counter() - started
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    if as_json:
        print_json(
            {"input": str(source), "input_format": kind, "output": str(out), "dtype": str(parse_dtype(dtype)).removeprefix("torch."),
             "files": files, "bytes": size, "seconds": round(seconds, 3)}
        )
        return
    console.print(f"wrote {out} ({size / 1e6:.1f} MB, {len(files)} files) in {seconds:.1f} s")
