"""A smaller model by distillation: the teacher with layers cut out, trained on its logits, beside
the same cut model untrained; then the student as a draft for exact speculative decoding.

    python bench/distill_smaller.py [--teacher smollm2-135m] [--layers 20] [--steps 300]
        [--samples 64] [--seqlen 512] [--lr 1e-4] [--threads 2] [--chunks 10] [--work DIR] [--json]

What it runs, all through the CLI users have (each `--json` summary is kept):
1. `lowbit distill TEACHER --student-layers N --steps 0`: the cut model, untrained (the layers kept
   are the N most important by `1 - cos(input, output)`; the ranking is in the summary);
2. the same with `--steps S` on wiki-calib: the distilled student (its wall time is the budget the
   issue states, 20 minutes on 2 cores for SmolLM2);
3. `lowbit eval` of teacher, cut and student on wiki-eval (text the training never sees), KLD
   against the teacher's logits;
4. `lowbit bench` of teacher and student (decode tok/s at batch 1), and of the teacher with
   `--draft STUDENT` and `--draft self:int4` (exact speculative decoding: speedup, mean accepted
   length).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "distill_smaller.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import lowbit  # noqa: E402


def quality(summary: dict) -> dict:
    out = {"ppl": summary["ppl"], "ppl_err": summary["ppl_err"]}
    if "kld" in summary:
        k = summary["kld"]
        out.update(kld=k["mean"], kld_err=k["err"], same_top_pct=k["same_top_pct"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=10, help="wiki-eval chunks of --ctx tokens for the KLDs")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("bench-distill-smaller"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = ["--threads", str(args.threads)]
    common = [args.teacher, "--data", "wiki-calib", "--student-layers", str(args.layers), "--samples", str(args.samples),
              "--seqlen", str(args.seqlen), "--eval-data", "wiki-eval", *threads, "--overwrite"]
    result: dict = {"teacher": args.teacher, "layers": args.layers, "date": time.strftime("%Y-%m-%d %H:%M"),
                    "args": {k: str(v) for k, v in vars(args).items()}}

    cut, student = work / f"cut-{args.layers}", work / f"student-{args.layers}"
    result["cut"] = lowbit("distill", *common, "--steps", "0", "-o", str(cut))
    result["distill"] = lowbit("distill", *common, "--steps", str(args.steps), "--lr", str(args.lr), "-o", str(student))
    print(f"distilled in {result['distill']['_wall_s']:.0f} s", file=sys.stderr)

    scoring = ["--data", "wiki-eval", "--ctx", str(args.ctx), "--chunks", str(args.chunks), *threads]
    result["eval"] = {
        "teacher": quality(lowbit("eval", args.teacher, *scoring)),
        "cut": quality(lowbit("eval", str(cut), *scoring, "--base", args.teacher)),
        "student": quality(lowbit("eval", str(student), *scoring, "--base", args.teacher)),
    }
    bench = ["--batches", "1", "--gen-tokens", str(args.gen_tokens), *threads]
    result["bench"] = {
        "teacher": lowbit("bench", args.teacher, *bench),
        "student": lowbit("bench", str(student), *bench),
        "draft_student": lowbit("bench", args.teacher, *bench, "--draft", str(student)),
        "draft_self_int4": lowbit("bench", args.teacher, *bench, "--draft", "self:int4"),
    }
    # one latest file per teacher: the demo model's is distill_smaller.json
    results = RESULTS if args.teacher == "smollm2-135m" else RESULTS.with_name(f"distill_smaller-{args.teacher}.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=1) + "\n")
    report(result)
    if args.json:
        print(json.dumps(result))


def report(r: dict) -> None:
    e, b = r["eval"], r["bench"]
    decode = {k: b[k]["decode"][0]["decode_tok_s"] for k in ("teacher", "student")}
    print(f"\n{r['teacher']}: {r['layers']} layers kept, distilled {r['distill']['_wall_s']:.0f} s")
    print(f"{'model':<28}{'PPL':>8}{'KLD':>8}{'same top %':>12}{'decode tok/s':>14}")
    print(f"{'teacher':<28}{e['teacher']['ppl']:>8.2f}{'0':>8}{'100':>12}{decode['teacher']:>14.1f}")
    print(f"{'cut, untrained':<28}{e['cut']['ppl']:>8.2f}{e['cut']['kld']:>8.3f}{e['cut'].get('same_top_pct', 0):>12.1f}{'':>14}")
    print(f"{'cut, distilled':<28}{e['student']['ppl']:>8.2f}{e['student']['kld']:>8.3f}"
          f"{e['student'].get('same_top_pct', 0):>12.1f}{decode['student']:>14.1f}")
    for key in ("draft_student", "draft_self_int4"):
        s = b[key]["speculative"]
        print(f"draft {s['draft']}: {s['tok_s']:.1f} vs {s['plain_tok_s']:.1f} tok/s = {s['speedup']:.2f}x, "
              f"mean accepted length {s['mean_accepted_length']:.2f}")


if __name__ == "__main__":
    main()
