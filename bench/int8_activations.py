"""What int8 activations cost in quality: an int4 checkpoint scored three ways on wiki-eval.

    python bench/int8_activations.py CHECKPOINT [CHECKPOINT ...] [--chunks 10] [--ctx 2048] [--json]

The markdown table (with the command line and date) goes to bench/results/int8_activations.md,
replacing it, unless --out names another file; --json prints the rows on stdout instead.

Rows: the exact route (`--kernel reference`: float32 dequantize-then-matmul, nothing rounded but
the weights), and the int4 kernel (cpu-int4dot: what every prompt and generated token uses) with
bf16 activations (`LOWBIT_INT4_ACTIVATIONS=bf16`, native/int4_dot.c) and with int8 ones (the
default on VNNI CPUs, native/int4_vnni.c). KLD is against the float model (--base), so a row's
excess over the exact row is what rounding the activations costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# (label, kernel path, int4 activations)
ROUTES = (("exact (reference kernel, float32)", "reference", None), ("int4 kernel, bf16 activations", None, "bf16"),
          ("int4 kernel, int8 activations", None, "int8"))


def score(checkpoint: str, base: str, ctx: int, chunks: int, kernel: str | None, act: str | None) -> dict:
    from lowbit.kernels.dispatch import use_settings
    from lowbit.runtime.evaluate import prepare, run

    start = time.perf_counter()
    with use_settings(kernel=kernel, int4_activations=act):  # read while the checkpoint loads
        report = run(prepare(checkpoint, "wiki-eval", ctx=ctx, chunks=chunks, base=base, dtype="f32"))
    k = report.result.kld
    return {"ppl": report.result.ppl, "kld": k.mean, "kld_err": k.err, "same_top": k.same_top_pct,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "int8_activations.md",
                        help="markdown table, replaced (default bench/results/int8_activations.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for ckpt in args.checkpoints:
        for label, kernel, act in ROUTES:
            rows.append({"checkpoint": ckpt, "route": label, **score(ckpt, args.base, args.ctx, args.chunks, kernel, act)})
            gc.collect()  # each route loads both models again; without this the process grew to ~15 GB
            print(f"{ckpt} | {label} | done in {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    lines = [f"`python bench/int8_activations.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"wiki-eval, ctx {args.ctx}, {args.chunks} chunks, KLD vs {args.base} (float32)", "",
             "| checkpoint | route | PPL | KLD | same top % |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['checkpoint']} | {r['route']} | {r['ppl']:.3f} | {r['kld']:.4f} ± {r['kld_err']:.4f} | {r['same_top']:.2f} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
