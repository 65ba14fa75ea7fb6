"""Quality of calibrated quantization on mixture-of-experts models (issue 26): KLD of int4 GPTQ and
AWQ against RTN, and how many calibration tokens the router sent each expert.

    python bench/moe_quality.py                       # every model, ~6 minutes on 2 cores
    python bench/moe_quality.py --models split --samples 16 --seqlen 512

Models: `split`, SmolLM2-135M cut into a 4-expert Mixtral (bench/dense_to_moe.py: real weights,
top-4 of 4 with a uniform router, the dense model exactly), and the tiny random Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE of tests/runtime/moe_models.py (8 experts, top-2 or top-3, random routers
that leave some experts few tokens). Each is quantized by `lowbit quantize` with RTN, GPTQ and AWQ
(int4 g32 symmetric for RTN and GPTQ, int4-asym g32 for AWQ and its own RTN baseline, as AutoAWQ
quantizes) on wiki-calib, GPTQ both ways an MoE can be calibrated (every token through every expert,
the default, and `--routed-experts`: each expert's routed tokens only, RTN for an expert without
any), and scored by `lowbit eval --base` (the float model) on wiki-eval.
Columns: mean KLD and same-top-1 % per method, and the calibration tokens routed per expert (min /
median / max over every expert of the model; experts that got none). Rows go to
bench/results/moe_quality.json (replaced) unless --json names another file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import ROOT, describe, lowbit, print_table, save_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "moe_quality.json"
MODELS = ("split", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
METHODS = (("rtn", "int4"), ("gptq", "int4"), ("gptq-routed", "int4"), ("rtn-asym", "int4-asym"), ("awq", "int4-asym"))


def build(name: str, work: Path) -> Path:
    """The float MoE checkpoint of row `name` under `work`."""
    out = work / name / "float"
    if name == "split":
        from dense_to_moe import dense_to_moe
        from lowbit.formats.resolve import resolve_model

        return dense_to_moe(resolve_model("smollm2-135m"), out, experts=4)
    sys.path.insert(0, str(ROOT))
    from tests.runtime.moe_models import save_moe

    save_moe(name, out)
    return out


def measure(name: str, work: Path, args) -> dict:
    src = build(name, work)
    calib = ["--data", "wiki-calib", "--samples", str(args.samples), "--seqlen", str(args.seqlen)]
    score = ["--data", "wiki-eval", "--ctx", str(args.ctx), "--chunks", str(args.chunks), "--base", str(src)]
    row: dict = {"model": name}
    for label, fmt in METHODS:
        method = label.split("-")[0]
        routed = ["--routed-experts"] if label.endswith("-routed") else []
        out = work / name / label
        summary = lowbit("quantize", str(src), "--format", fmt, "-g", str(args.group), "--method", method,
                         *(calib + routed if method != "rtn" else []), "-o", str(out), "--threads", str(args.threads))
        if summary.get("expert_tokens"):
            row["expert_tokens"] = summary["expert_tokens"]
        scored = lowbit("eval", str(out), *score, "--threads", str(args.threads))
        row[label] = {"kld": scored["kld"]["mean"], "kld_err": scored["kld"]["err"], "same_top": scored["kld"]["same_top_pct"],
                      "ppl": scored["ppl"], "quantize_s": summary["_wall_s"]}
        shutil.rmtree(out)
    return row


def coverage(row: dict) -> str:
    counts = sorted(c for block in row.get("expert_tokens", {}).values() for c in block)
    if not counts:
        return "–"
    return f"{counts[0]} / {counts[len(counts) // 2]} / {counts[-1]}; {sum(c == 0 for c in counts)} got none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated among {', '.join(MODELS)}")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows of wiki-calib")
    ap.add_argument("--seqlen", type=int, default=512, help="tokens per calibration window (the tiny models take 512)")
    ap.add_argument("--ctx", type=int, default=512, help="eval window on wiki-eval")
    ap.add_argument("--chunks", type=int, default=8, help="eval windows")
    ap.add_argument("--group", type=int, default=32, help="quantization group size")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for every lowbit command")
    ap.add_argument("--workdir", help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default=str(RESULTS), help="results file (replaced)")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        sys.exit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    work = Path(tempfile.mkdtemp(prefix="lowbit-moe-quality-", dir=args.workdir))
    try:
        rows = [measure(m, work, args) for m in models]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": describe(), "settings": vars(args), "rows": rows}
    save_results(Path(args.json), result, False)
    header = ["model", *(f"{label} KLD (same top-1)" for label, _ in METHODS), "routed tokens per expert: min / median / max"]
    print_table(header, [[r["model"], *(f"{r[label]['kld']:.4f} ({r[label]['same_top']:.1f} %)" for label, _ in METHODS), coverage(r)]
                         for r in rows])


if __name__ == "__main__":
    main()
