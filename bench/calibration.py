"""Quality of RTN / GPTQ / AWQ / AWQ+GPTQ (+ outliers) per format, and the cost of calibration.

    python bench/calibration.py --model smollm2-135m --calib-data wiki-calib --samples 128 --seqlen 2048 \
        --formats int4-g128,nf4,mxfp4,nvfp4,fp8,int8 --methods rtn,gptq,awq,awq+gptq --outliers 0,0.5 \
        --eval-data wiki-eval --ctx 2048 --chunks 10 [--threads 2] [--json OUT]

One STATS pass (`lowbit calibrate`'s engine, timed, peak RSS noted) feeds every format × method:
each decoder layer is quantized from those statistics with quant/sequential.quantize_layer and its
dequantized weights (plus kept outliers) are put into a float32 copy of the model, which is then
evaluated against the float model on the same chunks: bits/weight of the Linears (outliers at 48
bits each), PPL, KLD, same-top %. `--sequential` instead calibrates each configuration layer by
layer on the outputs of the already-quantized layers (what `lowbit quantize --data` does; slower).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def calibrate_stats(model: str, data: str, samples: int, seqlen: int, out: Path) -> dict:
    from lowbit.quant.calibrate import calibrate, prepare_calibration

    inputs = prepare_calibration(model, data, samples=samples, seqlen=seqlen)
    return calibrate(inputs, out, overwrite=True)


def quantized_copy(model_dir: Path, stats_path: Path, spec_label: str, method: str, outliers: float):
    """(float model holding the quantized weights, linear bits/weight, seconds, notes)."""
    from lowbit.quant.calibrate import LayerStats, LayerwiseModel
    from lowbit.quant.outliers import outlier_bits
    from lowbit.quant.sequential import QuantOptions, apply_outcome, quantize_layer
    from lowbit.quant.spec import parse_spec
    from lowbit.quant.stats import StatsFile
    from lowbit.runtime.loader import load_model

    model = load_model(model_dir, dtype=torch.float32)
    lm = LayerwiseModel(model_dir)
    stats_file = StatsFile(stats_path)
    stats_file.check(lm.identity())
    spec = parse_spec(spec_label)
    options = QuantOptions(method=method, keep_outliers=outliers)
    bits = params = 0.0
    notes: list[str] = []
    began = time.perf_counter()
    for i, layer in enumerate(model.model.layers):
        prefix = lm.layer_prefix(i)
        sites = stats_file.layer_sites(prefix)
        stats = LayerStats(sites={s: stats_file.site(s) for s in sites}, site_modules=sites)
        specs = {m: spec for mods in sites.values() for m in mods}
        outcome = quantize_layer(layer, prefix, stats, specs, options)
        apply_outcome(layer, prefix, outcome)
        notes += outcome.notes
        for module, qt in outcome.qtensors.items():
            n = qt.shape[0] * qt.shape[1]
            extra = outlier_bits(len(outcome.outliers[module]["values"]), qt.shape) if module in outcome.outliers else 0.0
            bits += (qt.bits_per_weight + extra) * n
            params += n
    return model, bits / params, time.perf_counter() - began, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib-data", default="wiki-calib")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--formats", default="int4-g128,nf4,mxfp4,nvfp4,fp8,int8")
    parser.add_argument("--methods", default="rtn,gptq,awq,awq+gptq")
    parser.add_argument("--outliers", default="0", help="comma-separated percentages of weights kept in bf16")
    parser.add_argument("--eval-data", default="wiki-eval")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--stats", type=Path, default=None, help="reuse this STATS file instead of calibrating")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from lowbit.data.text import load_text
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.evaluate import evaluate_text
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    model_dir = resolve_model(args.model)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    stats_path = args.stats
    if stats_path is None:
        stats_path = Path(f"/tmp/lowbit-bench-{model_dir.name}-{args.samples}x{args.seqlen}.stats")
        began = time.perf_counter()
        summary = calibrate_stats(args.model, args.calib_data, args.samples, args.seqlen, stats_path)
        report["calibration"] = {**summary, "wall_s": round(time.perf_counter() - began, 1), "peak_rss_mb": round(_peak_rss_mb())}
        print(f"calibrate: {summary['tokens']} tokens in {report['calibration']['wall_s']} s, peak RSS {report['calibration']['peak_rss_mb']} MB",
              file=sys.stderr)

    tokenizer = load_tokenizer(model_dir)
    text = load_text(args.eval_data)
    base = load_model(model_dir, dtype=torch.float32)
    header = f"{'format':<12} {'method':<9} {'outl%':>5} {'bpw':>6} {'PPL':>8} {'KLD':>8} {'same-top':>8} {'quant s':>7}"
    print(header, file=sys.stderr)
    for fmt in args.formats.split(","):
        for method in args.methods.split(","):
            for pct in [float(p) for p in args.outliers.split(",")]:
                model, bpw, seconds, notes = quantized_copy(model_dir, stats_path, fmt, method, pct)
                result = evaluate_text(model, tokenizer, text, ctx=args.ctx, chunks=args.chunks, base_model=base)
                row = {"format": fmt, "method": method, "outliers_pct": pct, "bits_per_weight": round(bpw, 3),
                       "ppl": round(result.ppl, 3), "kld": round(result.kld.mean, 5),
                       "same_top_pct": round(result.kld.same_top_pct, 2), "quantize_s": round(seconds, 1), "notes": notes}
                report["rows"].append(row)
                print(f"{fmt:<12} {method:<9} {pct:>5} {bpw:>6.3f} {row['ppl']:>8.3f} {row['kld']:>8.5f} {row['same_top_pct']:>8.2f} {seconds:>7.1f}",
                      file=sys.stderr, flush=True)
                del model
    report["base_ppl"] = result.kld.base_ppl if report["rows"] else None
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
