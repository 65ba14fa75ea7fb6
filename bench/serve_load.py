"""Load test for `lowbit serve`: N concurrent streaming clients for a fixed time per N.

    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 1,4,16,64 --seconds 30
    python bench/serve_load.py --model smollm2-135m --serve-args "--kv-memory 1GiB" ...

With --model it starts `lowbit serve` itself on a free loopback port (and reports the server's
peak RSS, VmHWM); with --url it drives a server that is already running (--pid for its RSS).
Each client loops: one streaming /v1/completions request (greedy, ignore_eos, --max-tokens
tokens, its own prompt) after another until the time is up; requests still open then are
finished, not counted in the time. Reports per N: requests/s, aggregate output tok/s, p50/p99
time to first token, inter-token latency (per request, guidellm's: the time from its first token to
its last over the tokens after the first) and the gap between streamed chunks (a chunk carries
every token a step or a several-step call made for the request, so several at once when the
server batches steps), errors (must be 0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import free_port, wait_ready  # noqa: E402

PROMPTS = [
    "The history of the city begins",
    "Write a short note to a friend about",
    "In the morning the market was",
    "A recipe for bread needs",
    "The main idea of the theory is",
    "Once upon a time in a small village",
    "The weather report for tomorrow says",
    "Three reasons to learn a language are",
]


@dataclass(slots=True)
class ClientStats:
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def one_request(host: str, port: int, model: str, prompt: str, max_tokens: int, stats: ClientStats) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        first = last = None
        tokens, done = 0, False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                if last is None:
                    stats.ttft.append(now - start)
                    first = now
                else:
                    stats.gaps.append(now - last)
                last = now
        if not done or tokens != max_tokens:
            raise RuntimeError(f"stream ended early ({tokens} of {max_tokens} tokens)")
        if tokens > 1 and first is not None:
            stats.itl.append((last - first) / (tokens - 1))
        stats.requests += 1
        stats.tokens += tokens
    except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
        stats.errors += 1
        stats.messages.append(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_level(host: str, port: int, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    stats = [ClientStats() for _ in range(clients)]
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        k = 0
        while time.perf_counter() < stop_at:
            prompt = f"{PROMPTS[(i + k) % len(PROMPTS)]} (client {i}, request {k})"
            one_request(host, port, model, prompt, max_tokens, stats[i])
            k += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ttft = sorted(x for s in stats for x in s.ttft)
    itl = sorted(x for s in stats for x in s.itl)
    gaps = sorted(x for s in stats for x in s.gaps)
    requests = sum(s.requests for s in stats)
    tokens = sum(s.tokens for s in stats)
    return {
        "clients": clients, "seconds": round(elapsed, 2), "requests": requests,
        "requests_per_s": requests / elapsed, "output_tok_per_s": tokens / elapsed,
        "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
        "chunk_gap_p50_ms": 1000 * pct(gaps, 50), "chunk_gap_p99_ms": 1000 * pct(gaps, 99),
        "errors": sum(s.errors for s in stats), "error_messages": [m for s in stats for m in s.messages][:5],
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def peak_rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="A running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="Start `lowbit serve MODEL` on a free loopback port instead")
    ap.add_argument("--serve-args", default="", help="Extra `lowbit serve` arguments (with --model)")
    ap.add_argument("--pid", type=int, help="The running server's pid, for its peak RSS (with --url)")
    ap.add_argument("--served-model", default=None, help="The model id to send (default: asked from /v1/models)")
    ap.add_argument("--clients", default="1,4,16,64", help="Comma-separated concurrency levels")
    ap.add_argument("--seconds", type=float, default=30.0, help="Time per level")
    ap.add_argument("--max-tokens", type=int, default=64, help="Output tokens per request")
    ap.add_argument("--json", action="store_true", help="Print one JSON object")
    args = ap.parse_args()
    if bool(args.url) == bool(args.model):
        ap.error("give exactly one of --url and --model")

    proc, pid = None, args.pid
    if args.model:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "lowbit", "serve", args.model, "--port", str(port), *shlex.split(args.serve_args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid = proc.pid
    else:
        url = args.url.rstrip("/")
    try:
        wait_ready(url, proc)
        parsed = urlparse(url)
        model = args.served_model
        if model is None:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                model = json.load(r)["data"][0]["id"]
        one_request(parsed.hostname, parsed.port, model, PROMPTS[0], 4, ClientStats())  # warm-up
        levels = []
        for n in (int(x) for x in args.clients.split(",")):
            level = run_level(parsed.hostname, parsed.port, model, n, args.seconds, args.max_tokens)
            levels.append(level)
            if not args.json:
                print(f"{n:>3} clients: {level['requests_per_s']:.2f} req/s, {level['output_tok_per_s']:.1f} tok/s, "
                      f"TTFT p50 {level['ttft_p50_ms']:.0f} ms p99 {level['ttft_p99_ms']:.0f} ms, "
                      f"ITL p50 {level['itl_p50_ms']:.1f} ms p99 {level['itl_p99_ms']:.1f} ms, "
                      f"chunk gap p50 {level['chunk_gap_p50_ms']:.1f} ms p99 {level['chunk_gap_p99_ms']:.1f} ms, "
                      f"errors {level['errors']}", file=sys.stderr, flush=True)
        result = {"url": url, "model": model, "max_tokens": args.max_tokens, "seconds_per_level": args.seconds,
                  "levels": levels, "server_peak_rss_mib": peak_rss_mib(pid),
                  "load_average": os.getloadavg()}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


def print_table(result: dict) -> None:
    print("| clients | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | chunk gap p50 ms "
          "| chunk gap p99 ms | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lv in result["levels"]:
        print(f"| {lv['clients']} | {lv['requests_per_s']:.2f} | {lv['output_tok_per_s']:.1f} | {lv['ttft_p50_ms']:.0f} "
              f"| {lv['ttft_p99_ms']:.0f} | {lv['itl_p50_ms']:.1f} | {lv['itl_p99_ms']:.1f} | {lv['chunk_gap_p50_ms']:.1f} "
              f"| {lv['chunk_gap_p99_ms']:.1f} | {lv['errors']} |")
    rss = result["server_peak_rss_mib"]
    print(f"\nserver peak RSS: {f'{rss:.0f} MiB' if rss else 'unknown'}; "
          f"load average {', '.join(f'{x:.1f}' for x in result['load_average'])}")


if __name__ == "__main__":
    main()
