"""Output helpers shared by the subcommands: stderr console, JSON on stdout, progress bars."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from lowbit.errors import UsageError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Human-facing output goes to stderr so stdout stays clean for --json and pipelines. Lines are never
# wrapped at 80 columns when stderr is a log file: a wrapped path or number cannot be grepped.
console = Console(stderr=True, highlight=False, soft_wrap=True)
if not console.is_terminal:
    console.width = 1000  # tables in a log take the width their cells need, not 80 columns

# --threads, the same in every command that computes: unset leaves torch's default (one per core).
THREADS_OPTION = typer.Option(None, "--threads", metavar="N", help="CPU threads for torch (default: torch's, one per core).")
KV_DTYPE_OPTION = typer.Option(
    None, "--kv-dtype", metavar="auto|f32|bf16|int8|fp8", show_default=False,
    help="KV cache storage. auto (the default): bf16 for a checkpoint saved in bf16 that runs in float32 on a CPU "
    "(vLLM's auto is the model's dtype, llama.cpp's cache f16), else the compute dtype. bf16: keys and values "
    "rounded to bf16 (half the memory and half the bytes a long context reads each step; the fused CPU attention "
    "reads them against float32 queries; KLD ~1.5e-4 on SmolLM2). f32: the float32 pool (a float32 model). "
    "int8 / fp8: quantized, one scale per token and head.")
# the default is runtime/cascade.DEFAULT_RUN (not imported here: it loads torch; a test keeps them equal)
DRAFT_VOCAB_OPTION = typer.Option(
    None, "--draft-vocab", metavar="N", show_default=False,
    help="Tokens a quantized draft's head scores: the N most frequent in lowbit's calibration text (0 = all). "
    "Default: 32768 where the vocabulary is larger than 65536, else all. Output unchanged (every draft is verified).")
CASCADE_RUN_OPTION = typer.Option(7, "--cascade-run", metavar="N", help="Token cascade: most cheap tokens in a row; "
                                  "the model takes at least every (N+1)-th token, in one pass over the run.")


def apply_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def expert_tokens_line(expert_tokens: dict[str, list[int]]) -> str:
    """One line on an MoE model's calibration: how many tokens the router sent each expert."""
    counts = sorted(c for block in expert_tokens.values() for c in block)
    idle = sum(c == 0 for c in counts)
    return (f"{len(expert_tokens)} MoE blocks, {len(counts)} experts: calibration tokens per expert min {counts[0]}, "
            f"median {counts[len(counts) // 2]}, max {counts[-1]}; {idle} got none (--json lists each)")


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def progress(transient: bool = False, disable: bool = False) -> Progress | LineProgress:
    """Progress on stderr: on a terminal a rich bar (description, bar, n/m, elapsed, remaining, and a
    free-text field); in a log or pipe plain lines instead (LineProgress), since a bar there prints
    nothing. `disable` turns off the terminal bar only: a log still gets its lines."""
    if not console.is_terminal:
        return LineProgress()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        transient=transient,
        disable=disable,
    )


def _line(text: str) -> None:
    sys.stderr.write(f"lowbit: {text}\n")
    sys.stderr.flush()


@dataclass(slots=True)
class _Task:
    description: str
    total: float | None
    completed: float = 0
    info: str = ""
    touched: bool = False  # a task nobody updated (a step that had no work) prints nothing
    printed: tuple | None = None


class LineProgress:
    """The plain-line stand-in for rich's Progress (the part of its API the commands use): a line
    `lowbit: DESCRIPTION DONE/TOTAL INFO (ELAPSED s)` when a task starts, at most every
    LOWBIT_PROGRESS_EVERY seconds (default 10) while it runs, and its last state at the end."""

    def __init__(self, every_s: float | None = None):
        self.every_s = float(os.environ.get("LOWBIT_PROGRESS_EVERY", "10")) if every_s is None else every_s
        self.tasks: list[_Task] = []
        self.started = self.last = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            for task in self.tasks:
                if task.touched:
                    self._print(task)

    def add_task(self, description: str, total: float | None = None, info: str = "", **_) -> int:
        self.tasks.append(_Task(description, total, info=info))
        return len(self.tasks) - 1

    def update(self, task_id: int, *, completed: float | None = None, total: float | None = None,
               advance: float | None = None, info: str | None = None, **_) -> None:
        task = self.tasks[task_id]
        task.touched = True
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        if info is not None:
            task.info = info
        if task.printed is None or time.monotonic() - self.last >= self.every_s or (task.total is not None and task.completed >= task.total):
            self._print(task)

    def _print(self, task: _Task) -> None:
        state = (task.completed, task.total, task.info)
        if state == task.printed:
            return  # the end state was already the last line
        task.printed = state
        self.last = time.monotonic()
        count = f"{task.completed:g}" + ("" if task.total is None else f"/{task.total:g}")
        info = f" {task.info}" if task.info else ""
        _line(f"{task.description} {count}{info} ({self.last - self.started:.0f} s)")
