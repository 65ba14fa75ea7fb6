"""`lowbit plan`: will MODEL fit, how many users, how fast, and what each trick buys — from config.json alone."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from lowbit.cli.common import console, print_json
from lowbit.cli.main import app
from lowbit.plan.advice import gib


@app.command("plan")
def plan_command(
    model: str = typer.Argument(
        ...,
        help="Bundled name (llama-3-8b, llama-3-70b, qwen2.5-7b, qwen2.5-72b, qwen3-8b, mistral-7b, mixtral-8x7b, "
        "smollm2-135m, gemma3-270m), a checkpoint directory (only config.json is read), or a hub id (only config.json is fetched).",
    ),
    gpu: Optional[str] = typer.Option(
        None, "--gpu", help="h100, h200, a100, l4, rtx4090, b200, or cpu (measures this machine). Default h100 unless all of --bandwidth/--memory/--tflops are given."
    ),
    bandwidth: Optional[float] = typer.Option(None, "--bandwidth", help="Memory bandwidth in GB/s (overrides --gpu's)."),
    memory_size: Optional[str] = typer.Option(
        None, "--memory", metavar="SIZE", help="Memory, e.g. 80GiB or 24GB (overrides --gpu's)."),
    tflops: Optional[float] = typer.Option(None, "--tflops", help="Dense matmul peak in TFLOP/s (overrides --gpu's)."),
    formats: Optional[List[str]] = typer.Option(
        None, "--format", "-f", help="Number format to compare; repeat for several (default: bf16 int8 fp8 int4-g128 nf4 mxfp4 nvfp4)."
    ),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Group size for the formats that take one (-1: per output row)."),
    context: int = typer.Option(4096, "--context", help="Tokens each sequence holds (prompt + output); also the prefill length."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", help="Tokens a reserve-up-front cache allocates per sequence (default: the model's max_position_embeddings)."
    ),
    concurrency: int = typer.Option(16, "--concurrency", help="Sequences decoding at the same time."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: bf16, fp8 or int8 (int8 adds a scale per token and head)."),
    draft: Optional[str] = typer.Option(
        None, "--draft", help="Draft model for speculative decoding (any MODEL form, or self:FORMAT for a quantized copy of MODEL)."
    ),
    acceptance: Optional[float] = typer.Option(None, "--acceptance", help="Probability a draft token is accepted, in (0, 1]; needed with --draft."),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="Tokens the draft proposes per target pass (k)."),
    exit_layer: Optional[int] = typer.Option(
        None, "--exit-layer", help="Price an early exit checked after this layer (with --exit-rate; lowbit generate --early-exit)."),
    exit_rate: Optional[float] = typer.Option(
        None, "--exit-rate", help="Fraction of tokens, in [0, 1], that leave at --exit-layer (measure it: lowbit generate --early-exit --json)."),
    quantize_head: bool = typer.Option(False, "--quantize-head", help="Count the lm_head (and a tied embedding) in the format too."),
    act_quant: bool = typer.Option(
        False, "--act-quant", help="Assume activations are quantized too, so fp8 / fp4 formats use the GPU's fp8 / fp4 tensor cores."
    ),
    memory_utilization: float = typer.Option(0.9, "--memory-utilization", help="Fraction of memory for weights + KV cache; the rest is left for activations."),
    as_json: bool = typer.Option(False, "--json", help="Print the same numbers as one JSON object on stdout."),
) -> None:
    """Memory, capacity and decode/prefill roofline of MODEL per number format on a GPU (or this CPU), from its config alone."""
    from lowbit.cli.sizes import GIB, MIB, parse_size
    from lowbit.plan.estimate import Scenario
    from lowbit.plan.hardware import custom_hardware, lookup_gpu
    from lowbit.plan.report import make_plan

    # the size syntax of every other command; the planner itself counts in GiB
    memory = None if memory_size is None else parse_size(memory_size, "--memory", minimum=MIB) / GIB
    custom = [bandwidth, memory, tflops]
    if gpu is None and all(v is not None for v in custom):
        hardware = custom_hardware(None, bandwidth, memory, tflops)
    else:
        if gpu is not None and gpu.lower() == "cpu" and not as_json:
            console.print("[dim]measuring this machine's bandwidth and matmul speed…[/dim]")
        hardware = custom_hardware(lookup_gpu(gpu or "h100"), bandwidth, memory, tflops)
    scenario = Scenario(
        context=context,
        concurrency=concurrency,
        kv_dtype=kv_dtype.lower(),
        max_context=max_context,
        quantize_head=quantize_head,
        act_quant=act_quant,
        memory_utilization=memory_utilization,
        draft_tokens=draft_tokens,
        acceptance=acceptance,
    )
    plan = make_plan(model, hardware, scenario, formats=formats, group_size=group_size, draft=draft,
                     exit_layer=exit_layer, exit_rate=exit_rate)
    if as_json:
        print_json(plan.to_dict())
    else:
        _print_plan(plan)


def _print_plan(plan) -> None:
    s, hw, sc = plan.shape, plan.hardware, plan.scenario
    params = f"{s.total_params / 1e9:.2f}B parameters"
    if s.is_moe:
        params += f" ({s.active_params / 1e9:.2f}B active, {s.experts_per_token} of {s.num_experts} experts)"
    windows = sum(w is not None for w in s.layer_windows)
    attention = f"{s.num_layers} layers, {s.num_heads} heads / {s.num_kv_heads} KV heads × {s.head_dim}"
    if windows:
        attention += f", {windows} sliding-window layers ({max(w for w in s.layer_windows if w)} tokens)"
    out = _wide(console)
    where = "" if plan.source == s.name else f" ({plan.source})"  # a file named as itself: once
    out.print(f"[bold]{s.name}[/bold]{where}: {params}; {attention}")
    out.print(
        f"[bold]{hw.name}[/bold]: {hw.memory_gib:.1f} GiB, {hw.bandwidth_gbs:,.0f} GB/s, {hw.tflops_bf16:,.1f} TFLOP/s bf16"
        + (f", {hw.tflops_fp8:,.0f} fp8" if hw.tflops_fp8 else "")
        + (f", {hw.tflops_fp4:,.0f} fp4" if hw.tflops_fp4 else "")
        + (" (measured)" if hw.measured else "")
    )
    out.print(
        f"context {sc.context} tokens, {sc.concurrency} concurrent sequence{'s' if sc.concurrency != 1 else ''}, KV in {sc.kv_dtype}, "
        f"reserve-up-front allocates {sc.reserve_tokens(s)} tokens per sequence"
    )
    out.print(_format_table(plan))
    out.print(_tricks_table(plan))
    out.print(f"[bold]{plan.recommendation}[/bold]")


def _wide(con: Console) -> Console:
    # the tables are wide: a pipe or CI log (80 columns by default) should not fold them
    if con.is_terminal or con.width >= 132:
        return con
    return Console(file=con.file, width=132, highlight=False, no_color=con.no_color)


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _format_table(plan) -> Table:
    sc = plan.scenario
    table = Table(title="payoff per format: capacity · bandwidth · compute", title_justify="left")
    for name, justify in [
        ("format", "left"),
        ("bits/w", "right"),
        ("weights\nGiB", "right"),
        ("fits", "center"),
        ("KV GiB\n/seq", "right"),
        ("max seqs\npaged/resv", "right"),
        ("tok/s\nper seq", "right"),
        (f"tok/s\n@ {sc.concurrency}", "right"),
        (f"prefill\n{sc.context} s", "right"),
        ("bound", "left"),
    ]:
        table.add_column(name, justify=justify, no_wrap=True)
    show_spec = any(r.speculation for r in plan.rows)
    if show_spec:
        table.add_column("spec tok/s per seq", justify="right")
    for r in plan.rows:
        mark = "[bold green]" if r.format == plan.recommended else ""
        cells = [
            f"{mark}{r.format}",
            f"{r.bits_per_weight:.2f}",
            gib(r.weight_gib),
            "[green]yes[/green]" if r.fits else "[red]no[/red]",
            gib(r.kv_gib_per_sequence),
            f"{r.max_sequences_paged}/{r.max_sequences_reserved}",
            _num(r.decode_tok_s_per_sequence, ",.1f"),
            _num(r.decode_tok_s_aggregate, ",.0f") + (f" ({r.sequences})" if r.fits and r.sequences < sc.concurrency else ""),
            _num(r.prefill_s, ".3f"),
            r.bottleneck,
        ]
        if show_spec:
            spec = r.speculation
            cells.append(f"{spec.tok_s_per_sequence:,.1f} (×{spec.speedup_per_sequence:.2f})" if spec and spec.sequences else "—")
        table.add_row(*cells)
    return table


def _tricks_table(plan) -> Table:
    table = Table(title="what each trick buys and costs", title_justify="left")
    table.add_column("trick")
    table.add_column("buys")
    table.add_column("costs")
    for t in plan.tricks:
        table.add_row(t.name, t.buys, t.costs)
    return table
