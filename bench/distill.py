"""Quantization recovery by distillation on the demo model: KLD before/after beside the file bytes.

Makes README command 1's checkpoint (SmolLM2-135M, int4 sym g64, GPTQ on 128 × 512 tokens of
wiki-calib) unless it is there, scores it (`lowbit eval --data wiki-eval --chunks 10 --base
smollm2-135m`, ctx 2048, text the training never sees), runs `lowbit distill` on wiki-calib with
the stated budget, scores the result the same way, and prints KLD against whole-checkpoint bytes
beside llama.cpp's Q4_K_M of this model (105.5 MB, KLD 0.054: the issue's figures).

    python bench/distill.py [--teacher smollm2-135m] [--work DIR] [--samples 64] [--seqlen 512] [--block-steps 20] [--steps 100]
        [--batch 1] [--lr 2e-4] [--threads 2] [--chunks 10] [--student DIR] [--quantize-head] [--json]
    python bench/distill.py --recipe bench/recipes/q4km-budget.yaml ...   # a student within Q4_K_M's bytes
    python bench/distill.py --format nvfp4 ...                            # another format's student (GPTQ)

The budget is what bounds the time: on 2 cores the block stage costs about 4 s a layer at
--samples 8 --block-steps 2 and an end-to-end step about 3-6 s at --batch 1 --seqlen 512.
Without --quantize-head the tied embedding/head stays bf16 (57 MB of the file), so the int4 files
are 111-116 MB whatever the training does; with it the one tied matrix is int4 g64 too and its
scales train with the rest (the embedding reads the head's rows).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import lowbit, save_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "distill.json"
FORMAT = "int4-g64"  # README command 1's student; its results are distill.json
Q4_K_M_BYTES, Q4_K_M_KLD = 105.5e6, 0.054  # llama.cpp's Q4_K_M of SmolLM2-135M (issue 27's figures)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m", help="the model quantized and distilled back (llama.cpp's "
                    "Q4_K_M row is the demo model's; gemma3-270m is itself a dequantized Q4_K_M)")
    ap.add_argument("--work", type=Path, default=Path("bench-distill"))
    ap.add_argument("--student", type=Path, help="an existing quantized student (default: make README command 1's)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=10, help="wiki-eval chunks of 2048 tokens for the KLDs")
    ap.add_argument("--format", default=FORMAT, help="the student's format when this script makes it (GPTQ; e.g. "
                    "nvfp4, mxfp4); results go to distill-FORMAT.json unless it is the default")
    ap.add_argument("--quantize-head", action="store_true",
                    help="quantize the tied embedding/head too (int4 g64, one matrix; `lowbit quantize --quantize-head`)")
    ap.add_argument("--recipe", type=Path,
                    help="make the student with this recipe instead (--method, --keep-outliers, the head quantized "
                         "as the recipe's lm_head rule says), e.g. bench/recipes/q4km-budget.yaml")
    ap.add_argument("--keep-outliers", type=float, default=0.1, help="with --recipe: percent of weights kept in bf16")
    ap.add_argument("--method", default="gptq", help="with --recipe: the calibrated method (awq+gptq took ~140 s a "
                                                      "layer on 2 AVX2 cores, gptq a few)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    threads = ["--threads", str(args.threads)]
    head = ["--quantize-head"] if args.quantize_head or args.recipe else []
    calib = ["--data", "wiki-calib", "--samples", "128", "--seqlen", "512"]
    short = args.teacher.split("-")[0]  # smollm2, gemma3: names the students in --work
    if args.recipe:
        student = args.student or args.work / f"{short}-{args.recipe.stem}"
        label = f"{args.recipe.stem} recipe, {args.method}, {args.keep_outliers} % outliers, quantized head"
        make = ["--recipe", str(args.recipe), "--method", args.method, "--keep-outliers", str(args.keep_outliers)]
    else:
        default = args.format == FORMAT
        name = "int4" if default else args.format
        student = args.student or args.work / (f"{short}-{name}-head" if head else f"{short}-{name}")
        label = ("int4 g64 GPTQ" if default else f"{args.format} GPTQ") + (
            " + quantized head" if head else " (README command 1)" if short == "smollm2" and default else "")
        make = ["--format", "int4", "--group-size", "64", "--method", "gptq"] if default else ["--format", args.format, "--method", "gptq"]
    if not student.is_dir():
        lowbit("quantize", args.teacher, *make, *calib, "-o", str(student), *head, *threads)
    score = ["--data", "wiki-eval", "--chunks", str(args.chunks), "--base", args.teacher, *threads]
    before = lowbit("eval", str(student), *score)
    out = args.work / f"{student.name}-distilled-s{args.samples}-b{args.block_steps}-e{args.steps}"
    run = lowbit("distill", args.teacher, "--data", "wiki-calib", "--student", str(student), "-o", str(out), "--overwrite",
                 "--samples", str(args.samples), "--seqlen", str(args.seqlen), "--block-steps", str(args.block_steps),
                 "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
                 "--eval-data", "wiki-eval", "--eval-chunks", "2", *threads)
    after = lowbit("eval", str(out), *score)
    rows = [
        (label, directory_bytes(student),
         before["kld"]["mean"], before["kld"]["err"]),
        (f"  + distill ({args.block_steps} steps/layer, {args.steps} end-to-end)", directory_bytes(out),
         after["kld"]["mean"], after["kld"]["err"]),
    ]
    if args.teacher == "smollm2-135m":
        rows.append(("llama.cpp Q4_K_M (issue's figures)", int(Q4_K_M_BYTES), Q4_K_M_KLD, None))
    result = {"teacher": args.teacher, "budget": {k: getattr(args, k) for k in ("samples", "seqlen", "block_steps", "steps", "batch", "lr", "threads",
                                                        "quantize_head")},
              "distill_seconds": run["seconds"], "distill": run,
              "rows": [{"checkpoint": r[0].strip(), "bytes": r[1], "kld": r[2], "kld_err": r[3]} for r in rows]}
    result["budget"]["recipe"] = str(args.recipe) if args.recipe else None
    results = (RESULTS.with_name(f"distill-{args.recipe.stem}.json") if args.recipe
               else RESULTS.with_name(f"distill-{args.format}.json") if args.format != FORMAT
               else RESULTS.with_name("distill-head.json") if head else RESULTS)
    if args.teacher != "smollm2-135m":  # one latest file per teacher too
        results = results.with_name(f"{results.stem}-{args.teacher}.json")
    if save_results(results, result, args.json):
        return
    print(f"distill: {run['seconds']:.0f} s for {run['tokens_seen']} tokens seen ({args.samples} x {args.seqlen} windows, "
          f"{args.block_steps} steps/layer, {args.steps} end-to-end at batch {args.batch}, lr {args.lr}, {args.threads} threads)")
    print(f"{'checkpoint':<52} {'MB':>7} {'KLD (wiki-eval, ctx 2048)':>26}")
    for name, size, kld, err in rows:
        print(f"{name:<52} {size / 1e6:7.1f} {kld:>12.4f}" + (f" ± {err:.4f}" if err is not None else ""))


if __name__ == "__main__":
    main()
