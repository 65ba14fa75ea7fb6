"""What a bench result file says about the machine it was measured on, and which file it goes to.

lowbit's CPU kernels differ between AVX-512 and AVX2-only machines, so a script keeps one latest
results file per CPU class: `<stem>.json` for AVX-512, `<stem>-avx2.json` for AVX2-only; each is
its own table in docs/benchmarks.md. LOWBIT_RESULTS_TAG=zen4 (say) files a run as `<stem>-zen4.json`
instead, for a machine of the same class whose figures must not replace another's (Zen 4 and Zen 5
are both AVX-512).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parents[1]


def lowbit(*args: str) -> dict:
    """`lowbit ARGS --json` → its JSON summary, with the wall time as `_wall_s` (its progress lines
    pass through on stderr); a failed command ends the script naming it."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lowbit", *args, "--json"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"lowbit {' '.join(args)} failed ({done.returncode})")
    out = json.loads(done.stdout)
    out["_wall_s"] = round(time.perf_counter() - started, 1)
    return out


def results_file(stem: str) -> Path:
    from lowbit.native.build import _cpu_flags

    tag = os.environ.get("LOWBIT_RESULTS_TAG", "").strip()
    if tag:
        if not tag.replace("-", "").replace("_", "").isalnum():
            raise SystemExit(f"LOWBIT_RESULTS_TAG must be letters, digits, - or _, not '{tag}'")
        return RESULTS_DIR / f"{stem}-{tag}.json"
    flags = _cpu_flags().split()
    return RESULTS_DIR / (f"{stem}-avx2.json" if flags and "avx512f" not in flags else f"{stem}.json")


def describe() -> str:
    """'AMD EPYC (family 23 model 49, AVX2), 2 cores': the CPU's model name, its family and model
    numbers (a VM's model name often hides the generation: EPYC family 23 is Zen 2, 25 Zen 3/4), the
    widest vector ISA lowbit's kernels use, and the core count."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        pass
    model = fields.get("model name", "unknown CPU")
    flags = fields.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    family = f"family {fields['cpu family']} model {fields['model']}, " if "cpu family" in fields and "model" in fields else ""
    return f"{model} ({family}{isa}), {os.cpu_count()} cores"


def save_results(path: Path, result: dict, as_json: bool) -> bool:
    """Write `result` as the script's latest file at `path`; with as_json also print it (the
    script then prints nothing else: returns True)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print(json.dumps(result, indent=2))
    return as_json


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table on stdout, as docs/benchmarks.md holds them."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
