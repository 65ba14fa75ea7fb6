"""A dense head's greedy argmax through its int8 copy (kernels/screened_head.py, the screen) against
the whole head, in one process, alternated: the head alone at M rows, and the engine's greedy
decode at B sequences.

- head alone: the final-norm hidden states of --positions tokens of wiki-eval (one forward of the
  model, read at the head's input), M consecutive rows at a time; the whole head (its own kernel,
  then the argmax) and the screen take turns on each window, each call after a 64 MB write so the
  weights come from memory, as in a decode step; median ms of each, and the tokens compared at
  every window (a difference ends the script).
- engine: B greedy sequences (distinct wiki-eval prompts, --gen-tokens each, EOS ignored) in one
  engine, the screen on and off (`LOWBIT_HEAD_SCREEN`) taking turns --rounds times after a warm-up
  of each; decode tok/s once every sequence has its first token, the median of each and of the
  pairwise ratios, and the tokens compared.

    python bench/head_screen.py [--model smollm2-135m] [--rows 1,8,16,32,64] [--batches 1,16,32,64]
        [--rounds 4] [--positions 320] [--gen-tokens 64] [--threads 2] [--json]

Writes bench/results/head_screen-<model>.json (results_file: tagged by LOWBIT_RESULTS_TAG). Needs
AVX512-VNNI (the copy's kernel) and a dense head.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, print_table, results_file, save_results  # noqa: E402
from query_cascade import prompts as wiki_prompts  # noqa: E402

FLUSH_BYTES = 64 << 20


def hidden_states(engine, positions: int) -> torch.Tensor:
    """Final-norm hidden rows [positions, K] of the start of wiki-eval, as the head receives them."""
    from lowbit.data.text import load_text

    ids = engine.tokenizer.encode(load_text("wiki-eval"))[:positions]
    if len(ids) < positions:
        raise SystemExit(f"wiki-eval has fewer than {positions} tokens")
    x = torch.tensor([ids])
    with torch.inference_mode():
        h = engine.model.model(x, torch.arange(positions), positions - 1, None)
    return h[0].float().contiguous()


def head_alone(engine, screen, hidden: torch.Tensor, rows: list[int], rounds: int) -> list[dict]:
    """Median ms of the whole head + argmax and of the screen at each row count (see the module)."""
    from lowbit.kernels import decode_chain, screened_head

    lm = engine.model.lm_head
    head = decode_chain.dense_linear(lm.weight.data, None, lm.bf16_x, lm.packed)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    out = []
    for m in rows:
        whole, screened = [], []
        starts = range(0, hidden.shape[0] - m + 1, max(m, 7))
        if not starts:
            raise SystemExit(f"--positions {hidden.shape[0]} holds no window of {m} rows")
        for _ in range(rounds):
            for i in starts:
                x = hidden[i : i + m].contiguous()
                flush.add_(1)
                t = time.perf_counter()
                want = lm(x).float().argmax(dim=1)
                whole.append(time.perf_counter() - t)
                flush.add_(1)
                t = time.perf_counter()
                got = screened_head.argmax(screen, head, x)
                screened.append(time.perf_counter() - t)
                if got is None or not torch.equal(got, want):
                    raise SystemExit(f"the screen's tokens differ from the whole head's at rows {i}..{i + m - 1}")
        w, s = statistics.median(whole) * 1e3, statistics.median(screened) * 1e3
        out.append({"rows": m, "whole_ms": round(w, 3), "screened_ms": round(s, 3), "ratio": round(s / w, 3),
                    "windows": len(whole)})
    return out


def engine_pairs(engine, prompts: list[list[int]], batch: int, rounds: int, gen_tokens: int) -> dict:
    """Greedy decode tok/s of `batch` sequences with the screen on and off, alternated (see the module)."""
    from lowbit.kernels import screened_head
    from lowbit.runtime.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {"1": [], "0": []}
    tokens: dict[str, list] = {"1": [], "0": []}
    before = os.environ.get(screened_head.ENV)
    try:
        for r in range(rounds + 1):  # round 0 warms both up
            for on in ("1", "0") if r % 2 == 0 else ("0", "1"):
                os.environ[screened_head.ENV] = on
                ids = [f"{batch}-{r}-{on}-{i}" for i in range(batch)]
                for rid, p in zip(ids, prompts[:batch]):
                    engine.add_request(rid, p, params)
                got = {rid: [] for rid in ids}
                started = set()
                n, t = 0, None
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        got[o.request_id].extend(o.new_token_ids)
                        if t is not None:
                            n += len(o.new_token_ids)
                        elif o.new_token_ids:
                            started.add(o.request_id)
                    if t is None and len(started) == batch:
                        t = time.perf_counter()
                if r:
                    rates[on].append(n / (time.perf_counter() - t))
                    tokens[on].append([got[rid] for rid in ids])
    finally:
        if before is None:
            os.environ.pop(screened_head.ENV, None)
        else:
            os.environ[screened_head.ENV] = before
    if tokens["1"] != tokens["0"]:
        raise SystemExit(f"the screen changed the tokens at {batch} sequences")
    pairs = [a / b for a, b in zip(rates["1"], rates["0"])]
    return {"batch": batch, "screen_tok_s": round(statistics.median(rates["1"]), 1),
            "whole_tok_s": round(statistics.median(rates["0"]), 1), "ratio": round(statistics.median(pairs), 3),
            "pairs": [round(p, 3) for p in pairs]}


def model_label(model: str) -> str:
    """A results file's name for a model: a demo name as it is, a directory by its last two parts
    (~/.cache/lowbit/vs_llamacpp/gemma3-270m/int4 -> gemma3-270m-int4)."""
    path = Path(model).expanduser()
    if not path.exists():
        return model.replace("/", "-")
    return "-".join(path.resolve().parts[-2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a demo name or a checkpoint directory")
    ap.add_argument("--rows", default="1,8,16,32,64", help="row counts of the head alone (empty: none)")
    ap.add_argument("--batches", default="1,16,32,64", help="sequence counts of the engine's pairs (empty: none)")
    ap.add_argument("--rounds", type=int, default=4, help="alternations (one more warms the engine up)")
    ap.add_argument("--positions", type=int, default=320, help="wiki-eval tokens whose hidden states the head alone takes")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    batches = [int(b) for b in args.batches.split(",") if b]
    if any(v < 1 for v in rows + batches) or args.rounds < 1 or args.positions < 1 or args.gen_tokens < 2:
        raise SystemExit("--rows, --batches, --rounds and --positions must be positive, --gen-tokens at least 2")
    torch.set_num_threads(args.threads)
    os.environ["LOWBIT_HEAD_SCREEN_AFTER"] = "0"  # the copy from the engine's first greedy token
    from lowbit.kernels import screened_head
    from lowbit.runtime.engine.engine import Engine

    engine = Engine(args.model)
    lm = engine.model.lm_head
    screen = screened_head.build(lm.weight.data, lm.bf16_x and lm.weight.dtype is torch.bfloat16)
    if screen is None:
        raise SystemExit("no screen here: the head is not a dense float32/bf16 weight with K a multiple of 32, "
                         "or the CPU has no AVX512-VNNI")
    alone = head_alone(engine, screen, hidden_states(engine, args.positions), rows, args.rounds) if rows else []
    prompts = []
    if batches:
        prompts = [engine.tokenizer.encode(p) for p in wiki_prompts(max(batches))]
        engine.touch_kv(max(batches), max(len(p) for p in prompts) + args.gen_tokens)
    pairs = [engine_pairs(engine, prompts, b, args.rounds, args.gen_tokens) for b in batches]
    result = {"script": "bench/head_screen.py", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": describe(),
              "model": args.model, "threads": args.threads, "rounds": args.rounds, "head_alone": alone, "engine": pairs}
    path = results_file("head_screen-" + model_label(args.model))
    if save_results(path, result, args.json):
        return 0
    print(f"{result['machine']}, {args.model}, {args.threads} threads ({path.name})")
    if alone:
        print_table(["rows", "whole head ms", "screened ms", "screened ÷ whole"],
                    [[str(a["rows"]), f"{a['whole_ms']:.2f}", f"{a['screened_ms']:.2f}", f"{a['ratio']:.2f}×"] for a in alone])
    if pairs:
        print_table(["sequences", "screen on tok/s", "off tok/s", "on ÷ off (pairs)"],
                    [[str(p["batch"]), f"{p['screen_tok_s']:.1f}", f"{p['whole_tok_s']:.1f}",
                      f"{p['ratio']:.2f}× ({', '.join(f'{x:.2f}' for x in p['pairs'])})"] for p in pairs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
