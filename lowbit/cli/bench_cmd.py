"""`lowbit bench`: prefill and decode speed, latency, bandwidth and memory of one model."""

from __future__ import annotations

from typing import Optional

import typer

from lowbit.cli.common import CASCADE_RUN_OPTION, DRAFT_VOCAB_OPTION, KV_DTYPE_OPTION, THREADS_OPTION, apply_threads, console, print_json
from lowbit.cli.kernel_options import DENSE_ACTIVATIONS_OPTION, INT4_ACTIVATIONS_OPTION, INT8_ACTIVATIONS_OPTION, KERNEL_OPTION, kernel_line, kernel_settings, kernel_summary
from lowbit.cli.main import app
from lowbit.errors import UsageError


@app.command("bench")
def bench(
    model: str = typer.Argument(..., help="Model: a directory, a demo name (smollm2-135m) or a hub id."),
    draft: Optional[str] = typer.Option(
        None, "--draft", help="Also measure speculative decoding with 'ngram', 'self:FORMAT' (an RTN copy of the "
        "model: self:int8-g32 drafts best on a CPU), 'self:layers=N' (the model's first N layers + its head) or a "
        "draft model."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="Draft tokens per step (adapts)."),
    draft_vocab: Optional[int] = DRAFT_VOCAB_OPTION,
    cascade: Optional[str] = typer.Option(
        None, "--cascade", help="Also measure a token cascade with this cheap model (self:FORMAT such as "
        "self:int8-g32, self:layers=N or a model with the same tokenizer) at every batch size: speedup, greedy agreement, cheap share."),
    cascade_threshold: float = typer.Option(0.9, "--cascade-threshold", help="Cascade confidence (top-1 "
                                            "probability) threshold in [0, 1]."),
    cascade_run: int = CASCADE_RUN_OPTION,
    batches: str = typer.Option("1,4,16,64", "--batches", help="Comma-separated decode batch sizes."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", help="Prompt length of the decode runs."),
    gen_tokens: int = typer.Option(64, "--gen-tokens", help="Tokens generated per request."),
    prefill_tokens: Optional[int] = typer.Option(
        None, "--prefill-tokens", help="Prompt length of the prefill run (default: 512, or the model's positions "
        "less 2 when it has fewer)."),
    dtype: str = typer.Option("f32", "--dtype", help="Compute dtype: f32 (default), bf16 or f16 (float32, bfloat16, float16 mean the same)."),
    kv_dtype: Optional[str] = KV_DTYPE_OPTION,
    kv_memory_size: Optional[str] = typer.Option(
        None, "--kv-memory", help="KV cache size, e.g. 512MiB, 2GiB or 1.5GB (no unit: bytes; at least 1MiB, at most "
        "the memory free; default: a share of free memory)."),
    threads: Optional[int] = THREADS_OPTION,
    kernel: Optional[str] = KERNEL_OPTION,
    int4_activations: Optional[str] = INT4_ACTIVATIONS_OPTION,
    dense_activations: Optional[str] = DENSE_ACTIVATIONS_OPTION,
    int8_activations: Optional[str] = INT8_ACTIVATIONS_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Measure prefill tok/s, decode tok/s per batch size, TTFT, inter-token latency, weight
    bandwidth against the measured streaming bandwidth, memory; with --draft, the speedup; with
    --cascade, the cascade's speedup and agreement per batch size. --json also reports the kernel
    path of each quantized layer ("kernels")."""

    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.engine.benchmark import run_bench
    from lowbit.runtime.engine.engine import Engine

    settings = kernel_settings(kernel, int4_activations, dense_activations, int8_activations)
    cascade_settings = None
    if cascade is not None:
        from lowbit.runtime.cascade import CascadeSettings

        cascade_settings = CascadeSettings(cascade_threshold, run=cascade_run)  # checked before anything loads
    apply_threads(threads)
    try:
        sizes = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise UsageError(f"--batches must be comma-separated integers, got '{batches}'") from None
    if not sizes or min(sizes) < 1:
        raise UsageError("--batches needs positive batch sizes")
    from lowbit.cli.sizes import MIB, check_memory, check_positions, model_positions, parse_size

    limit = model_positions(model)
    if prefill_tokens is None:
        # a model with fewer positions still gets a prefill run instead of a refused default
        prefill_tokens = min(512, limit[0] - 2) if limit is not None else 512
    for name, value in (("--prompt-tokens", prompt_tokens), ("--gen-tokens", gen_tokens), ("--prefill-tokens", prefill_tokens)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    # the shared size syntax (lowbit/cli/sizes.py): a bare number is bytes now, and 1MiB the least, so an
    # old `--kv-memory 512` (MiB) is an error rather than a 512-byte cache
    kv_memory = parse_size(kv_memory_size, "--kv-memory", minimum=MIB) if kv_memory_size else None
    # every length against the model before it loads (the engine would clamp the prefill silently)
    check_positions("--gen-tokens", prompt_tokens + gen_tokens, limit,
                    spelled=f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens}")
    check_positions("--prefill-tokens", prefill_tokens + 2, limit,
                    spelled=f"--prefill-tokens {prefill_tokens} (+ 2 generated tokens)")
    engines = 1 + bool(draft) + bool(cascade)
    if kv_memory is not None:
        # with --draft or --cascade another engine holds a cache of the same size
        check_memory("--kv-memory", kv_memory_size if engines == 1 else f"{kv_memory_size} ({engines} times, with "
                     "--draft or --cascade)", kv_memory * engines)
    common = dict(dtype=dtype, kv_dtype=kv_dtype, kv_memory=kv_memory, max_num_seqs=max(sizes))
    with console.status("loading"), use_settings(settings):
        engine = Engine(model, **common)
        spec_engine = Engine(model, draft=draft, num_speculative_tokens=num_speculative_tokens,
                             draft_vocab=draft_vocab, **common) if draft else None
        cascade_engine = Engine(model, draft=cascade, cascade=cascade_settings, **common) if cascade else None
        kernels = kernel_summary(engine.model)
    with console.status("measuring"):
        result = run_bench(engine, sizes, prompt_tokens, gen_tokens, prefill_tokens, spec_engine, cascade_engine)
    if cascade:
        result["cascade_model"] = cascade
    result["kernels"] = kernels
    if json_out:
        print_json(result)
        return
    print_report(result)


def print_report(r: dict) -> None:
    gib = 1 << 30
    console.print(f"[bold]{r['model']}[/bold]  {r['dtype']} on {r['device']}, {r['threads']} threads")
    kv = f" in {r['kv_dtype']}" if r.get("kv_dtype") else ""
    packed = f" (of which {r['packed_bytes'] / gib:.3f} GiB packed copies of bf16 weights)" if r.get("packed_bytes") else ""
    screen = f" + {r['head_screen_bytes'] / gib:.3f} GiB int8 copy of the head (greedy argmax)" if r.get("head_screen_bytes") else ""
    console.print(f"weights {r['weight_bytes'] / gib:.3f} GiB{packed}{screen}, KV cache {r['kv_cache_bytes'] / gib:.3f} GiB{kv} "
                  f"({r['kv_blocks']} blocks)")
    if r.get("resident_bytes_loaded") and r.get("resident_bytes_peak"):
        console.print(f"process memory {r['resident_bytes_loaded'] / gib:.3f} GiB resident once loaded, "
                      f"peak {r['resident_bytes_peak'] / gib:.3f} GiB")
    line = kernel_line(r["kernels"]) if "kernels" in r else None
    if line:
        console.print(line)
    console.print(f"prefill  {r['prefill_tok_s']:.0f} tok/s over {r['prefill_tokens']} tokens")
    console.print(f"{'batch':>6} {'decode tok/s':>13} {'TTFT ms':>9} {'ITL ms':>8}")
    for d in r["decode"]:
        console.print(f"{d['batch']:>6} {d['decode_tok_s']:>13.1f} {1000 * d['ttft_s']:>9.1f} "
                      f"{d['inter_token_latency_ms']:>8.1f}")
    console.print(f"weight bandwidth at batch 1: {r['weight_bandwidth_gbs']:.1f} GB/s of "
                  f"{r['stream_bandwidth_gbs']:.1f} GB/s measured streaming "
                  f"({100 * r['weight_bandwidth_gbs'] / r['stream_bandwidth_gbs']:.0f}%)")
    s = r.get("speculative")
    if s:
        vocab = f", head over {s['draft_vocab']} tokens" if s.get("draft_vocab") else ""
        console.print(f"speculative ({s['draft']}{vocab}): {s['tok_s']:.1f} vs {s['plain_tok_s']:.1f} tok/s plain = "
                      f"{s['speedup']:.2f}x, mean accepted length {s['mean_accepted_length']:.2f}, "
                      f"identical output: {s['identical_output']}")
    for c in r.get("cascade", []):
        console.print(f"cascade ({r['cascade_model']}, threshold {c['threshold']}) at batch {c['batch']}: "
                      f"{c['tok_s']:.1f} vs {c['plain_tok_s']:.1f} tok/s = {c['speedup']:.2f}x, greedy agreement "
                      f"{c['greedy_agreement_pct']:.1f} %, {100 * c['cheap_rate']:.1f} % of tokens cheap")
