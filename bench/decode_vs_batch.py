"""Decode tok/s against batch size, measured by `lowbit bench`, beside plan's roofline for this CPU.

    python bench/decode_vs_batch.py                        # bf16 and int4 demo model, batches 1..16
    python bench/decode_vs_batch.py --batches 1,2,4 --gen-tokens 8 --out /tmp/d.json

For each checkpoint (the bf16 demo model, and an int4 RTN copy made once with `lowbit quantize`)
`lowbit bench --json` measures aggregate decode tok/s at each batch size. The machine is measured
once with plan's own measurement (`lowbit plan --gpu cpu`), and plan predicts the aggregate tok/s
at each batch size: weights read once per step, each sequence's KV cache on top, compute bound
once the batch is large enough. Both go to one JSON file that bench/plots.py draws.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from lowbit.plan import Scenario, make_plan, measure_cpu

RESULTS = Path(__file__).resolve().parent / "results" / "decode_vs_batch.json"


class CommandFailed(Exception):
    pass


def lowbit(*args: str) -> str:
    done = subprocess.run([sys.executable, "-c", "from lowbit.cli.main import main; main()", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise CommandFailed(f"lowbit {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def predicted(model: str, fmt: str, hardware, batches: list[int], context: int) -> list[float]:
    """Plan's aggregate decode tok/s at each batch size (context = prompt + half the generation)."""
    rates = []
    for batch in batches:
        row = make_plan(model, hardware, Scenario(context=context, concurrency=batch), formats=[fmt]).rows[0]
        rates.append(row.decode_tok_s_aggregate)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-int4", action="store_true", help="measure the bf16 model only")
    parser.add_argument("--out", default=str(RESULTS), help=f"JSON file to write (default {RESULTS})")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bench_args = ["--batches", args.batches, "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens",
                  str(args.gen_tokens), "--prefill-tokens", "64", "--threads", str(args.threads), "--json"]
    hardware = measure_cpu()
    context = args.prompt_tokens + args.gen_tokens // 2
    series = []
    with tempfile.TemporaryDirectory(prefix="lowbit-decode-") as work:
        # plan names the stored format; lowbit bench runs bf16 weights / int4 weights with bf16 activations
        runs = [("bf16", args.model, "bf16")]
        if not args.no_int4:
            int4_dir = str(Path(work) / "int4")
            lowbit("quantize", args.model, "--format", "int4", "-o", int4_dir)
            runs.append(("int4 (RTN g128)", int4_dir, "int4-g128"))
        for label, path, fmt in runs:
            try:
                measured = json.loads(lowbit("bench", path, "--dtype", "bfloat16", *bench_args))
            except CommandFailed as exc:  # keep the series that worked; say which did not
                print(f"skipped {label}: {exc}", file=sys.stderr)
                continue
            series.append({
                "label": label,
                "format": fmt,
                "batches": [d["batch"] for d in measured["decode"]],
                "measured_tok_s": [d["decode_tok_s"] for d in measured["decode"]],
                "predicted_tok_s": predicted(args.model, fmt, hardware, batches, context),
                "stream_bandwidth_gbs": measured["stream_bandwidth_gbs"],
                "weight_bandwidth_gbs": measured["weight_bandwidth_gbs"],
            })
            print(f"{label}: measured {[round(x, 1) for x in series[-1]['measured_tok_s']]}, "
                  f"plan {[round(x, 1) for x in series[-1]['predicted_tok_s']]}", file=sys.stderr)
    if not series:
        raise SystemExit("no series measured")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "hardware": hardware.to_dict(), "threads": args.threads,
                               "context": context, "prompt_tokens": args.prompt_tokens,
                               "gen_tokens": args.gen_tokens, "series": series}, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
