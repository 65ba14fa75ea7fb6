"""Quantized matmul speed per format and layer shape, against bf16 F.linear and the memory roofline.

    python bench/kernel_speed.py              # every format x shape x M (minutes on a 2-core CPU)
    python bench/kernel_speed.py --quick      # a subset
    python bench/kernel_speed.py --json       # one JSON object on stdout as well
    python bench/kernel_speed.py --device cuda --rows 1,2,4,8,16 --peak-gb-s 4800 --markdown OUT.md

For each (format, N x K, M): the path dispatch picked, the median time of qmatmul, the effective
weight bandwidth (bytes the path reads / time), its ratio to the machine's streaming-read
bandwidth (measured here: a sum over a buffer far larger than the last-level cache), and the
speed-up over bf16 F.linear of the same shape, timed in the same run in alternating rounds
(bf16, then every format, repeated) so load changes on a shared machine hit all alike. Weights are rotated through
enough copies to exceed the cache, so every call streams its weight from memory as decode does.
On a CUDA machine the same script times the Triton path against cuBLAS bf16, each sample a run of
20 back-to-back calls between two CUDA events (one call of a decode-sized matmul is shorter than a
synchronisation), on larger default shapes, twice: replayed from one CUDA graph ("time µs", the
device's own time) and launched one by one from Python ("eager µs", what an eager caller waits;
the first GPU check found every call of a fast kernel there bound by its launch); --peak-gb-s gives the bandwidth the "of peak" columns
divide by (the datasheet's HBM figure, e.g. 4800 for an H200; default: the streaming read measured
here), for the kernel and for bf16 alike. --path forces a kernel path (e.g. `triton` on the CPU
under TRITON_INTERPRET=1, which bench/gpu_check.sh --dry-run uses); --markdown appends the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from lowbit.kernels import prepare, qmatmul
from lowbit.quant.registry import get_format, parse_spec

FORMATS = ["int4", "int4-asym", "int8", "nf4", "fp8", "fp8-block128", "mxfp4", "nvfp4"]
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096)]  # (N out, K in)
ROWS = [1, 8, 64, 512]
QUICK = {"formats": ["int4", "int8", "nf4", "fp8", "mxfp4", "nvfp4"], "shapes": [(576, 576), (1536, 576), (4096, 4096)], "rows": [1, 8]}
CUDA_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # Llama-3-8B's: large enough to stream from HBM
ROTATE_BYTES = 96 << 20  # > 3x a 32 MiB L3


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def sample_times(calls, device, budget_s=0.4, min_reps=5, max_reps=200, graph: bool = False) -> list[float]:
    """Seconds per call, cycling through `calls` (one per weight copy), after two warm-up calls.
    graph: on a GPU, replay the calls from a CUDA graph (the device's time, launch overhead left out)."""
    for c in calls[:2]:
        c()
    sync(device)
    if device.type == "cuda":
        return _cuda_sample_times(calls, budget_s, min_reps, max_reps, graph=graph)
    times = []
    start = time.perf_counter()
    i = 0
    while (i < min_reps or time.perf_counter() - start < budget_s) and i < max_reps:
        t = time.perf_counter()
        calls[i % len(calls)]()
        sync(device)
        times.append(time.perf_counter() - t)
        i += 1
    return times


def _cuda_graph(calls, per_sample: int):
    """One CUDA graph of `per_sample` calls (warmed up on a side stream first, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:3]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_sample):
            calls[i % len(calls)]()
    return g


def _cuda_sample_times(calls, budget_s, min_samples, max_samples, per_sample=20, graph=False) -> list[float]:
    """Seconds per call on a GPU: each sample times `per_sample` back-to-back calls with events,
    launched one by one from Python, or replayed from one CUDA graph."""
    replay = _cuda_graph(calls, per_sample).replay if graph else None
    times = []
    start = time.perf_counter()
    i = 0
    while (len(times) < min_samples or time.perf_counter() - start < budget_s) and len(times) < max_samples:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if replay is not None:
            replay()
        else:
            for _ in range(per_sample):
                calls[i % len(calls)]()
                i += 1
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000 / per_sample)
    return times


def median_time(calls, device, budget_s=0.4, min_reps=5, max_reps=200) -> float:
    return statistics.median(sample_times(calls, device, budget_s, min_reps, max_reps))


def interleaved_medians(candidates: dict, device, rounds: int, budget_s: float, graph: bool = False) -> dict:
    """Median seconds per call of each candidate, timed in alternating rounds so that a change in
    the machine's load during the run hits every candidate alike."""
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, calls in candidates.items():
            samples[name] += sample_times(calls, device, budget_s / rounds, min_reps=3, max_reps=max(3, 200 // rounds),
                                          graph=graph)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def stream_bandwidth(device) -> float:
    """Bytes/s of a sum over a 512 MiB buffer (a read-only stream)."""
    buf = torch.ones(128 << 20, dtype=torch.float32, device=device)
    t = median_time([lambda: buf.sum()], device, budget_s=1.0, min_reps=5)
    return buf.numel() * 4 / t


def copies_for(nbytes: int) -> int:
    return max(2, min(64, -(-ROTATE_BYTES // max(nbytes, 1))))


def quantize(label: str, w: torch.Tensor):
    # Scale search does not change kernel speed; the plain rules quantize large shapes quickly.
    text = label + ("-floor" if label.startswith("mxfp4") else "-absmax")
    spec = parse_spec(text)
    return get_format(spec).quantize(w, spec)


def run(formats, shapes, rows, device, rounds: int = 5, budget_s: float = 0.3, path: str | None = None,
        peak_gb_s: float | None = None) -> dict:
    """`budget_s`: seconds per candidate and round; `path`: force a kernel path (dispatch's choice
    when None); `peak_gb_s`: the bandwidth "of peak" divides by (default: the measured stream)."""
    bw = stream_bandwidth(device)
    peak = peak_gb_s * 1e9 if peak_gb_s else bw
    load_before = _load_average()
    results = []
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        dense = [w.to(device=device, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        prepared = {}
        for label in formats:
            qt = quantize(label, w)
            first = prepare(qt, device, path)
            prepared[label] = [first] + [prepare(qt, device, path) for _ in range(copies_for(first.nbytes) - 1)]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            candidates = {"bf16": [lambda d=d: F.linear(x, d) for d in dense]}
            for label, ps in prepared.items():
                candidates[label] = [lambda p=p: qmatmul(x, p) for p in ps]
            # on a GPU: the device's time (graph replay), and the time a Python caller sees per call
            t = interleaved_medians(candidates, device, rounds, budget_s=budget_s * rounds, graph=device.type == "cuda")
            eager = interleaved_medians(candidates, device, rounds, budget_s=budget_s * rounds) if device.type == "cuda" else t
            bf16_gbs = n * k * 2 / t["bf16"]
            for label, ps in prepared.items():
                first = ps[0]
                gbs = first.nbytes / t[label]
                results.append({
                    "format": label, "path": first.path, "n": n, "k": k, "m": m, "us": t[label] * 1e6,
                    "gb_s": gbs / 1e9, "of_stream": gbs / bw, "of_peak": gbs / peak, "vs_bf16": t["bf16"] / t[label],
                    "bf16_us": t["bf16"] * 1e6, "bf16_of_peak": bf16_gbs / peak,
                    "eager_us": eager[label] * 1e6, "bf16_eager_us": eager["bf16"] * 1e6,
                })
        del dense, prepared
    return {
        "device": describe(device), "threads": torch.get_num_threads(), "stream_gb_s": bw / 1e9,
        "peak_gb_s": peak / 1e9, "peak_source": "given" if peak_gb_s else "measured stream", "results": results,
        "load_average": [load_before, _load_average()],
    }


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def describe(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"


def show(report: dict, console: Console) -> None:
    loads = " → ".join(f"{v:.1f}" for v in report["load_average"] if v is not None)
    table = Table(title=f"{report['device']} · streaming read {report['stream_gb_s']:.1f} GB/s · load average {loads}")
    for col in ("format", "path", "N x K", "M", "time µs", "GB/s", "of stream", "bf16 µs", "× bf16"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            r["format"], r["path"], f"{r['n']}x{r['k']}", str(r["m"]), f"{r['us']:.0f}", f"{r['gb_s']:.1f}",
            f"{r['of_stream']:.0%}", f"{r['bf16_us']:.0f}", f"{r['vs_bf16']:.2f}",
        )
    console.print(table)


def markdown(report: dict) -> str:
    """The table as markdown: one row per (format, shape, M), bf16 beside it."""
    lines = [f"{report['device']} · streaming read {report['stream_gb_s']:.1f} GB/s measured · "
             f"of peak = weight bytes per second / {report['peak_gb_s']:.0f} GB/s ({report['peak_source']})", "",
             "| format | path | N x K | M | time µs | GB/s | of peak | bf16 µs | bf16 of peak | × bf16 | eager µs | bf16 eager µs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        lines.append(f"| {r['format']} | {r['path']} | {r['n']}x{r['k']} | {r['m']} | {r['us']:.1f} | {r['gb_s']:.1f} | "
                     f"{r['of_peak']:.0%} | {r['bf16_us']:.1f} | {r['bf16_of_peak']:.0%} | {r['vs_bf16']:.2f} | "
                     f"{r['eager_us']:.1f} | {r['bf16_eager_us']:.1f} |")
    return "\n".join(lines) + "\n"


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset of formats, shapes and batch sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--formats", nargs="*", help="format names (default: all)")
    ap.add_argument("--rows", type=_int_list, help="comma-separated M values (default: 1,8,64,512; --quick 1,8)")
    ap.add_argument("--shapes", type=_shapes, help="comma-separated NxK weight shapes (default: per device)")
    ap.add_argument("--path", help="force this kernel path (see lowbit.kernels.dispatch; default: its choice)")
    ap.add_argument("--peak-gb-s", type=float, help="bandwidth for the 'of peak' columns (default: the measured stream)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per candidate and round")
    ap.add_argument("--markdown", type=argparse.FileType("a"), help="append the markdown table to this file")
    ap.add_argument("--json", action="store_true", help="also print one JSON object on stdout")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's); 1 is steadier on a busy machine")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pick = QUICK if args.quick else {"formats": FORMATS, "shapes": CUDA_SHAPES if device.type == "cuda" else SHAPES, "rows": ROWS}
    formats = args.formats or pick["formats"]
    report = run(formats, args.shapes or pick["shapes"], args.rows or pick["rows"], device, args.rounds, args.budget,
                 args.path, args.peak_gb_s)
    show(report, Console(stderr=True, width=140))
    if args.markdown:
        args.markdown.write(markdown(report))
        args.markdown.close()
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
