"""The token cascade in the engine (`lowbit generate/bench --cascade CHEAP`), measured over thresholds:
decode tok/s at each batch size beside the model alone, greedy agreement with it, the share of
tokens the cheap model answered, and the quality `lowbit eval --cascade` prices on wiki-eval.

Both engines run in this process on the same prompts (the starts of wiki-eval paragraphs, as
bench/query_cascade.py), greedy, --gen-tokens each with EOS ignored; at each batch size the model
alone and the cascade alternate group by group (runtime/engine/benchmark.token_cascade). Agreement:
tokens equal to the model alone's, position by position (after a first difference the texts part,
so this counts a late difference as cheaper than an early one). KLD / PPL / same-top: the cascade's
mixed logits against the model's own on wiki-eval windows, through the same modules the engines run.

    python bench/token_cascade.py [--model smollm2-135m] [--dtype f32] [--cheap self:int4]
        [--thresholds 0.9,0.8,0.6,0.4] [--run 7] [--prompts 16] [--gen-tokens 64] [--batches 1,16]
        [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, results_file  # noqa: E402
from query_cascade import prompts as wiki_prompts  # noqa: E402


def quality(engine, tokens: list[int], windows) -> dict:
    """`eval --cascade`'s figures for the engine's cascade as it is set, through its own modules."""
    from lowbit.runtime.cascade import CascadeLM
    from lowbit.runtime.early_exit import FullLogits
    from lowbit.runtime.evaluate import evaluate_tokens

    lm = CascadeLM(engine.model, engine.drafter.model, engine.cascade)
    r = evaluate_tokens(lm, tokens, windows, base_model=FullLogits(lm))
    return {"eval_ppl": r.ppl, "eval_kld": r.kld.mean, "eval_same_top_pct": r.kld.same_top_pct,
            "eval_base_ppl": r.kld.base_ppl, "eval_cheap_rate": lm.stats.as_dict()["cheap_rate"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--cheap", default="self:int4")
    ap.add_argument("--thresholds", default="0.9,0.8,0.6,0.4")
    ap.add_argument("--confidence", default="top1")
    ap.add_argument("--run", type=int, default=7, help="the cascade's longest run of cheap tokens")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-chunks", type=int, default=4)
    ap.add_argument("--eval-ctx", type=int, default=256)
    ap.add_argument("--json", default=None, help="default: bench/results/token_cascade[-MODEL].json (machine.results_file)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lowbit.data.text import load_text
    from lowbit.runtime.cascade import CascadeSettings
    from lowbit.runtime.engine.benchmark import token_cascade
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.evaluate import plan_windows, tokenize_for_eval

    batches = [int(b) for b in args.batches.split(",")]
    load = {"before": os.getloadavg()}
    common = dict(dtype=args.dtype, max_num_seqs=max(batches))
    plain = Engine(args.model, **common)
    cascade = Engine(args.model, draft=args.cheap, **common,
                     cascade=CascadeSettings(1.0, args.confidence, run=args.run))
    tok = plain.tokenizer
    texts = wiki_prompts(args.prompts)
    prompts = [tok.encode(t) for t in texts]
    for engine in (plain, cascade):  # warm up: first forwards allocate and pick kernels
        engine.generate(prompts[:2], None)
    text_tokens, _ = tokenize_for_eval(tok, load_text("wiki-eval"))
    windows = plan_windows(len(text_tokens), args.eval_ctx, args.eval_chunks)

    rows = []
    for t in (float(x) for x in args.thresholds.split(",")):
        cascade.cascade.threshold = t
        row = {"threshold": t, **quality(cascade, text_tokens, windows)}
        for b in batches:
            r = token_cascade(cascade, plain, prompts, args.gen_tokens, b)
            row[f"b{b}"] = {k: r[k] for k in ("tok_s", "plain_tok_s", "speedup", "greedy_agreement_pct", "cheap_rate")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    load["after"] = os.getloadavg()
    result = {"model": args.model, "dtype": args.dtype, "cheap": args.cheap, "confidence": args.confidence,
              "run": args.run, "prompts": args.prompts, "gen_tokens": args.gen_tokens, "threads": args.threads,
              "machine": describe(), "loadavg": load, "rows": rows}
    print(f"\n{args.model} ({args.dtype}), token cascade {args.cheap}, run {args.run}, {args.prompts} prompts x "
          f"{args.gen_tokens} tokens")
    head = " | ".join(f"b{b} speedup | b{b} agreement | b{b} cheap" for b in batches)
    print(f"| threshold | {head} | KLD | same top % | PPL |")
    for row in rows:
        cells = " | ".join(f"{row[f'b{b}']['speedup']:.2f}x | {row[f'b{b}']['greedy_agreement_pct']:.1f} % | "
                           f"{100 * row[f'b{b}']['cheap_rate']:.0f} %" for b in batches)
        print(f"| {row['threshold']} | {cells} | {row['eval_kld']:.4f} | {row['eval_same_top_pct']:.1f} | "
              f"{row['eval_ppl']:.2f} |")
    suffix = ("" if args.model == "smollm2-135m" else "-" + Path(args.model).name) + \
        ("" if args.dtype in ("f32", "float32") else "-" + args.dtype)
    out = Path(args.json) if args.json else results_file(f"token_cascade{suffix}")
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
