"""Quality of RTN / GPTQ / AWQ / AWQ+GPTQ (+ outliers) per format from one calibration pass.

    python bench/calibration.py --model smollm2-135m --samples 128 --seqlen 2048 \\
        --formats int4-g128,nf4,mxfp4,nvfp4,fp8,int8 --methods rtn,gptq,awq,awq+gptq \\
        --outliers 0,0.1,0.2,0.5,1 --outlier-formats int4-g128 --outlier-methods rtn,awq+gptq \\
        --best int4-asym-g32:awq+gptq:0.2,nf4-g64:awq+gptq:0.2 --ctx 2048 --chunks 10

One STATS pass (`lowbit calibrate`'s engine: statistics of the float model, timed, peak RSS noted)
feeds every configuration: each decoder layer is quantized from those statistics with
quant/sequential.quantize_layer and its dequantized weights (plus kept outliers) are put into a
float32 copy of the model, which is scored on wiki-eval against the float model. The float model
runs once; its logits are kept on disk (--workdir) and replayed as the base of every KL divergence.

Methods: rtn is `lowbit quantize --method rtn` (no statistics); with kept outliers it is
quant/sequential's rtn, whose scale search is weighted by E[x²]. Configurations: every format ×
method without outliers; with --outliers, each percentage > 0 for
the --outlier-formats × --outlier-methods (default: all of them); with --best, extra
FORMAT:METHOD:PERCENT triples (the "best recipe" candidates), where FORMAT may be `@FILE`, a
`lowbit quantize --recipe` file (mixed precision: a format per module pattern; bench/recipes/).
Bits/weight are over the quantized Linears, scales included, each kept outlier counted at 48
bits, modules a recipe keeps dense at 16.

Rows go to --json after each configuration (default bench/results/calibration.json, for every
model: a run with other settings replaces it, and git keeps the earlier files; bench/plots.py draws
it) and --resume skips the configurations already there (same model, calibration and eval settings). At the end the markdown
tables for docs/benchmarks.md are printed to stdout with the command line.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from base_logits import RecordingModel, ReplayModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BEST_BPW = 4.5  # the "best recipe" budget: bits per weight on the Linears


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def default_json(model: str) -> Path:
    """The one rows file of this script (the model is recorded inside it)."""
    return RESULTS / "calibration.json"


def configurations(formats, methods, outliers, outlier_formats, outlier_methods, best) -> list[tuple[str, str, float]]:
    """(format, method, outlier %) in run order, without repeats."""
    configs = [(f, m, 0.0) for f in formats for m in methods]
    configs += [(f, m, p) for p in outliers if p > 0 for f in outlier_formats for m in outlier_methods]
    configs += best
    return list(dict.fromkeys(configs))


def parse_best(text: str) -> list[tuple[str, str, float]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--best wants FORMAT:METHOD:PERCENT items, got '{item}'")
        out.append((parts[0], parts[1], float(parts[2])))
    return out


def calibrate_stats(model: str, data: str, samples: int, seqlen: int, out: Path) -> dict:
    from lowbit.compress.calibrate import calibrate, prepare_calibration

    inputs = prepare_calibration(model, data, samples=samples, seqlen=seqlen)
    return calibrate(inputs, out, overwrite=True)


def quantized_copy(model_dir: Path, stats_path: Path, spec_label: str, method: str, outliers: float, refit: int = 1,
                   salience: str = "error", damp: float | None = None):
    """(float model holding the quantized weights, linear bits/weight, seconds, notes)."""
    from lowbit.compress.calibrate import LayerStats, LayerwiseModel
    from lowbit.quant.outlier_matrix import outlier_bits
    from lowbit.compress.sequential import QuantOptions, apply_outcome, quantize_layer
    from lowbit.quant.spec import parse_spec
    from lowbit.compress.stats import StatsFile
    from lowbit.runtime.loader import load_model

    model = load_model(model_dir, dtype=torch.float32)
    lm = LayerwiseModel(model_dir)
    stats_file = StatsFile(stats_path)
    stats_file.check(lm.identity())
    module_specs = recipe_specs(spec_label, stats_file) if spec_label.startswith("@") else None
    spec = None if module_specs is not None else parse_spec(spec_label)
    options = QuantOptions(method=method, keep_outliers=outliers, refit=refit, outlier_salience=salience)
    if damp is not None:
        options.damp = damp
    bits = params = 0.0
    notes: list[str] = []
    began = time.perf_counter()
    for i, layer in enumerate(model.model.layers):
        prefix = lm.layer_prefix(i)
        sites = stats_file.layer_sites(prefix)
        members = [m for mods in sites.values() for m in mods]
        if module_specs is None:
            specs = {m: spec for m in members}
        else:
            specs = {m: module_specs[m] for m in members if module_specs[m] is not None}
            dense = [m for m in members if module_specs[m] is None]
            bits += 16.0 * sum(layer.get_submodule(m[len(prefix):]).weight.numel() for m in dense)
            params += sum(layer.get_submodule(m[len(prefix):]).weight.numel() for m in dense)
        if method == "rtn" and not outliers:
            outcome = plain_rtn(layer, prefix, specs)
        else:
            stats = LayerStats(sites={s: stats_file.site(s) for s in sites}, site_modules=sites)
            outcome = quantize_layer(layer, prefix, stats, specs, options)
        apply_outcome(layer, prefix, outcome)
        notes += outcome.notes
        for module, qt in outcome.qtensors.items():
            n = qt.shape[0] * qt.shape[1]
            extra = outlier_bits(len(outcome.outliers[module]["values"]), qt.shape) if module in outcome.outliers else 0.0
            bits += (qt.bits_per_weight + extra) * n
            params += n
    return model, bits / params, time.perf_counter() - began, notes


def recipe_specs(label: str, stats_file) -> dict:
    """module -> FormatSpec (None: dense) for every Linear with statistics, from the recipe file `@PATH`."""
    from lowbit.compress.recipe import load_recipe, match_rules

    rules = match_rules(load_recipe(label[1:]), [m for mods in stats_file.site_modules.values() for m in mods])
    return {m: (rule.spec if rule is not None else None) for m, rule in rules.items()}


def plain_rtn(layer, prefix: str, specs: dict):
    """What `lowbit quantize --method rtn` does to one layer: no calibration statistics (quantize_layer's
    rtn would weight the scale search by E[x²]), nvfp4's global scale shared by fused Linears."""
    from lowbit.quant.rtn import quantize_rtn, shared_global_scale
    from lowbit.compress.sequential import FUSED, LayerOutcome

    global_scales = {}
    for fused in FUSED:
        members = [prefix + name for name in fused]
        if all(m in specs for m in members) and len({specs[m] for m in members}) == 1:
            weights = [layer.get_submodule(name).weight.data.float() for name in fused]
            scale = shared_global_scale(weights, specs[members[0]])
            if scale is not None:
                global_scales.update(dict.fromkeys(members, scale))
    qtensors = {m: quantize_rtn(layer.get_submodule(m[len(prefix):]).weight.data.float(), spec, global_scale=global_scales.get(m))
                for m, spec in specs.items()}
    return LayerOutcome(qtensors=qtensors)


def _row_key(row: dict) -> tuple[str, str, float]:
    return row["format"], row["method"], float(row["outliers_pct"])


def _settings(args, stats_tag: str) -> dict:
    settings = {"model": args.model, "calibration": stats_tag, "eval_data": args.eval_data, "ctx": args.ctx,
                "chunks": args.chunks, "refit_rounds": args.refit_rounds}
    # Rows files from before the option hold act rows and no key, so "act" adds none: they stay resumable.
    if args.outlier_salience != "act":
        settings["outlier_salience"] = args.outlier_salience
    if args.damp is not None:
        settings["damp"] = args.damp
    return settings


def run(args) -> dict:
    from lowbit.data.text import load_text
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.evaluate import evaluate_tokens, plan_windows, tokenize_for_eval
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    out_json = args.json or default_json(args.model)
    stats_tag = f"{args.calib_data} {args.samples}x{args.seqlen}" if args.stats is None else str(args.stats)
    settings = _settings(args, stats_tag)
    report: dict = {**settings, "command": "python bench/calibration.py " + shlex.join(args.argv), "rows": []}
    done: dict[tuple, dict] = {}
    if args.resume and out_json.exists():
        old = json.loads(out_json.read_text())
        if {k: old.get(k) for k in settings} == settings:
            done = {_row_key(r): r for r in old["rows"]}
            report["calibration_run"] = old.get("calibration_run")
            print(f"resuming: {len(done)} rows already in {out_json}", file=sys.stderr)

    formats = [f for f in args.formats.split(",") if f]  # empty: only the --best configurations
    methods = [m for m in args.methods.split(",") if m]
    outliers = [float(p) for p in args.outliers.split(",")]
    configs = configurations(formats, methods, outliers,
                             args.outlier_formats.split(",") if args.outlier_formats else formats,
                             args.outlier_methods.split(",") if args.outlier_methods else methods,
                             parse_best(args.best))
    todo = [c for c in configs if c not in done]

    stats_path = args.stats
    if stats_path is None and todo:
        stats_path = Path(args.workdir or tempfile.gettempdir()) / f"lowbit-bench-{model_dir.name}-{args.samples}x{args.seqlen}.stats"
        began = time.perf_counter()
        summary = calibrate_stats(args.model, args.calib_data, args.samples, args.seqlen, stats_path)
        report["calibration_run"] = {"tokens": summary["tokens"], "wall_s": round(time.perf_counter() - began, 1),
                                     "peak_rss_mb": round(_peak_rss_mb())}
        print(f"calibrate: {summary['tokens']} tokens in {report['calibration_run']['wall_s']} s, "
              f"peak RSS {report['calibration_run']['peak_rss_mb']} MB", file=sys.stderr, flush=True)

    tokenizer = load_tokenizer(model_dir)
    tokens, bos_id = tokenize_for_eval(tokenizer, load_text(args.eval_data))
    windows = plan_windows(len(tokens), args.ctx, args.chunks)
    report["chunks_run"] = len(windows)
    work = Path(tempfile.mkdtemp(prefix="lowbit-calib-bench-", dir=args.workdir))
    try:
        base_row = done.get(("bf16", "rtn", 0.0))
        if todo or base_row is None:
            base = load_model(model_dir, dtype=torch.float32)
            config = base.config
            result = evaluate_tokens(RecordingModel(base, work), tokens, windows, bos_id)
            base_row = {"model": args.model, "format": "bf16", "method": "rtn", "outliers_pct": 0.0, "linear_bpw": 16.0,
                        "ppl": result.ppl, "ppl_err": result.ppl_err, "kld": 0.0, "kld_err": 0.0, "same_top": 100.0,
                        "quantize_s": 0.0, "eval_s": result.eval_s, "notes": []}
            del base
        report["rows"].append(base_row)
        _log(base_row)
        # rows of configurations this run does not list stay in --json: a resumed run may cover other formats
        report["rows"] += [r for key, r in done.items() if key not in configs and key != ("bf16", "rtn", 0.0)]
        for fmt, method, pct in configs:
            if (fmt, method, pct) in done:
                report["rows"].append(done[(fmt, method, pct)])
                continue
            model, bpw, seconds, notes = quantized_copy(model_dir, stats_path, fmt, method, pct, args.refit_rounds,
                                                        args.outlier_salience, args.damp)
            result = evaluate_tokens(model, tokens, windows, bos_id, base_model=ReplayModel(work, config))
            del model
            k = result.kld
            row = {"model": args.model, "format": fmt, "method": method, "outliers_pct": pct, "linear_bpw": bpw,
                   "ppl": result.ppl, "ppl_err": result.ppl_err, "kld": k.mean, "kld_err": k.err,
                   "same_top": k.same_top_pct, "quantize_s": seconds, "eval_s": result.eval_s, "notes": notes}
            report["rows"].append(row)
            _log(row)
            out_json.parent.mkdir(parents=True, exist_ok=True)
            out_json.write_text(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=2))
    print(f"rows written to {out_json}", file=sys.stderr)
    return report


def _log(row: dict) -> None:
    print(f"{row['format']:<14} {row['method']:<9} outliers {row['outliers_pct']:<4} {row['linear_bpw']:6.3f} bpw  "
          f"PPL {row['ppl']:8.3f}  KLD {row['kld']:.5f}  same top {row['same_top']:6.2f} %  "
          f"({row['quantize_s']:.0f} s quantize, {row['eval_s']:.0f} s eval)", file=sys.stderr, flush=True)


def _label(row: dict) -> str:
    return f"{row['method']} + {row['outliers_pct']:g} % outliers" if row["outliers_pct"] else row["method"]


def markdown(report: dict) -> str:
    """The tables for docs/benchmarks.md: every row; KLD by format × method; the outlier sweep;
    the best configuration within BEST_BPW bits per weight."""
    rows = report["rows"]
    quantized = [r for r in rows if r["format"] != "bf16"]
    lines = [f"`{report['command']}`", "",
             f"{report['model']}, statistics from {report['calibration']}, scored on {report['eval_data']}: "
             f"ctx {report['ctx']}, {report.get('chunks_run', report['chunks'])} chunks, KLD vs the float model.", ""]
    lines += ["| format | method | bits/weight (Linears) | PPL | KLD | same top % | quantize s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['format']} | {_label(r) if r['format'] != 'bf16' else '–'} | {r['linear_bpw']:.3f} | "
                     f"{r['ppl']:.3f} ± {r['ppl_err']:.3f} | {r['kld']:.4f} ± {r['kld_err']:.4f} | {r['same_top']:.2f} | "
                     f"{r['quantize_s']:.0f} |")
    plain = [r for r in quantized if not r["outliers_pct"]]
    methods = list(dict.fromkeys(r["method"] for r in plain))
    if plain:
        lines += ["", "KLD vs the float model (bits/weight in brackets):", "",
                  "| format | " + " | ".join(methods) + " |", "| --- |" + " --- |" * len(methods)]
        for fmt in dict.fromkeys(r["format"] for r in plain):
            cells = []
            for m in methods:
                r = next((r for r in plain if r["format"] == fmt and r["method"] == m), None)
                cells.append("–" if r is None else f"{r['kld']:.4f}")
            bpw = next(r["linear_bpw"] for r in plain if r["format"] == fmt)
            lines.append(f"| {fmt} ({bpw:.3f}) | " + " | ".join(cells) + " |")
    sweep = {}
    for r in quantized:
        sweep.setdefault((r["format"], r["method"]), {})[r["outliers_pct"]] = r
    sweep = {k: v for k, v in sweep.items() if len(v) > 1}
    if sweep:
        pcts = sorted({p for v in sweep.values() for p in v})
        lines += ["", "What each share of weights kept in bf16 buys (KLD, bits/weight):", "",
                  "| format | method | " + " | ".join(f"{p:g} %" for p in pcts) + " |", "| --- | --- |" + " --- |" * len(pcts)]
        for (fmt, method), by_pct in sweep.items():
            cells = [f"{by_pct[p]['kld']:.4f} ({by_pct[p]['linear_bpw']:.2f})" if p in by_pct else "–" for p in pcts]
            lines.append(f"| {fmt} | {method} | " + " | ".join(cells) + " |")
    within = [r for r in quantized if r["linear_bpw"] <= BEST_BPW]
    if within:
        best = min(within, key=lambda r: r["kld"])
        lines += ["", f"Best within {BEST_BPW} bits/weight on the Linears: **{best['format']} {_label(best)}** — "
                      f"{best['linear_bpw']:.3f} bits/weight, KLD {best['kld']:.4f}, PPL {best['ppl']:.3f}, "
                      f"same top {best['same_top']:.2f} %."]
    if report.get("calibration_run"):
        c = report["calibration_run"]
        lines += ["", f"Calibration ({c['tokens']} tokens): {c['wall_s']} s, peak RSS {c['peak_rss_mb']} MB."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib-data", default="wiki-calib")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--formats", default="int4-g128,nf4,mxfp4,nvfp4,fp8,int8",
                        help="comma-separated formats run with every --methods entry (\"\": only the --best configurations)")
    parser.add_argument("--methods", default="rtn,gptq,awq,awq+gptq")
    parser.add_argument("--outliers", default="0", help="comma-separated percentages of weights kept in bf16")
    parser.add_argument("--outlier-formats", default="", help="formats the outlier percentages apply to (default: all)")
    parser.add_argument("--outlier-methods", default="", help="methods the outlier percentages apply to (default: all)")
    parser.add_argument("--best", default="", help="extra FORMAT:METHOD:PERCENT configurations, comma-separated")
    parser.add_argument("--eval-data", default="wiki-eval")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--refit-rounds", type=int, default=1, help="GPTQ scale-refit rounds (lowbit quantize --refit-rounds; 0: off)")
    parser.add_argument("--outlier-salience", choices=("act", "hessian", "error"), default="error",
                        help="how kept outliers are ranked (lowbit quantize --outlier-salience)")
    parser.add_argument("--damp", type=float, default=None,
                        help="GPTQ dampening as a fraction of mean diag(H) (default: lowbit's, 0.01)")
    parser.add_argument("--stats", type=Path, default=None, help="reuse this STATS file instead of calibrating")
    parser.add_argument("--workdir", default=None, help="where the STATS file and the float model's logits go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="rows file (default bench/results/calibration.json)")
    parser.add_argument("--resume", action="store_true", help="keep the rows --json already has for these settings")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    report = run(args)
    print(markdown(report))


if __name__ == "__main__":
    main()
