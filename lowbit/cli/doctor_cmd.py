"""`lowbit doctor`: what this machine runs — each kernel path and why not, the C sources' build,
torch, the CPU flags the kernels use, CUDA, and the environment switches in effect."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import typer

from lowbit.cli.common import console, print_json
from lowbit.cli.main import app
from lowbit.errors import LowbitError

# The environment switches the kernels and the CLI read, and what setting them does.
ENV_SWITCHES = (
    ("LOWBIT_KERNEL", "forces one kernel path for every quantized layer (like --kernel)"),
    ("LOWBIT_INT4_ACTIVATIONS", "int8 or bf16 activations for the int4 decode kernel (like --int4-activations)"),
    ("LOWBIT_DENSE_ACTIVATIONS", "f32 or bf16 activations for bf16 dense Linears (like --dense-activations)"),
    ("LOWBIT_INT8_ACTIVATIONS", "int8 or f32 activations for 8-bit integer weights (like --int8-activations)"),
    ("LOWBIT_NO_NATIVE", "any value: no C kernels (torch's int4/int8 ops or the reference path instead)"),
    ("LOWBIT_NATIVE_SHARED", "1: the C kernels run from their cached library files, not from a private copy per process (for profilers)"),
    ("LOWBIT_NO_CHAIN", "any value: engine decode steps go layer by layer through Python, not in one C call (same numbers, slower)"),
    ("LOWBIT_HEAD_SCREEN", "0: greedy rows read the whole dense head instead of taking its argmax through an int8 copy (the same tokens)"),
    ("LOWBIT_HEAD_SCREEN_AFTER", "N: the greedy tokens taken through the whole head before that copy is made (default 256)"),
    ("LOWBIT_DECODE_STEPS", "N: the most greedy decode steps one C call takes while nothing waits (default 8, fewer past 40 ms a call; 1: one a call; the same tokens)"),
    ("LOWBIT_HUGEPAGES", "0: the engine leaves its weights on 4 KB pages instead of copying them onto 2 MB transparent huge pages"),
    ("LOWBIT_PACK_BF16", "0: the engine reads bf16 weights whole at decode steps instead of packed in 12 bits a weight (the same numbers, more bytes a step, less memory)"),
    ("LOWBIT_DRAFT_HEAD", "a speculative draft's lm_head format on the CPU (default int4-g32, its top 16 logits rescored in float32)"),
    ("TRITON_INTERPRET", "1: Triton kernels run interpreted on the CPU (tests only; --kernel triton is then allowed)"),
    ("LOWBIT_HOME", "where demo assets and the compiled C kernels live (default ~/.cache/lowbit)"),
    ("CC", "the C compiler that builds the kernels (default gcc, then cc)"),
    ("LOWBIT_DEBUG", "1: print tracebacks (like --debug)"),
)


# -- doctor -----------------------------------------------------------------------------------
def _native_report() -> dict:
    """The C sources' build status from lowbit.native.build.report() (list of SourceStatus)."""
    from lowbit.native import build

    try:
        statuses = build.report()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say what failed, never fail
        return {"sources": None, "note": f"report() failed: {type(exc).__name__}: {exc}"}
    sources = [{"source": s.source, "built": s.built, "reason": s.reason or None, "library": s.library or None}
               for s in statuses]
    return {"sources": sources, "note": None}


def _int4_activations() -> dict:
    from lowbit.kernels import cpu_int4dot

    if not cpu_int4dot.available():
        return {"mode": None, "note": "no int4 decode kernel on this machine"}
    try:
        mode = cpu_int4dot.activations()
    except LowbitError as exc:
        return {"mode": None, "note": str(exc)}
    source = (f"${cpu_int4dot.ACTIVATIONS_ENV}" if os.environ.get(cpu_int4dot.ACTIVATIONS_ENV, "").strip()
              else "default: " + ("the CPU has AVX512-VNNI or AVX2" if mode == "int8" else "no AVX512-VNNI"))
    return {"mode": mode, "note": source}


def _dense_activations() -> dict:
    from lowbit.kernels import cpu_f32
    from lowbit.kernels.dispatch import dense_activations

    try:
        mode = dense_activations()
    except LowbitError as exc:
        return {"mode": None, "note": str(exc)}
    source = ("$LOWBIT_DENSE_ACTIVATIONS" if os.environ.get("LOWBIT_DENSE_ACTIVATIONS")
              else "default: " + ("the CPU has AVX512-BF16" if cpu_f32.bf16_available() else "no AVX512-BF16"))
    return {"mode": mode, "note": source}


def _int8_activations() -> dict:
    from lowbit.kernels import cpu_int4dot
    from lowbit.kernels.dispatch import INT8_ACTIVATIONS_ENV, int8_activations

    try:
        mode = int8_activations()
    except LowbitError as exc:
        return {"mode": None, "note": str(exc)}
    source = (f"${INT8_ACTIVATIONS_ENV}" if os.environ.get(INT8_ACTIVATIONS_ENV, "").strip()
              else "default: " + ("the CPU has AVX512-VNNI" if cpu_int4dot.vnni_int8_available() else "no AVX512-VNNI"))
    return {"mode": mode, "note": source}


def doctor_report() -> dict:
    import torch

    from lowbit.kernels.dispatch import cpu_features, describe_paths

    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads(), "triton": triton_version},
        "cuda": {"available": cuda,
                 "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []},
        "cpu": {"machine": platform.machine(), "flags": cpu_features()},
        "kernel_paths": [s.to_dict() for s in describe_paths(device=None)],
        "int4_activations": _int4_activations(),
        "dense_activations": _dense_activations(),
        "int8_activations": _int8_activations(),
        "native": _native_report(),
        "env": [{"name": name, "value": os.environ.get(name), "meaning": meaning} for name, meaning in ENV_SWITCHES],
    }


def _print(report: dict) -> None:
    t, c = report["torch"], report["cuda"]
    console.print(f"[bold]torch[/bold] {t['version']}, {t['threads']} threads; triton {t['triton'] or 'not installed'}; "
                  f"CUDA: {', '.join(c['devices']) if c['available'] else 'not available'}")
    flags = report["cpu"]["flags"]
    shown = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in flags.items()) if flags else "unknown"
    console.print(f"[bold]CPU[/bold] {report['cpu']['machine']}: {shown}")
    console.print("[bold]kernel paths[/bold] (best first)")
    for p in report["kernel_paths"]:
        when = "" if p["automatic"] else " (only when named)"
        state = "[green]runs here[/green]" if p["usable"] else f"[red]not here[/red]: {p['reason']}"
        console.print(f"  {p['name']:<12} {p['device']:<4} {state}{when}", markup=True, highlight=False)
    act = report["int4_activations"]
    console.print(f"[bold]int4 decode activations[/bold] {act['mode'] or '-'} ({act['note']})")
    dense = report["dense_activations"]
    console.print(f"[bold]bf16 dense activations[/bold] {dense['mode'] or '-'} ({dense['note']})")
    int8 = report["int8_activations"]
    console.print(f"[bold]int8 weight activations[/bold] {int8['mode'] or '-'} ({int8['note']})")
    native = report["native"]
    console.print("[bold]C kernels[/bold]")
    if native["sources"] is None:
        console.print(f"  {native['note']}")
    for s in native["sources"] or []:
        state = "built" if s["built"] else f"not built: {s['reason']}"
        console.print(f"  {s['source']:<18} {state}" + (f" ({Path(s['library']).name})" if s["built"] and s["library"] else ""))
    console.print("[bold]environment[/bold]")
    for e in report["env"]:
        value = "unset" if e["value"] is None else repr(e["value"])
        console.print(f"  {e['name']:<24} {value:<10} {e['meaning']}")


@app.command("doctor")
def doctor(as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout.")) -> None:
    """What runs on this machine: each kernel path (best first) and why not, the C kernels' build,
    torch and its threads, the CPU flags the kernels use, CUDA, and the environment switches in effect."""
    report = doctor_report()
    if as_json:
        print_json(report)
    else:
        _print(report)

