"""Plan's decode prediction beside a measured decode on this CPU.

    python bench/plan_vs_measured.py                                  # smollm2-135m in bf16
    python bench/plan_vs_measured.py smollm2-135m OUT_INT4=int4-g128  # add a quantized checkpoint
    python bench/plan_vs_measured.py --context 512 --steps 64 --json

Each argument is MODEL or MODEL=FORMAT (the format the checkpoint's Linears are stored in, as plan
names it; default bf16). The machine is measured once (`lowbit plan --gpu cpu`'s measurement), plan
predicts the single-sequence decode tok/s at the context, and lowbit's runtime decodes `steps`
tokens after a prefill of `context` tokens (bf16 activations, contiguous KV cache), timed per token.
The ratio measured / predicted is how close the runtime comes to the bandwidth roofline.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from lowbit.formats.resolve import resolve_model
from lowbit.plan import Scenario, make_plan, measure_cpu
from lowbit.runtime.loader import load_model


def measure_decode(path, context: int, steps: int) -> float:
    model = load_model(path, dtype=torch.bfloat16)
    model.eval()
    cache = model.new_cache(batch=1, max_len=context + steps + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, context))
    with torch.inference_mode():
        logits = model(ids, cache=cache, logits_start=context - 1)
        token = logits[:, -1:].argmax(-1)
        model(token, cache=cache)  # one warm-up step
        token = torch.zeros(1, 1, dtype=torch.long)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache).argmax(-1)
        elapsed = time.perf_counter() - start
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["smollm2-135m"], help="MODEL or MODEL=FORMAT")
    parser.add_argument("--context", type=int, default=256, help="prefill tokens before decoding")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    hardware = measure_cpu()
    rows = []
    for item in args.models:
        model, _, fmt = item.partition("=")
        fmt = fmt or "bf16"
        plan = make_plan(model, hardware, Scenario(context=args.context, concurrency=1), formats=[fmt])
        row = plan.rows[0]
        measured = measure_decode(resolve_model(model), args.context, args.steps)
        step_bytes = row.decode.weight_bytes + row.decode.kv_bytes
        rows.append(
            {
                "model": model,
                "format": fmt,
                "predicted_tok_s": row.decode_tok_s_single,
                "measured_tok_s": measured,
                "measured_over_predicted": measured / row.decode_tok_s_single,
                "bytes_per_step": step_bytes,
                "achieved_gbs": measured * step_bytes / 1e9,
            }
        )
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "context": args.context, "rows": rows}, indent=2))
        return
    console = Console()
    console.print(f"{hardware.name}: {hardware.bandwidth_gbs:.1f} GB/s streaming read, {hardware.tflops_bf16 * 1000:.0f} GFLOP/s")
    table = Table(title=f"decode, 1 sequence, context {args.context}")
    for col in ("model", "format", "plan tok/s", "measured tok/s", "measured / plan", "achieved GB/s"):
        table.add_column(col, justify="left" if col in ("model", "format") else "right")
    for r in rows:
        table.add_row(
            r["model"],
            r["format"],
            f"{r['predicted_tok_s']:.1f}",
            f"{r['measured_tok_s']:.1f}",
            f"{r['measured_over_predicted']:.2f}",
            f"{r['achieved_gbs']:.1f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
