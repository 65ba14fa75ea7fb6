"""lowbit beside llama.cpp on exactly the same weights, in one run, on this machine.

For each case the model is quantized by lowbit (or kept bf16), exported to GGUF *exactly*
(`lowbit convert --to gguf` must report exact: int4 g32 → Q4_0, int8 g32 → Q8_0, bf16 → BF16; the
int8 case runs lowbit's default int8 activations, Q8_0's arithmetic, and int8-a32 the same checkpoint
with `--int8-activations f32`), and
then `llama-bench -p 512 -n 128` with `llama-batched-bench -npp 8 -ntg 128 -npl 16` (16 sequences
decoding at once: its S_TG) and `lowbit bench` (prefill 512, decode 128 at batch 1 and of 16
sequences, 8-token prompts) run alternately `--pairs` times with the same thread count. Reported: the medians
and the median of the paired ratios (this VM drifts 10-20 % between runs, so pairs are compared
minutes apart, not hours). Each side's batch-1 decode is also set against the streaming read
measured around it (`lowbit bench` measures its own; this script measures llama.cpp's just before
and after its llama-bench, the same way): "÷ roofline" is a token's time over (bytes a token reads ÷
that bandwidth) for each tool, and the "at equal bandwidth" ratio divides each pair's tok/s by its
own side's bandwidth first, which shows which tool uses the memory better when the VM's bandwidth
moved between the two halves of a pair (the plain ratio stays the measure the targets name).

llama.cpp is built once from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp) into
$LOWBIT_HOME/llamacpp, with cmake and a C++ compiler (Debian's). Not part of CI: the download and
build take several minutes.

    python bench/vs_llamacpp.py [--model smollm2-135m] [--cases int4,int4-g64,int8,int8-a32,bf16] [--pairs 3] [--threads 2]
        [--llama-bench PATH] [--json]

--model takes any model lowbit quantizes, e.g. bench/moe_synthetic.py's mixture-of-experts model; its
"decode ÷ roofline" then counts the active bytes (the routed experts') a token reads.

--depths 512,1024 measures instead decode at batch 1 after that many context tokens: `llama-bench
-p 0 -n 64 -d D` (its "tg64 @ dD") beside `lowbit bench --prompt-tokens D --gen-tokens 64`, both
timing the 64 generated tokens only; results in vs_llamacpp-depth*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lowbit.paths import lowbit_home

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, print_table, results_file, save_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Case:
    """One comparison: lowbit's quantize format (None: the float model), the GGUF type its exact
    export holds, the checkpoint it shares with other cases (default its own), and extra
    `lowbit bench` and `lowbit quantize` options."""

    fmt: str | None
    gguf_type: str
    ckpt: str | None = None
    bench_args: tuple[str, ...] = ()
    quantize_args: tuple[str, ...] = ()


# int4-g64 → Q4_0 is exact too (each 32-block repeats its group's scale); both int4 cases run lowbit's
# int4 kernel (int4_vnni.c: AVX512-VNNI, or AVX2), which takes any group of whole 32s. int8 runs
# lowbit's default int8 kernel (cpu-int8dot where the CPU has AVX512-VNNI: activations rounded to
# int8 per 32, Q8_0's own arithmetic); int8-a32 the same checkpoint with float32 activations. bf16
# runs the model with the default activations (bf16 where the CPU has AVX512-BF16: llama.cpp BF16's
# arithmetic; float32 elsewhere); bf16-a16 the same files with --dense-activations bf16 named (AVX512-BF16
# only), bf16-a32 with --dense-activations f32 (float32 x, exact products). int4-int8head quantizes
# the (tied) head too, int8 g32 → a Q8_0 token_embd that llama.cpp reads as its output matrix as
# well (bench/recipes/int4-g32-int8-head.yaml): Gemma-3-270M's bf16 head is 335 MB of a 390 MB step,
# so with it both tools time mostly one bf16 GEMV. Every checkpoint here is saved in bf16, so lowbit's
# KV cache is bf16 by default (--kv-dtype auto; llama.cpp's is f16, the same bytes); int4-kv32 runs
# the int4 checkpoint over a float32 cache (--kv-dtype f32), twice the bytes.
CASES = {"int4": Case("int4-g32", "Q4_0"), "int4-g64": Case("int4-g64", "Q4_0"), "int8": Case("int8-g32", "Q8_0"),
         "int8-a32": Case("int8-g32", "Q8_0", ckpt="int8", bench_args=("--int8-activations", "f32")),
         "int4-kv32": Case("int4-g32", "Q4_0", ckpt="int4", bench_args=("--kv-dtype", "f32")),
         "int4-int8head": Case("int4-g32", "Q4_0 + Q8_0 head", quantize_args=(
             "--quantize-head", "--recipe", str(ROOT / "bench" / "recipes" / "int4-g32-int8-head.yaml"))),
         "bf16": Case(None, "BF16"), "bf16-a16": Case(None, "BF16", ckpt="bf16", bench_args=("--dense-activations", "bf16")),
         "bf16-a32": Case(None, "BF16", ckpt="bf16", bench_args=("--dense-activations", "f32"))}
TOOLS = ("llama-bench", "llama-batched-bench", "llama-perplexity", "llama-server")


def build_llama_cpp(home: Path) -> Path:
    """The directory holding llama-bench (built here on first use)."""
    bin_dir = home / "build" / "bin"
    build = home / "build"
    missing = [t for t in TOOLS if not (bin_dir / t).is_file()]
    if not missing:
        return bin_dir
    if (build / "CMakeCache.txt").is_file():  # an earlier build: only what it lacks (a tool added since)
        log(f"building {', '.join(missing)}")
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *missing],
                       check=True, capture_output=True)
        return bin_dir
    home.mkdir(parents=True, exist_ok=True)
    sdists = sorted(home.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log("downloading the llama-cpp-python sdist (its vendor/llama.cpp is the source)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(home), "-q"], check=True)
        sdists = sorted(home.glob("llama_cpp_python-*.tar.gz"))
    source = home / sdists[-1].name.removesuffix(".tar.gz")
    if not source.is_dir():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(home, filter="data")
    src = source / "vendor" / "llama.cpp"
    log(f"building {', '.join(TOOLS)} from {src} (several minutes)")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TOOLS],
                   check=True, capture_output=True)
    return bin_dir


def log(message: str) -> None:
    print(f"[vs_llamacpp] {message}", file=sys.stderr, flush=True)


def lowbit(*args: str, capture: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "lowbit", *args], capture_output=capture, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lowbit {' '.join(args)} failed:\n{done.stderr[-2000:] if capture else ''}")
    return done.stdout


def prepare(model: str, case: str, work: Path) -> tuple[str, Path]:
    """(what lowbit runs, the GGUF llama.cpp runs): the same weights, checked exact."""
    spec = CASES[case]
    name = spec.ckpt or case
    if spec.fmt is None:
        ckpt = model
    else:
        ckpt = str(work / name)
        if not Path(ckpt).is_dir():
            lowbit("quantize", model, "--format", spec.fmt, *spec.quantize_args, "-o", ckpt)
    gguf = work / f"{name}.gguf"
    if not gguf.is_file():
        summary = json.loads(lowbit("convert", ckpt, "-o", str(gguf), "--to", "gguf", "--json"))
        if not summary["exact"]:
            raise SystemExit(f"{case}: the GGUF export is not exact, so the two would not run the same weights")
    return ckpt, gguf


def run_llama(binary: Path, args: list[str]) -> subprocess.CompletedProcess:
    """One llama.cpp tool run from a fresh copy of its build folder (the binary and its shared
    libraries, found first through LD_LIBRARY_PATH): lowbit loads a private copy of each kernel
    library per process (native/build.py `_load`; this VM ran code from long-lived library files
    slower), so llama.cpp gets the same."""
    with tempfile.TemporaryDirectory(prefix="llama-bin-") as tmp:
        fresh = Path(tmp) / "bin"
        shutil.copytree(binary.parent, fresh, symlinks=True)
        env = {**os.environ, "LD_LIBRARY_PATH": f"{fresh}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":")}
        return subprocess.run([str(fresh / binary.name), *args], capture_output=True, text=True, check=True, env=env)


def run_llama_bench(binary: Path, gguf: Path, threads: int) -> dict:
    done = run_llama(binary, ["-m", str(gguf), "-p", "512", "-n", "128", "-t", str(threads), "-r", "3", "-o", "json"])
    rows = json.loads(done.stdout)
    prefill = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    decode = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"prefill_tok_s": prefill["avg_ts"], "decode_tok_s": decode["avg_ts"]}


def run_llama_batched(binary: Path, gguf: Path, threads: int, sequences: int = 16) -> float:
    """llama.cpp's decode tok/s with `sequences` sequences at once, as `lowbit bench --batches 16` runs
    them (8-token prompts, 128 tokens each): llama-batched-bench's S_TG."""
    done = run_llama(binary, ["-m", str(gguf), "-c", "4096", "-b", "2048", "-ub", "512", "-npp", "8", "-ntg", "128",
                              "-npl", str(sequences), "-t", str(threads), "--output-format", "jsonl"])
    rows = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    return rows[-1]["speed_tg"]


def stream_gbs(threads: int) -> float:
    """The streaming read `lowbit bench` measures (the best of five sums of 256 MB), here, with the
    peers' thread count: the bandwidth llama.cpp's half of a pair met."""
    import torch

    from lowbit.runtime.engine.benchmark import stream_bandwidth_gbs

    torch.set_num_threads(threads)
    return stream_bandwidth_gbs(torch.device("cpu"))


def run_llama_pair_half(binary: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp's half of a pair: llama-bench and llama-batched-bench, with the streaming read
    measured just before and just after llama-bench (their mean)."""
    before = stream_gbs(threads)
    theirs = run_llama_bench(binary, gguf, threads)
    theirs["stream_bandwidth_gbs"] = (before + stream_gbs(threads)) / 2
    theirs["decode16_tok_s"] = run_llama_batched(binary.parent / "llama-batched-bench", gguf, threads)
    return theirs


def summarize_case(case: str, pairs: list[tuple[dict, dict]], gguf_bytes: int) -> dict:
    """One case's row from its (lowbit, llama.cpp) pairs: medians, the median paired ratio, each
    tool's decode over its roofline (the bytes a token reads, lowbit's count of the same weights,
    over the median of that tool's own bandwidth measurements) and the paired ratio at equal
    bandwidth (each side's tok/s per GB/s of its own measurement)."""
    med = lambda key, side: statistics.median(p[side][key] for p in pairs)  # noqa: E731
    ratio = lambda key: statistics.median(p[0][key] / p[1][key] for p in pairs)  # noqa: E731
    # the bytes each tool reads a token: lowbit's own count (a packed head by its packed bytes), and
    # for llama.cpp the same weights unpacked
    ours = pairs[0][0]
    token_bytes = (ours["decode_weight_bytes"], ours.get("decode_weight_bytes_unpacked", ours["decode_weight_bytes"]))
    roofline = lambda side: (1 / med("decode_tok_s", side)) / (token_bytes[side] / (med("stream_bandwidth_gbs", side) * 1e9))  # noqa: E731
    row = {
        "case": case, "gguf_type": CASES[case].gguf_type, "lowbit_args": list(CASES[case].bench_args), "gguf_bytes": gguf_bytes,
        "decode_tok_s": {"lowbit": med("decode_tok_s", 0), "llama.cpp": med("decode_tok_s", 1), "ratio": ratio("decode_tok_s")},
        "prefill_tok_s": {"lowbit": med("prefill_tok_s", 0), "llama.cpp": med("prefill_tok_s", 1), "ratio": ratio("prefill_tok_s")},
        "decode16_tok_s": med("decode16_tok_s", 0),
        "decode16": {"lowbit": med("decode16_tok_s", 0), "llama.cpp": med("decode16_tok_s", 1), "ratio": ratio("decode16_tok_s")},
        # s per token at the streaming bandwidth: the median of the pairs' own measurements (one
        # measurement swung 34-55 GB/s within a run on a VM)
        "decode_vs_roofline": roofline(0),
        "pairs": [{"lowbit": o, "llama.cpp": t} for o, t in pairs],
    }
    if all("stream_bandwidth_gbs" in t for _, t in pairs):  # older results lack llama.cpp's measurement
        row["llama_cpp_decode_vs_roofline"] = roofline(1)
        row["decode_ratio_at_equal_bandwidth"] = statistics.median(
            (o["decode_tok_s"] / o["stream_bandwidth_gbs"]) / (t["decode_tok_s"] / t["stream_bandwidth_gbs"]) for o, t in pairs)
    return row


def run_lowbit_bench(ckpt: str, threads: int, extra: tuple[str, ...] = ()) -> dict:
    out = json.loads(lowbit("bench", ckpt, "--batches", "1,16", "--prompt-tokens", "8", "--gen-tokens", "128",
                            "--prefill-tokens", "512", "--threads", str(threads), *extra, "--json"))
    by_batch = {d["batch"]: d["decode_tok_s"] for d in out["decode"]}
    return {"prefill_tok_s": out["prefill_tok_s"], "decode_tok_s": by_batch[1], "decode16_tok_s": by_batch[16],
            "decode_weight_bytes": out["decode_weight_bytes"], "stream_bandwidth_gbs": out["stream_bandwidth_gbs"],
            "decode_weight_bytes_unpacked": out.get("decode_weight_bytes_unpacked", out["decode_weight_bytes"])}


DEPTH_TOKENS = 64


def llama_at_depths(binary: Path, gguf: Path, threads: int, depths: list[int]) -> dict[int, float]:
    done = run_llama(binary, ["-m", str(gguf), "-p", "0", "-n", str(DEPTH_TOKENS), "-d", ",".join(map(str, depths)),
                              "-t", str(threads), "-r", "3", "-o", "json"])
    return {int(r["n_depth"]): r["avg_ts"] for r in json.loads(done.stdout) if r["n_gen"] > 0}


def lowbit_at_depth(ckpt: str, threads: int, depth: int, extra: tuple[str, ...] = ()) -> float:
    out = json.loads(lowbit("bench", ckpt, "--batches", "1", "--prompt-tokens", str(depth), "--gen-tokens",
                            str(DEPTH_TOKENS), "--prefill-tokens", "16", "--threads", str(threads), *extra, "--json"))
    return out["decode"][0]["decode_tok_s"]


def depth_runs(args, binary: Path, work: Path, cases: list[str], depths: list[int]) -> None:
    rows = []
    for case in cases:
        ckpt, gguf = prepare(args.model, case, work)
        pairs = []
        for i in range(args.pairs):
            theirs = llama_at_depths(binary, gguf, args.threads, depths)
            ours = {d: lowbit_at_depth(ckpt, args.threads, d, CASES[case].bench_args) for d in depths}
            pairs.append((ours, theirs))
            log(f"{case} pair {i + 1}: " + ", ".join(f"depth {d}: {ours[d]:.1f} vs {theirs[d]:.1f} tok/s" for d in depths))
        for d in depths:
            rows.append({"case": case, "depth": d, "lowbit": statistics.median(p[0][d] for p in pairs),
                         "llama.cpp": statistics.median(p[1][d] for p in pairs),
                         "ratio": statistics.median(p[0][d] / p[1][d] for p in pairs),
                         "pairs": [{"lowbit": o[d], "llama.cpp": t[d]} for o, t in pairs]})
    stamp = time.strftime("%Y-%m-%d %H:%M")
    result = {"script": "bench/vs_llamacpp.py --depths", "date": stamp, "model": args.model, "threads": args.threads,
              "tokens": DEPTH_TOKENS, "machine": describe(), "rows": rows}
    if save_results(_results_file(args.model, "vs_llamacpp-depth"), result, args.json):
        return
    print(f"{args.model}, decode of {DEPTH_TOKENS} tokens at depth, {args.threads} threads, {args.pairs} alternated pairs, "
          f"{result['machine']}")
    print_table(["case", "depth", "lowbit tok/s", "llama.cpp tok/s", "ratio (pairs)"],
                [[r["case"], str(r["depth"]), f"{r['lowbit']:.1f}", f"{r['llama.cpp']:.1f}",
                  f"{r['ratio']:.2f}× (" + ", ".join(f"{p['lowbit'] / p['llama.cpp']:.2f}" for p in r["pairs"]) + ")"]
                 for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cases", default="int4,int4-g64,int8,int8-a32,bf16",
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", type=Path, default=None, help="an existing llama-bench binary")
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints and GGUFs go")
    parser.add_argument("--depths", default=None, help="decode at these context depths instead, e.g. 512,1024")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    binary = args.llama_bench or build_llama_cpp(lowbit_home() / "llamacpp") / "llama-bench"
    work = args.work or lowbit_home() / "vs_llamacpp" / Path(args.model).name
    work.mkdir(parents=True, exist_ok=True)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case {', '.join(unknown)}: the cases are {', '.join(CASES)}")
    if args.depths:
        depth_runs(args, binary, work, cases, [int(d) for d in args.depths.split(",")])
        return
    rows = []
    for case in cases:
        ckpt, gguf = prepare(args.model, case, work)
        pairs = []
        for i in range(args.pairs):
            theirs = run_llama_pair_half(binary, gguf, args.threads)
            ours = run_lowbit_bench(ckpt, args.threads, CASES[case].bench_args)
            pairs.append((ours, theirs))
            log(f"{case} pair {i + 1}: decode {ours['decode_tok_s']:.1f} vs {theirs['decode_tok_s']:.1f} tok/s "
                f"(streaming {ours['stream_bandwidth_gbs']:.0f} vs {theirs['stream_bandwidth_gbs']:.0f} GB/s), "
                f"prefill {ours['prefill_tok_s']:.0f} vs {theirs['prefill_tok_s']:.0f} tok/s, "
                f"16 sequences {ours['decode16_tok_s']:.0f} vs {theirs['decode16_tok_s']:.0f} tok/s")
        rows.append(summarize_case(case, pairs, gguf.stat().st_size))
    stamp = time.strftime("%Y-%m-%d %H:%M")
    for row in rows:
        row["date"] = stamp
    # one latest file: this run's cases replace theirs, the other cases stay (each row dated)
    path = _results_file(args.model)
    ran = {r["case"] for r in rows}
    kept = []
    if path.exists():
        old = json.loads(path.read_text())
        kept = [{"date": old.get("date"), **r} for r in old.get("cases", []) if r["case"] not in ran]
    result = {"script": "bench/vs_llamacpp.py", "date": stamp, "model": args.model,
              "threads": args.threads, "machine": describe(), "cases": kept + rows}
    if save_results(path, result, args.json):
        return
    print(f"{args.model}, {args.threads} threads, {args.pairs} alternated pairs, {result['machine']}")
    print("| case | GGUF | decode b1 lowbit | llama.cpp | ratio | at equal bandwidth | prefill 512 lowbit | llama.cpp | "
          "ratio | 16 sequences lowbit | llama.cpp | ratio | decode ÷ roofline: lowbit | llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        d, p, b = r["decode_tok_s"], r["prefill_tok_s"], r["decode16"]
        print(f"| {r['case']} | {r['gguf_type']} | {d['lowbit']:.1f} | {d['llama.cpp']:.1f} | {d['ratio']:.2f}× | "
              f"{r['decode_ratio_at_equal_bandwidth']:.2f}× | {p['lowbit']:.0f} | {p['llama.cpp']:.0f} | {p['ratio']:.2f}× | "
              f"{b['lowbit']:.0f} | {b['llama.cpp']:.0f} | {b['ratio']:.2f}× | {r['decode_vs_roofline']:.2f} | "
              f"{r['llama_cpp_decode_vs_roofline']:.2f} |")


def _results_file(model: str, stem: str = "vs_llamacpp") -> Path:
    """The demo model's file has no model name in it; one file per CPU class (bench/machine.py)."""
    return results_file(stem if model == "smollm2-135m" else f"{stem}-{Path(model).name}")


if __name__ == "__main__":
    if shutil.which("cmake") is None and "--llama-bench" not in sys.argv:
        raise SystemExit("cmake is needed to build llama.cpp (apt-get install cmake g++), or pass --llama-bench PATH")
    main()
