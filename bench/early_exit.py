"""Early exit and self-speculative decoding on SmolLM2-135M (30 layers), float32 CPU, batch 1.

Early exit (approximate, runtime/early_exit.py): for each threshold, decode tok/s of ExitDecoder
(threshold 1.0 = the full model on the same code path: the fair baseline), greedy agreement with
the full model over --gen-tokens tokens of a few prompts (position by position, and the run before
the first difference), the mean layers run per token, and PPL / KLD to the full model from
`lowbit eval`'s path (EarlyExitLM) on wiki-eval. Both confidences (top1, margin) are scored.

Self-speculative (exact): the engine with --draft self:layers=N against plain decoding, outputs
checked identical, mean accepted length. Timed runs alternate (early-exit thresholds with the
baseline, each draft with plain) `--repeats` times; medians are reported. The VM is shared: the
load average is printed before and after.

    python bench/early_exit.py --threads 2 [--model DIR] [--gen-tokens 128] [--prompts 3] [--repeats 1] [--json out.json]

With --model a directory that `lowbit distill --exit-layers` wrote, every exit that has a trained
adapter uses it (early exit, eval and the self-speculative drafts alike). The token cascade runs in
the engine and has its own script: bench/token_cascade.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lowbit.runtime.early_exit import EarlyExitLM, ExitDecoder, ExitSettings, FullLogits
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams

MODEL = "smollm2-135m"
PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
]


def exit_decode(model, prompt: list[int], gen: int, settings: ExitSettings, adapters=None) -> tuple[list[int], float, float]:
    """(greedy tokens, decode tok/s over gen - 1 steps, mean layers per token)."""
    dec = ExitDecoder(model, settings, len(prompt) + gen + 1, adapters)
    logits = dec.prefill(prompt)
    out = [int(logits.argmax())]
    start = time.perf_counter()
    for _ in range(gen - 1):
        out.append(int(dec.step(out[-1]).argmax()))
    elapsed = time.perf_counter() - start
    return out, (gen - 1) / elapsed, dec.stats.mean_layers


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b)) / len(b)
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    return same, prefix


def eval_kld(model, tokens, windows, settings: ExitSettings, adapters=None) -> dict:
    from lowbit.runtime.evaluate import evaluate_tokens

    early = EarlyExitLM(model, settings, adapters)
    r = evaluate_tokens(early, tokens, windows, base_model=FullLogits(early))
    return {"ppl": r.ppl, "kld": r.kld.mean, "same_top_pct": r.kld.same_top_pct, "base_ppl": r.kld.base_ppl,
            "mean_layers": early.stats.mean_layers, "exit_rate": early.stats.rates()}


def engine_decode(engine: Engine, prompt: list[int], gen: int) -> tuple[list[int], float, float]:
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    engine.reset_prefix_cache()
    before = engine.spec_stats.num_passes, engine.spec_stats.num_accepted
    engine.add_request("b", prompt, params)
    ids, first = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            if first is None and ids:
                first = time.perf_counter()
    elapsed = time.perf_counter() - first
    passes = engine.spec_stats.num_passes - before[0]
    accepted = engine.spec_stats.num_accepted - before[1]
    mal = (accepted + passes) / passes if passes else 0.0
    return ids, (len(ids) - 1) / elapsed, mal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL, help="a model directory with exit_adapters.safetensors (lowbit distill "
                    "--exit-layers) decodes through its adapters")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--exit-layers", default="24,26,28")
    ap.add_argument("--thresholds", default="1.0,0.999,0.99,0.95,0.9")
    ap.add_argument("--draft-layers", default="15,24,27")
    ap.add_argument("--eval-chunks", type=int, default=4)
    ap.add_argument("--eval-ctx", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--skip-spec", action="store_true")
    ap.add_argument("--skip-exits", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lowbit.data.text import load_text
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.evaluate import plan_windows, tokenize_for_eval
    from lowbit.runtime.loader import load_model
    from lowbit.runtime.tokenizer import load_tokenizer

    load = {"before": os.getloadavg()}
    from lowbit.runtime.exit_adapters import load_adapters

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    model = load_model(path, torch.float32, "cpu")
    adapters = load_adapters(path, model.config)
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    layers = tuple(int(x) for x in args.exit_layers.split(","))
    thresholds = [float(x) for x in args.thresholds.split(",")]
    result = {"model": args.model, "adapted_layers": sorted(adapters), "threads": args.threads, "gen_tokens": args.gen_tokens, "exit_layers": list(layers),
              "early_exit": [], "self_speculative": []}

    text_tokens, _ = tokenize_for_eval(tok, load_text("wiki-eval"))
    windows = plan_windows(len(text_tokens), args.eval_ctx, args.eval_chunks)
    full = {}
    for p_i, p in enumerate(prompts):
        full[p_i] = exit_decode(model, p, args.gen_tokens, ExitSettings(layers, 1.0))[0]
    for conf in () if args.skip_exits else ("top1", "margin"):
        for t in thresholds:
            s = ExitSettings(layers, t, conf)
            speeds, base_speeds, same, prefix, mean_layers = [], [], [], [], []
            for _ in range(args.repeats):
                for p_i, p in enumerate(prompts):
                    base_speeds.append(exit_decode(model, p, args.gen_tokens, ExitSettings(layers, 1.0))[1])
                    ids, speed, ml = exit_decode(model, p, args.gen_tokens, s, adapters)
                    speeds.append(speed)
                    a, b = agreement(ids, full[p_i])
                    same.append(a)
                    prefix.append(b)
                    mean_layers.append(ml)
            row = {"confidence": conf, "threshold": t, "tok_s": statistics.median(speeds),
                   "baseline_tok_s": statistics.median(base_speeds),
                   "speedup": statistics.median(x / y for x, y in zip(speeds, base_speeds)),
                   "greedy_agreement_pct": 100 * statistics.mean(same),
                   "agree_prefix_tokens": statistics.median(prefix),
                   "decode_mean_layers": statistics.mean(mean_layers), **{"eval_" + k: v for k, v in
                                                                          eval_kld(model, text_tokens, windows, s, adapters).items()}}
            result["early_exit"].append(row)
            print(json.dumps(row), flush=True)
            if t == 1.0 and conf == "margin":
                result["early_exit"].pop()  # the same as top1's 1.0 row

    if not args.skip_spec:
        plain = Engine(args.model, max_num_seqs=1)
        for n in (int(x) for x in args.draft_layers.split(",")):
            spec = Engine(args.model, max_num_seqs=1, draft=f"self:layers={n}")
            pairs, mals, identical = [], [], True
            for _ in range(args.repeats):
                for p in prompts:
                    ref, plain_speed, _ = engine_decode(plain, p, args.gen_tokens)
                    ids, speed, mal = engine_decode(spec, p, args.gen_tokens)
                    identical &= ids == ref
                    pairs.append((speed, plain_speed))
                    mals.append(mal)
            row = {"draft": f"self:layers={n}", "tok_s": statistics.median(s for s, _ in pairs),
                   "plain_tok_s": statistics.median(p for _, p in pairs),
                   "speedup": statistics.median(s / p for s, p in pairs),
                   "mean_accepted_length": statistics.mean(mals), "identical": identical}
            result["self_speculative"].append(row)
            print(json.dumps(row), flush=True)
            del spec
    load["after"] = os.getloadavg()
    result["loadavg"] = load
    print(json.dumps({"loadavg": load}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
