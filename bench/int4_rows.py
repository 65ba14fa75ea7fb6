"""What one decode step's int4 matmuls cost against the number of rows, beside two rooflines.

Rows are what a step multiplies through each weight: 1 at batch 1, 1 + k in a speculative
verify, the batch size when decoding many sequences. For the demo model quantized to int4 (RTN,
g128, q/k/v and gate/up joined as the engine runs them) this times the 120 layer matmuls and the
lm_head of one step on the batch-invariant kernel (native/int4_dot.c), best of `--reps`, and
prints beside it:
- the streaming bound: weight bytes over the bandwidth a float32 sum over 256 MB reaches here;
- the dot-product bound: rows x weights / 32 `vdpbf16ps` instructions at the rate a loop of
  independent ones reaches on each of the threads' cores at once (compiled on the spot; skipped
  without gcc), checked against torch's bf16 GEMM (GFLOP/s in the header; 64 flops per
  instruction).
Whichever is larger is what the step cannot beat with bf16 activations.

    python bench/int4_rows.py [--threads 2] [--rows 1,2,3,4,8,16] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lowbit.kernels import qmatmul
from lowbit.runtime.engine.draft_models import quantize_linears_
from lowbit.runtime.loader import load_model
from lowbit.formats.resolve import resolve_model

# Twelve accumulators in named registers (six cover the instruction's latency at one per
# cycle). The loop this replaced kept `a[16]` in an array that gcc -O2 left in memory (load,
# vdpbf16ps, store each), so it timed store-to-load forwarding: 0.74 ns instead of ~0.27.
DPBF16_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define ACC(i) __m512 a##i = _mm512_set1_ps((float)i);
#define DP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
int main(void) {
    const long n = 120000000;
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7) ACC(8) ACC(9) ACC(10) ACC(11)
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f00);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n / 12; i++) {
        DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11)
        __asm__ volatile("" : "+v"(x), "+v"(y));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    printf("%.4f %g\n", ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9) / n * 1e9, _mm512_reduce_add_ps(s));
    return 0;
}
"""


def dpbf16_ns(threads: int) -> float | None:
    """ns per vdpbf16ps on one core while `threads` cores run the loop at once (the slowest; None
    without gcc or AVX512-BF16)."""
    cc = shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.c", Path(tmp) / "loop"
        src.write_text(DPBF16_LOOP)
        if subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)], capture_output=True).returncode:
            return None
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
        return max(float(p.communicate()[0].split()[0]) for p in procs)


def torch_bf16_gflops(threads: int) -> float:
    """What torch's bf16 GEMM (oneDNN) reaches on `threads` threads at a compute-bound shape whose
    operands stay in cache: the rate a well-blocked kernel gets from the same instructions."""
    a, b = torch.randn(256, 576, dtype=torch.bfloat16), torch.randn(576, 2048, dtype=torch.bfloat16)
    a @ b
    best = min(_timed(lambda: [a @ b for _ in range(10)]) for _ in range(5)) / 10
    return 2 * 256 * 576 * 2048 / best / 1e9


def stream_gb_s() -> float:
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model), torch.bfloat16, torch.device("cpu"))
    quantize_linears_(model, "int4", torch.device("cpu"))
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.fused_qkv.prepared, attn.o_proj.prepared, mlp.fused_gate_up.prepared, mlp.down_proj.prepared]
    weights.append(model.lm_head.prepared)
    n_weights = sum(p.shape[0] * p.shape[1] for p in weights)
    n_bytes = sum(t.numel() * t.element_size() for p in weights for t in p.tensors.values() if t is not p.tensors.get("table"))
    bandwidth = stream_gb_s()
    ns = dpbf16_ns(args.threads)
    gemm = torch_bf16_gflops(args.threads)
    rows_out = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {p.shape[1] for p in weights}}

        def step():
            for p in weights:
                qmatmul(xs[p.shape[1]], p)

        step()
        ms = min(_timed(step) for _ in range(args.reps)) * 1e3
        stream_ms = n_bytes / bandwidth / 1e6
        dot_ms = None if ns is None else m * n_weights / 32 * ns / args.threads / 1e6
        rows_out.append({"rows": m, "ms": round(ms, 2), "ms_per_row": round(ms / m, 2),
                         "stream_bound_ms": round(stream_ms, 2), "dot_bound_ms": None if dot_ms is None else round(dot_ms, 2)})
    result = {"threads": args.threads, "weights": n_weights, "weight_bytes": n_bytes, "stream_gb_s": round(bandwidth, 1),
              "dpbf16_ns_per_core": ns, "torch_bf16_gemm_gflops": round(gemm, 1), "steps": rows_out}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.model} int4 g128: {n_weights / 1e6:.0f}M weights, {n_bytes / 1e6:.1f} MB per step; "
          f"streaming {bandwidth:.1f} GB/s; vdpbf16ps {ns if ns is None else round(ns, 3)} ns per core "
          f"({'-' if ns is None else round(64 / ns * args.threads)} GFLOP/s); torch bf16 GEMM {gemm:.0f} GFLOP/s; {args.threads} threads")
    print("| rows | step matmuls ms | ms per row | streaming bound ms | dot-product bound ms |\n| --- | --- | --- | --- | --- |")
    for r in rows_out:
        print(f"| {r['rows']} | {r['ms']} | {r['ms_per_row']} | {r['stream_bound_ms']} | {r['dot_bound_ms']} |")


if __name__ == "__main__":
    main()
