"""The pictures in docs/img/, drawn from the benchmark scripts' JSON results (one command).

    python bench/plots.py              # redraw every picture from bench/results/*.json
    python bench/plots.py --measure    # first rerun the measurements (tens of minutes on a 2-core CPU)

Pictures:
  quality_vs_bits.png   PPL and KLD vs bits per weight, every format x method, for SmolLM2
                        (bench/results/calibration.json from bench/calibration.py: every method,
                        marker per method, hollow + line for kept outliers; plus the RTN rows of
                        bench/results/quality.json from bench/quality.py for formats the
                        calibration run left out, when both used the same ctx and chunks)
  quality_vs_bits_MODEL.png  the same when bench/results/calibration.json holds another model (e.g. Gemma-3)
  decode_vs_batch.png   decode tok/s vs batch size, measured by `lowbit bench`, against plan's
                        roofline (bench/results/decode_vs_batch.json from bench/decode_vs_batch.py)
  kv_memory.png         KV cache memory vs context length, reserved vs paged, bf16 vs fp8 / int8,
                        computed with lowbit.plan.kv_cache (no measurement)
  distill_loss.png      lowbit distill's end-to-end KL loss per step (bench/results/distill*.json from
                        bench/distill.py), with each run's held-out KLD before and after
  speed_quality.png     decode speedup vs greedy agreement with the full model: early exit and exact
                        self-speculation (bench/results/early_exit.json from bench/early_exit.py),
                        the engine's token cascade (token_cascade.json from bench/token_cascade.py)
                        and serve's query cascade (query_cascade.json)
A picture whose JSON is missing is skipped with a note, not an error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from lowbit.plan import load_shape  # noqa: E402
from lowbit.plan import kv_cache  # noqa: E402

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
IMAGES = BENCH.parent / "docs" / "img"
GIB = 1024**3
DPI = 110

# the measurements --measure reruns, each writing its JSON into bench/results/
MEASUREMENTS = [
    ["quality.py", "--chunks", "2", "--threads", "1", "--json", str(RESULTS / "quality.json")],
    ["decode_vs_batch.py", "--out", str(RESULTS / "decode_vs_batch.json")],
]


def family(fmt: str) -> str:
    return fmt.split("-")[0]


FAMILY_COLORS = {"bf16": "black", "int8": "tab:blue", "fp8": "tab:orange", "int4": "tab:green", "nf4": "tab:red",
                 "mxfp4": "tab:purple", "nvfp4": "tab:brown"}
METHOD_MARKERS = {"rtn": "o", "gptq": "s", "awq": "^", "awq+gptq": "D"}
FORMAT_PALETTE = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:orange", "tab:blue", "tab:olive", "tab:cyan",
                  "tab:pink", "tab:gray", "darkgreen", "navy"]
LABELLED_POINTS = 14  # beyond this many points the picture uses legends instead of a label per point
QUALITY_MODEL = "smollm2-135m"  # bench/quality.py's model: its rows carry no model name


def calibration_json(model: str) -> Path:
    """bench/calibration.py's rows file (one for every model; the model is named inside)."""
    return RESULTS / "calibration.json"


def _calibration_model() -> str | None:
    path = RESULTS / "calibration.json"
    return json.loads(path.read_text()).get("model") if path.exists() else None


def quality_models() -> list[str]:
    """Models with quality rows: SmolLM2 (from quality.json) and the model calibration.json holds."""
    models = [QUALITY_MODEL] if (RESULTS / "quality.json").exists() else []
    calibrated = _calibration_model()
    return models + ([calibrated] if calibrated and calibrated not in models else [])


def quality_rows(model: str = QUALITY_MODEL) -> tuple[list[dict], str]:
    """The model's rows: bench/calibration.py's (every method, RTN included) plus bench/quality.py's
    RTN rows for formats the calibration run did not cover, when both used the same eval settings."""
    rows, notes = [], []
    calib_path = calibration_json(model)
    calib = json.loads(calib_path.read_text()) if calib_path.exists() else None
    if calib is not None and calib.get("model", QUALITY_MODEL) != model:
        calib = None
    if calib is not None:
        rows = [{**r, "method": r.get("method", "rtn"), "outliers_pct": r.get("outliers_pct", 0)} for r in calib["rows"]]
        notes.append(f"ctx {calib.get('ctx')}, {calib.get('chunks_run', calib.get('chunks'))} chunks, "
                     f"calibrated on {calib.get('calibration')}")
    quality_path = RESULTS / "quality.json"
    if model == QUALITY_MODEL and quality_path.exists():
        data = json.loads(quality_path.read_text())
        same_eval = calib is None or (data.get("ctx"), data.get("chunks")) == (calib.get("ctx"), calib.get("chunks_run", calib.get("chunks")))
        if same_eval:
            covered = {r["format"] for r in rows}
            extra = [{**r, "method": r.get("method", "rtn"), "outliers_pct": 0} for r in data["rows"] if r["format"] not in covered]
            rows += extra
            if calib is None:
                notes.append(f"ctx {data.get('ctx')}, {data.get('chunks')} chunks")
    return rows, "; ".join(notes)


def _label_points(ax, points: list[dict], key: str) -> None:
    """Name every point; the crowded 3-5 bit points get a column of labels with leader lines."""
    crowded = sorted((r for r in points if r["linear_bpw"] < 6), key=lambda r: -r[key])
    for i, row in enumerate(crowded):
        color = FAMILY_COLORS.get(family(row["format"]), "gray")
        ax.annotate(_point_label(row), (row["linear_bpw"], row[key]), xytext=(0.32, 0.95 - 0.075 * i),
                    textcoords="axes fraction", fontsize=7, color=color, va="center",
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.5, "alpha": 0.6})
    spread = sorted((r for r in points if r["linear_bpw"] >= 6), key=lambda r: r[key])
    for i, row in enumerate(spread):
        ax.annotate(_point_label(row), (row["linear_bpw"], row[key]), textcoords="offset points",
                    xytext=(6, 5 if i % 2 else -5),
                    fontsize=7, color=FAMILY_COLORS.get(family(row["format"]), "gray"), va="center")


def _point_label(row: dict) -> str:
    label = row["format"] if row["method"] == "rtn" else f"{row['format']} {row['method']}"
    return f"{label} +{row['outliers_pct']:g}%" if row.get("outliers_pct") else label


def _format_colors(points: list[dict], labelled: bool) -> dict[str, str]:
    """One colour per format label; by family when each point is labelled anyway (the old picture)."""
    formats = list(dict.fromkeys(r["format"] for r in points))
    if labelled:
        return {f: FAMILY_COLORS.get(family(f), "gray") for f in formats}
    return {f: FORMAT_PALETTE[i % len(FORMAT_PALETTE)] for i, f in enumerate(formats)}


def plot_quality(out: Path, model: str = QUALITY_MODEL) -> bool:
    rows, note = quality_rows(model)
    if not rows:
        return False
    fig, (ax_ppl, ax_kld) = plt.subplots(1, 2, figsize=(11, 4.8))
    base = next((r for r in rows if r["format"] == "bf16"), None)
    points = sorted((r for r in rows if r["format"] != "bf16"), key=lambda r: r["linear_bpw"])
    labelled = len(points) <= LABELLED_POINTS
    colors = _format_colors(points, labelled)
    for row in points:
        color = colors[row["format"]]
        marker = METHOD_MARKERS.get(row["method"], "x")
        # kept outliers: the same method's marker, hollow
        face = "none" if row.get("outliers_pct") else color
        ax_ppl.plot(row["linear_bpw"], row["ppl"], marker, color=color, mfc=face)
        ax_kld.errorbar(row["linear_bpw"], row["kld"], yerr=row.get("kld_err"), fmt=marker, color=color, mfc=face, capsize=2)
    # an outlier sweep is one line per format x method, from 0 % up
    series: dict[tuple, list[dict]] = {}
    for row in points:
        series.setdefault((row["format"], row["method"]), []).append(row)
    for (fmt, _), members in series.items():
        if any(r.get("outliers_pct") for r in members) and len(members) > 1:
            members = sorted(members, key=lambda r: r.get("outliers_pct", 0))
            for ax, key in ((ax_ppl, "ppl"), (ax_kld, "kld")):
                ax.plot([r["linear_bpw"] for r in members], [r[key] for r in members], "-", color=colors[fmt], lw=0.7, alpha=0.6)
    if labelled:
        for ax, key in ((ax_ppl, "ppl"), (ax_kld, "kld")):
            _label_points(ax, points, key)
    else:
        fmt_handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=f) for f, c in colors.items()]
        ax_ppl.legend(handles=fmt_handles, title="format", fontsize=7, loc="upper right", ncol=2)
    if base:
        ax_ppl.axhline(base["ppl"], color="black", lw=0.8, ls="--")
        ax_ppl.annotate(f"bf16 {base['ppl']:.2f}", (ax_ppl.get_xlim()[0], base["ppl"]), xytext=(4, 3),
                        textcoords="offset points", fontsize=8)
    ax_ppl.set(xlabel="bits per weight (quantized Linears, scales included)", ylabel="perplexity (wiki-eval)",
               title="perplexity")
    ax_kld.set(xlabel="bits per weight (quantized Linears, scales included)", ylabel="mean KL divergence vs bf16",
               title="KL divergence", yscale="log")
    methods = list(dict.fromkeys(m for m in METHOD_MARKERS if any(r["method"] == m for r in points)))
    methods += sorted({r["method"] for r in points} - set(methods))
    handles = [plt.Line2D([], [], marker=METHOD_MARKERS.get(m, "x"), ls="", color="gray", label=m) for m in methods]
    if any(r.get("outliers_pct") for r in points):
        handles.append(plt.Line2D([], [], marker="o", ls="-", lw=0.7, color="gray", mfc="none", label="+ outliers kept in bf16"))
    ax_kld.legend(handles=handles, title="method", fontsize=8, loc="upper right")
    low, high = min(r["linear_bpw"] for r in points), max(r["linear_bpw"] for r in points)
    for ax in (ax_ppl, ax_kld):
        ax.grid(alpha=0.3)
        ax.set_xlim(low - 0.3, high + (1.2 if labelled else 0.5))  # room for the labels right of the points
    fig.suptitle(f"{model} on wiki-eval ({note}): quality vs size", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


def plot_decode(out: Path) -> bool:
    path = RESULTS / "decode_vs_batch.json"
    if not path.exists():
        return False
    data = json.loads(path.read_text())
    hw = data["hardware"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for color, s in zip(("tab:blue", "tab:green", "tab:red", "tab:purple"), data["series"]):
        ax.plot(s["batches"], s["measured_tok_s"], "o-", color=color, label=f"{s['label']}: lowbit bench")
        ax.plot(s["batches"], s["predicted_tok_s"], "--", color=color, alpha=0.7, label=f"{s['label']}: plan's roofline")
    ax.set(xscale="log", yscale="log", xlabel="sequences decoding together (batch)", ylabel="aggregate decode tok/s",
           title=f"{data['model']} decode on this CPU ({data['threads']} thread, {data['context']}-token context)")
    ax.set_xticks(data["series"][0]["batches"], [str(b) for b in data["series"][0]["batches"]])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.annotate(f"roofline: {hw['bandwidth_gbs']:.1f} GB/s read, {1000 * hw['tflops_bf16']:.0f} GFLOP/s measured",
                (0.02, 0.02), xycoords="axes fraction", fontsize=8, color="gray")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


def kv_curves(model: str, sequences: int, contexts: list[int]) -> dict[str, list[float]]:
    """GiB of KV cache for `sequences` sequences each holding `context` tokens."""
    shape, _ = load_shape(model)
    reserve = shape.max_context or max(contexts)
    bf16, fp8, int8 = (kv_cache.kv_dtype(n) for n in ("bf16", "fp8", "int8"))
    reserved = sequences * kv_cache.kv_bytes_per_sequence(shape, bf16, reserve) / GIB
    return {
        f"bf16, reserved up front ({reserve} tokens each)": [reserved] * len(contexts),
        "bf16, paged (16-token blocks)": [sequences * kv_cache.kv_bytes_paged(shape, bf16, c) / GIB for c in contexts],
        "int8, paged": [sequences * kv_cache.kv_bytes_paged(shape, int8, c) / GIB for c in contexts],
        "fp8, paged": [sequences * kv_cache.kv_bytes_paged(shape, fp8, c) / GIB for c in contexts],
    }


def plot_kv(out: Path) -> bool:
    panels = [("llama-3-8b", "Llama-3-8B (GQA: 8 KV heads)", 16, 8192),
              ("gemma3-270m", "Gemma-3-270M (5 of 6 layers slide over 512 tokens)", 16, 32768)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    styles = [("black", "-"), ("tab:blue", "-"), ("tab:green", "--"), ("tab:orange", "-")]
    for ax, (model, title, seqs, longest) in zip(axes, panels):
        contexts = list(range(16, longest + 1, 16))
        for (color, ls), (label, gib) in zip(styles, kv_curves(model, seqs, contexts).items()):
            ax.plot(contexts, gib, color=color, ls=ls, label=label)
        ax.set(xlabel="tokens each sequence holds", ylabel=f"KV cache GiB, {seqs} sequences", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.93))
    fig.suptitle("KV cache memory vs context (lowbit.plan.kv_cache)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


def plot_distill(out: Path) -> bool:
    """The end-to-end KL loss of each bench/distill.py run (bench/results/distill*.json), per step
    and as a 10-step running mean, beside the held-out KLD before and after."""
    runs = []
    for path in sorted(RESULTS.glob("distill*.json")):
        data = json.loads(path.read_text())
        curve = data.get("distill", {}).get("loss_curve")
        if curve and "rows" in data:  # bench/distill.py's (distill_smaller/_exits' have no before/after rows)
            runs.append((path.stem, data, curve))
    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for color, (name, data, curve) in zip(("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:orange", "tab:brown"), runs):
        mean = [sum(curve[max(0, i - 9): i + 1]) / len(curve[max(0, i - 9): i + 1]) for i in range(len(curve))]
        rows = data["rows"]
        label = (f"{data.get('teacher', 'smollm2-135m')}, {rows[0]['checkpoint']}: held-out KLD {rows[0]['kld']:.4f}"
                 f" -> {rows[1]['kld']:.4f}")
        ax.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.25, lw=0.8)
        ax.plot(range(1, len(curve) + 1), mean, color=color, label=label)
    ax.set(xlabel="end-to-end step (one window of 512 tokens)", ylabel="KL(teacher || student) on the step's window",
           title="lowbit distill: quantization recovery (wiki-calib windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


def plot_speed_quality(out: Path) -> bool:
    """Decode speedup against greedy agreement with the full model for every approximate setting
    measured (bench/results/early_exit.json, token_cascade.json, query_cascade.json), beside issue 28's
    target corner."""
    exits, query = RESULTS / "early_exit.json", RESULTS / "query_cascade.json"
    # the engine's cascade and the quantized self-drafts as last measured (Zen 4, since 2026-12-05)
    tokens = next((p for p in (RESULTS / "token_cascade-zen4.json", RESULTS / "token_cascade.json") if p.exists()),
                  RESULTS / "token_cascade.json")
    selfspec = RESULTS / "self_speculation-zen4.json"
    if not exits.exists() and not query.exists() and not tokens.exists():
        return False
    series = []  # (label, color, marker, [(agreement %, speedup, threshold)])
    if exits.exists():
        data = json.loads(exits.read_text())
        for conf, color in (("top1", "tab:blue"), ("margin", "tab:cyan")):
            rows = [r for r in data["early_exit"] if r["confidence"] == conf]
            series.append((f"early exit {'/'.join(map(str, data['exit_layers']))}, {conf} (single sequence)", color, "o",
                           [(r["greedy_agreement_pct"], r["speedup"], r["threshold"]) for r in rows]))
        spec = data.get("self_speculative") or []
        if spec:
            series.append(("exact self-speculation, self:layers=N (engine)", "tab:gray", "D",
                           [(100.0, r["speedup"], r["draft"].split("=")[-1]) for r in spec]))
    if tokens.exists():
        data = json.loads(tokens.read_text())
        for batch, color in (("b1", "tab:green"), ("b16", "tab:olive")):
            if batch in data["rows"][0]:
                series.append((f"token cascade, {data['cheap']} (engine, batch {batch[1:]})", color, "s",
                               [(r[batch]["greedy_agreement_pct"], r[batch]["speedup"], r["threshold"])
                                for r in data["rows"]]))
    if selfspec.exists():
        rows = json.loads(selfspec.read_text())["rows"]
        series.append(("exact self-speculation, self:FORMAT copy (engine; label: the setting)", "black", "*",
                       [(100.0, r["speedup"], r["setting"].removeprefix("self:")) for r in rows if r["setting"] != "plain"]))
    if query.exists():
        data = json.loads(query.read_text())
        for conc, color in ((1, "tab:red"), (max(r["concurrency"] for r in data["rows"]), "tab:orange")):
            rows = [r for r in data["rows"] if r["concurrency"] == conc and r["threshold"] is not None]
            series.append((f"query cascade, serve --cascade {data['cheap']}, {conc} concurrent", color, "^",
                           [(r["agreement_pct"], r["speedup"], r["threshold"]) for r in rows]))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.axhspan(1.5, 2.6, xmin=0.9, xmax=1.0, color="tab:green", alpha=0.12, label="issue 28's target (≥ 1.5×, ≥ 90 %)")
    for label, color, marker, points in series:
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=color, label=label, lw=1, ms=5)
        for x, y, t in points:
            if t != "":
                ax.annotate(f"{t}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set(xlim=(0, 100), ylim=(0, 2.6), xlabel="greedy agreement with the full model (% of positions)",
           ylabel="decode speed ÷ the full model's", title="SmolLM2-135M: cheap first, escalate when unsure (labels: T)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


PICTURES = {"quality_vs_bits.png": plot_quality, "decode_vs_batch.png": plot_decode, "kv_memory.png": plot_kv,
            "distill_loss.png": plot_distill, "speed_quality.png": plot_speed_quality}


def pictures() -> dict:
    """Every picture to draw: the fixed ones plus quality_vs_bits_MODEL.png per other calibrated model."""
    out = dict(PICTURES)
    for model in quality_models():
        if model != QUALITY_MODEL:
            out[f"quality_vs_bits_{model}.png"] = lambda path, m=model: plot_quality(path, m)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="rerun the measurement scripts first")
    parser.add_argument("--out", default=str(IMAGES), help=f"folder for the PNGs (default {IMAGES})")
    args = parser.parse_args()
    if args.measure:
        RESULTS.mkdir(exist_ok=True)
        for script, *rest in MEASUREMENTS:
            print(f"running bench/{script}", file=sys.stderr)
            subprocess.run([sys.executable, str(BENCH / script), *rest], check=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in pictures().items():
        if draw(out / name):
            print(out / name)
        else:
            print(f"skipped {name}: no results under {RESULTS} (run with --measure)", file=sys.stderr)


if __name__ == "__main__":
    main()
