"""Launch configurations of the Triton quantized matmul, side by side: which tile and K split is
fastest on this GPU for a format, shape and row count (the kernel's defaults come from here).

    python bench/triton_sweep.py                                  # int4 on Llama-3-8B shapes, 1 and 16 rows
    python bench/triton_sweep.py --formats int4,nvfp4 --rows 1 --markdown out.md
    TRITON_INTERPRET=1 python bench/triton_sweep.py --device cpu --shapes 64x128 --block-n 32 --split-k 1,2

Every configuration is timed in alternating rounds with the default one (CUDA events on a GPU),
and each result is checked against the default's output first: a configuration that computes
something else is reported as wrong, never as fast.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_speed import copies_for, describe, interleaved_medians, quantize  # noqa: E402

from lowbit.kernels import prepare, triton_qmm  # noqa: E402


def sweep(formats, shapes, rows, device, block_n, block_k, split_k, warps, rounds: int = 3, budget_s: float = 0.05) -> list[dict]:
    results = []
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        for label in formats:
            qt = quantize(label, w)
            first = prepare(qt, device, "triton")
            weights = [first] + [prepare(qt, device, "triton") for _ in range(copies_for(first.nbytes) - 1)]
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                default = triton_qmm._default_config(m, n, k, device)
                configs = {"default": None}
                for bn, bk, sk, nw in itertools.product(block_n, block_k, split_k, warps):
                    configs[f"N{bn} K{bk} split{sk} w{nw}"] = {"BLOCK_M": default["BLOCK_M"], "BLOCK_N": bn,
                                                              "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw}
                reference = triton_qmm.matmul(x, first)
                candidates, wrong = {}, []
                for name, cfg in configs.items():
                    y = triton_qmm.matmul(x, first, cfg)
                    err = ((y - reference).norm() / reference.norm().clamp_min(1e-30)).item()
                    if not err < 1e-2:
                        wrong.append(name)
                        continue
                    candidates[name] = [lambda p=p, cfg=cfg: triton_qmm.matmul(x, p, cfg) for p in weights]
                times = interleaved_medians(candidates, device, rounds, budget_s=budget_s * rounds)
                for name, t in times.items():
                    results.append({"format": label, "n": n, "k": k, "m": m, "config": name, "us": t * 1e6,
                                    "gb_s": first.nbytes / t / 1e9, "vs_default": times["default"] / t})
                results += [{"format": label, "n": n, "k": k, "m": m, "config": name, "wrong": True} for name in wrong]
    return results


def markdown(results: list[dict], device_name: str) -> str:
    lines = [f"{device_name}: each configuration beside the default (`triton_qmm._default_config`)", "",
             "| format | N x K | M | config | time µs | GB/s | × default |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("wrong"):
            lines.append(f"| {r['format']} | {r['n']}x{r['k']} | {r['m']} | {r['config']} | WRONG RESULT | – | – |")
        else:
            lines.append(f"| {r['format']} | {r['n']}x{r['k']} | {r['m']} | {r['config']} | {r['us']:.1f} | "
                         f"{r['gb_s']:.1f} | {r['vs_default']:.2f} |")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--formats", default="int4", help="comma-separated format labels")
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="N x K, comma-separated")
    ap.add_argument("--rows", default="1,16", type=_ints)
    ap.add_argument("--block-n", default="32,64,128", type=_ints)
    ap.add_argument("--block-k", default="128", type=_ints)
    ap.add_argument("--split-k", default="1,2,4,8,16", type=_ints)
    ap.add_argument("--warps", default="4", type=_ints)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per configuration and round")
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("triton_sweep: torch sees no CUDA device (use --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    results = sweep(args.formats.split(","), shapes, args.rows, device, args.block_n, args.block_k,
                    args.split_k, args.warps, args.rounds, args.budget)
    text = markdown(results, describe(device))
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 1 if any(r.get("wrong") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
