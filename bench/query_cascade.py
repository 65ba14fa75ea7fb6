"""The query cascade of `lowbit serve --cascade`, measured: output tok/s and agreement with the full
model over thresholds, at 1 and 16 concurrent requests.

For each setting a real `lowbit serve` runs on this machine (one at a time): the full model alone
(the baseline), then MODEL with `--cascade CHEAP --cascade-threshold T` for each T. Each setting
answers the same prompts (the starts of wiki-eval paragraphs), greedy, `--gen-tokens` tokens each
(ignore_eos, so every answer is the same length), first one at a time, then `--concurrency` at
once. Reported per setting and concurrency: output tok/s (all tokens ÷ wall time), the speedup over
the full model alone, the share of requests the cheap model answered, and greedy agreement with the
full model's answers (tokens equal position by position; escalated requests agree by construction).

    python bench/query_cascade.py [--model smollm2-135m] [--cheap self:int4] [--thresholds 0.9,0.8,0.7,0.6,0]
        [--prompts 16] [--gen-tokens 64] [--concurrency 16] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402
from servers import free_port, stop, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int, words: int = 24) -> list[str]:
    """The first `words` words of the first n wiki-eval paragraphs long enough to have them."""
    from lowbit.data.text import load_text

    out = []
    for para in load_text("wiki-eval").split("\n"):
        w = para.split()
        if len(w) >= 2 * words and not para.lstrip().startswith("="):
            out.append(" ".join(w[:words]))
        if len(out) == n:
            return out
    raise SystemExit(f"wiki-eval has fewer than {n} paragraphs of {2 * words} words")


def complete(base: str, prompt: str, gen: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    choice = answer["choices"][0]
    return {"tokens": choice["logprobs"]["tokens"], "answered_by": answer.get("cascade", {}).get("answered_by", "full"),
            "confidence": answer.get("cascade", {}).get("cheap_confidence")}


def run_batch(base: str, texts: list[str], gen: int, concurrency: int) -> tuple[list[dict], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda p: complete(base, p, gen), texts))
    return answers, time.perf_counter() - start


def measure(args, texts: list[str], cascade: list[str], log: Path) -> dict:
    """One server: {concurrency: (answers, seconds)} for 1 and --concurrency."""
    port = free_port()
    cmd = [sys.executable, "-m", "lowbit", "serve", args.model, "--port", str(port), "--threads", str(args.threads),
           *cascade]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, log=log)
            complete(base, "Warm up the kernels.", 8)
            return {c: run_batch(base, texts, args.gen_tokens, c) for c in (1, args.concurrency)}
        finally:
            stop(proc)


def agreement(answers: list[dict], full: list[dict]) -> float:
    same = total = 0
    for a, f in zip(answers, full):
        same += sum(x == y for x, y in zip(a["tokens"], f["tokens"]))
        total += len(f["tokens"])
    return 100 * same / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cheap", default="self:int4")
    ap.add_argument("--thresholds", default="0.9,0.8,0.7,0.6,0")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "query_cascade.json"))
    args = ap.parse_args()
    texts = prompts(args.prompts)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "query_cascade_logs"
    logs.mkdir(exist_ok=True)
    result = {"model": args.model, "cheap": args.cheap, "prompts": len(texts), "gen_tokens": args.gen_tokens,
              "threads": args.threads, "machine": describe(), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": []}
    full = measure(args, texts, [], logs / "full.log")
    print(f"{'setting':<24} {'conc':>4} {'tok/s':>7} {'speedup':>7} {'cheap %':>7} {'agree %':>7}")
    settings = [("full model alone", None)] + [(f"cascade T {t}", float(t)) for t in args.thresholds.split(",")]
    for name, threshold in settings:
        runs = full if threshold is None else measure(
            args, texts, ["--cascade", args.cheap, "--cascade-threshold", str(threshold)], logs / f"T{threshold}.log")
        for c, (answers, seconds) in runs.items():
            tok_s = len(texts) * args.gen_tokens / seconds
            base_tok_s = len(texts) * args.gen_tokens / full[c][1]
            row = {"setting": name, "threshold": threshold, "concurrency": c, "tok_s": round(tok_s, 1),
                   "speedup": round(tok_s / base_tok_s, 3),
                   "cheap_pct": round(100 * sum(a["answered_by"] == "cheap" for a in answers) / len(answers), 1),
                   "agreement_pct": round(agreement(answers, full[c][0]), 1),
                   "cheap_confidences": [a["confidence"] for a in answers]}
            result["rows"].append(row)
            print(f"{name:<24} {c:>4} {row['tok_s']:>7} {row['speedup']:>6}x {row['cheap_pct']:>7} "
                  f"{row['agreement_pct']:>7}", flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
