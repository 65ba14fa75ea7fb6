"""The int4 kernel's pass shape at 8 rows or more, measured on this CPU: 4 rows over two tiles
(the default, PASS_ROWS4 = 4) against 8 rows over one (PASS_ROWS4 = 8).

native/int4_vnni.c runs a matmul of M x rows as passes over the weight; at 8 rows or more a pass
is 4 rows over two tiles of 16 weight rows (each x broadcast serving both) since 2026-12-06, where
it had been 8 rows over one tile (each broadcast serving one, each tile's codes unpacked half as
often). That choice was measured on Zen 4 (2x 256-bit halves per 512-bit op); this script measures
it wherever it runs: bench/int4_pass_shapes.c (SmolLM2's four int4 matrices a layer, 2 threads,
the engine's part calls and barriers) compiled both ways with the machine's own flags, the two
builds alternated `--rounds` times, at each row count from cache (one layer) and from memory (30
layers), best of each round's repetitions. A ratio above 1 favours the default.

    python bench/int4_pass_shapes.py [--rows 8,16,64] [--groups 32,64] [--rounds 3] [--json]

Needs gcc and a CPU with AVX512-VNNI (elsewhere the kernel takes its AVX2 section, which has its
own pass sizes).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import ROOT, describe, print_table, results_file, save_results  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "int4_pass_shapes.c"
NATIVE = ROOT / "lowbit" / "native"
SHAPES = {4: "4 rows x 2 tiles (default)", 8: "8 rows x 1 tile"}
WORK_MACS = 3_538_944  # SmolLM2's multiply-adds a token in one layer's four matrices


def build(pass_rows: int, out: Path) -> Path:
    binary = out / f"passes{pass_rows}"
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-std=gnu11", f"-DPASS_ROWS4={pass_rows}", f"-I{NATIVE}",
           str(HARNESS), "-o", str(binary), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"building the harness failed:\n{done.stderr[-2000:]}")
    return binary


def run(binary: Path, rows: int, layers: int, group: int) -> float:
    """Minimum ms of one pass over `layers` layers at `rows` rows."""
    reps = max(20, int(40000 / (rows * layers)))
    done = subprocess.run([str(binary), str(reps), str(rows), str(layers), str(group)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{binary.name} failed ({done.returncode}): {done.stderr.strip()}")
    return float(done.stdout.split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,64", help="comma-separated row counts (8 or more: the shapes differ there)")
    ap.add_argument("--groups", default="32", help="comma-separated weight group sizes (32, 64, 128)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two builds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    if any(g not in (32, 64, 128) for g in groups):
        raise SystemExit("--groups: each one of 32, 64, 128")
    if any(r < 8 for r in rows):
        raise SystemExit("--rows: 8 or more (below 8 both builds run the same passes)")
    if shutil.which("gcc") is None:
        raise SystemExit("gcc is needed to build the harness")
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("this CPU has no AVX512-VNNI: the int4 kernel takes its AVX2 section, whose passes differ")
    with tempfile.TemporaryDirectory() as tmp:
        binaries = {p: build(p, Path(tmp)) for p in SHAPES}
        best: dict[tuple[int, int, int, int], float] = {}
        for _ in range(args.rounds):
            for g in groups:
                for r in rows:
                    for layers in (1, 30):
                        for p, binary in binaries.items():
                            t = run(binary, r, layers, g)
                            best[(p, g, r, layers)] = min(t, best.get((p, g, r, layers), float("inf")))
    table = []
    for g in groups:
        for r in rows:
            for layers in (1, 30):
                new, old = best[(4, g, r, layers)], best[(8, g, r, layers)]
                table.append({"group": g, "rows": r, "layers": layers, "from": "cache" if layers == 1 else "memory",
                              "ms_4x2": round(new, 4), "ms_8x1": round(old, 4), "ratio": round(old / new, 3),
                              "gmac_s_4x2": round(WORK_MACS * layers * r / new / 1e6, 1)})
    result = {"script": "bench/int4_pass_shapes.py", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": describe(),
              "groups": groups, "rounds": args.rounds, "rows": table}
    path = results_file("int4_pass_shapes")
    if save_results(path, result, args.json):
        return 0
    print(f"{result['machine']}, int4, best of {args.rounds} alternated rounds ({path.name})")
    print_table(["group", "rows", "layers from", "4 rows x 2 tiles ms", "8 rows x 1 tile ms", "8x1 ÷ 4x2", "G multiply-adds/s (4x2)"],
                [[str(r["group"]), str(r["rows"]), r["from"], f"{r['ms_4x2']:.3f}", f"{r['ms_8x1']:.3f}", f"{r['ratio']:.2f}×", str(r["gmac_s_4x2"])]
                 for r in table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
