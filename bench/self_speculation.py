"""Exact speculative decoding at batch 1 against plain greedy decoding of the same model, same
run: each draft source (`self:int4-g32`, `self:layers=N`, a checkpoint, `ngram`) at each
--num-speculative-tokens k, with the outputs checked identical token for token.

All engines live in this process and take turns, round after round, over the same prompts (the
starts of wiki-eval paragraphs, as bench/query_cascade.py; greedy, --gen-tokens each, EOS ignored,
one request at a time); the first round warms up and is not counted. Reported per setting: the
median over rounds of its tok/s, the median of its per-round ratio to plain decoding in the same
round (this VM's memory bandwidth moves between ~33 and ~60 GB/s from minute to minute, and a
bandwidth-bound plain step moves with it more than a draft step does), the mean accepted length
(tokens each pass over the model's weights produced) and the draft's share of the time.

    python bench/self_speculation.py [--model smollm2-135m] [--drafts self:int4-g32] [--k 2,3,4,5]
        [--prompts 8] [--gen-tokens 96] [--rounds 5] [--threads 2] [--json PATH]

Writes bench/results/self_speculation[-MODEL].json (results_file: tagged by LOWBIT_RESULTS_TAG).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, print_table, results_file  # noqa: E402
from query_cascade import prompts as wiki_prompts  # noqa: E402


def time_drafting(engine) -> list[float]:
    """Wrap the engine's drafter so the seconds spent proposing add up in the returned cell."""
    spent = [0.0]
    drafter = engine.drafter
    if drafter is not None:
        propose = drafter.propose

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return propose(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - start

        drafter.propose = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafts", default="self:int4-g32", help="comma list of draft sources")
    ap.add_argument("--k", default="2,3,4,5", help="comma list of --num-speculative-tokens")
    ap.add_argument("--draft-vocabs", default="auto", help="comma list of --draft-vocab settings: auto (the "
                    "default), 0 (the whole head) or a token count")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5, help="rounds counted (one more warms up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sequence import SamplingParams

    kv = 256 << 20
    engines = {"plain": Engine(args.model, kv_memory=kv)}
    vocabs = args.draft_vocabs.split(",")
    for draft in args.drafts.split(","):
        for k in (int(x) for x in args.k.split(",")):
            for vocab in vocabs:
                name = f"{draft} k={k}" + (f" vocab={vocab}" if len(vocabs) > 1 else "")
                engines[name] = Engine(args.model, draft=draft, num_speculative_tokens=k, kv_memory=kv,
                                       draft_vocab=None if vocab == "auto" else int(vocab))
    tok = engines["plain"].tokenizer
    prompts = [tok.encode(t) for t in wiki_prompts(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    tokens = args.gen_tokens * len(prompts)
    load = {"before": os.getloadavg()}
    seconds = {name: [] for name in engines}
    drafting = {name: [] for name in engines}
    spent = {name: time_drafting(engine) for name, engine in engines.items()}
    for rnd in range(args.rounds + 1):
        reference = None
        for name, engine in engines.items():
            before = spent[name][0]
            start = time.perf_counter()
            out = [engine.generate([p], params)[0].token_ids for p in prompts]
            s, d = time.perf_counter() - start, spent[name][0] - before
            if reference is None:
                reference = out
            elif out != reference:
                raise SystemExit(f"{name}: output differs from plain greedy decoding")
            if rnd:
                seconds[name].append(s)
                drafting[name].append(d)
        if rnd:
            print(f"round {rnd}: " + ", ".join(f"{n} {tokens / seconds[n][-1]:.1f}" for n in engines), flush=True)
    load["after"] = os.getloadavg()
    rows = []
    for name, engine in engines.items():
        ratios = [p / s for p, s in zip(seconds["plain"], seconds[name])]
        row = {"setting": name, "tok_s": statistics.median(tokens / s for s in seconds[name]),
               "tok_s_rounds": [tokens / s for s in seconds[name]], "speedup": statistics.median(ratios),
               "speedup_rounds": ratios, "draft_share": sum(drafting[name]) / sum(seconds[name])}
        if name != "plain":
            row["mean_accepted_length"] = engine.spec_stats.mean_accepted_length
            row["draft_vocab"] = engine.draft_head_vocab  # tokens the draft head scored (None: all)
        rows.append(row)
    result = {"model": args.model, "prompts": args.prompts, "gen_tokens": args.gen_tokens, "rounds": args.rounds,
              "threads": args.threads, "machine": describe(), "loadavg": load, "rows": rows}
    print(f"\n{args.model}, batch 1, {args.prompts} wiki prompts x {args.gen_tokens} greedy tokens, "
          f"{args.rounds} rounds; identical output checked")
    print_table(["setting", "tok/s", "speedup (rounds)", "mean accepted length", "time drafting"],
                [[row["setting"], f"{row['tok_s']:.1f}",
                  f"{row['speedup']:.2f}× (" + ", ".join(f"{r:.2f}" for r in row["speedup_rounds"]) + ")",
                  f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "—",
                  f"{100 * row['draft_share']:.0f} %"] for row in rows])
    stem = "self_speculation" + ("" if args.model == "smollm2-135m" else "-" + Path(args.model).name)
    out = Path(args.json) if args.json else results_file(stem)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
