"""What calibrate + GPTQ costs: wall time and peak RSS of `lowbit quantize --method gptq --data`,
per model and calibration size, with the KLD the result scores.

    python bench/gptq_cost.py                                  # SmolLM2 and Gemma-3, 128x512 and 128x2048
    python bench/gptq_cost.py --models smollm2-135m --sizes 128x512 --eval-chunks 10 --json OUT

Each run is a fresh `lowbit` process (so peak RSS is that run's alone, read from wait4's rusage);
the growth columns compare each model with the first one at the same calibration size. Runs one
at a time: on a shared machine the seconds mean little, so note the load average printed beside.
The rows go to bench/results/gptq_cost.json (replaced) unless --json names another file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def run_measured(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, stdout) of one command; wait4 gives this child's own peak RSS."""
    began = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.execvp(cmd[0], cmd)
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - began
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status):
            tail = err.read().strip().splitlines()
            sys.exit(f"failed: {' '.join(cmd)}\n{tail[-1] if tail else ''}")
        return wall, usage.ru_maxrss / 1024, out.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--sizes", default="128x512,128x2048", help="SAMPLESxSEQLEN, comma separated")
    ap.add_argument("--format", default="int4", help="--format for lowbit quantize")
    ap.add_argument("--group-size", default="64")
    ap.add_argument("--data", default="wiki-calib")
    ap.add_argument("--eval-data", default="wiki-eval")
    ap.add_argument("--eval-chunks", type=int, default=0, help="score each result (0: skip)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=RESULTS / "gptq_cost.json",
                    help="rows file, replaced (default bench/results/gptq_cost.json)")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            samples, seqlen = (int(v) for v in size.lower().split("x"))
            for model in args.models.split(","):
                out = Path(tmp) / f"{model}-{size}"
                load = os.getloadavg()[0]
                cmd = ["lowbit", "quantize", model, "--format", args.format, "--group-size", args.group_size,
                       "--method", "gptq", "--data", args.data, "--samples", str(samples), "--seqlen", str(seqlen),
                       "-o", str(out), "--overwrite", "--json"]
                wall, rss, stdout = run_measured(cmd)
                summary = json.loads(stdout)
                row = {"model": model, "samples": samples, "seqlen": seqlen, "tokens": samples * seqlen,
                       "params": summary.get("params_total") or summary.get("parameters"),
                       "seconds": round(wall, 1), "peak_rss_mb": round(rss), "load_before": round(load, 2),
                       "load_after": round(os.getloadavg()[0], 2)}
                if args.eval_chunks:
                    _, _, ev = run_measured(["lowbit", "eval", str(out), "--data", args.eval_data, "--chunks",
                                             str(args.eval_chunks), "--ctx", str(args.ctx), "--base", model, "--json"])
                    result = json.loads(ev)
                    row["ppl"] = round(result["ppl"], 3)
                    row["kld"] = round(result["kld"]["mean"], 4)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

    print(f"\n`python {' '.join(sys.argv)}`\n")
    header = ["model", "samples x seqlen", "wall s", "peak RSS MB", "x time vs first model", "x RSS vs first model", "KLD", "load"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    first: dict[str, dict] = {}
    for r in rows:
        key = f"{r['samples']}x{r['seqlen']}"
        base = first.setdefault(key, r)
        print(f"| {r['model']} | {key} | {r['seconds']} | {r['peak_rss_mb']} | {r['seconds'] / base['seconds']:.2f} | "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f} | {r.get('kld', '–')} | {r['load_before']}→{r['load_after']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
