"""Decode speed of lowbit's engine on SmolLM2-135M beside transformers' generate, same run.

Rows: transformers bf16 batch 1; lowbit bf16 batch 1; lowbit int4 (RTN g128, in-memory, the
batch-invariant cpu-int4dot kernel, q/k/v and gate/up joined) batch 1 and 16 concurrent requests; speculative decoding (n-gram and self:int4 drafts)
against plain fp32 greedy decoding (plus any --draft, e.g. a GPTQ int4 checkpoint of the same
model), and n-gram drafts for the int4 target against plain int4, with the outputs checked identical.
Ratios (speedups, 16 concurrent over batch 1) alternate the two runs `--spec-pairs` times and
report the median of the paired ratios: this VM's speed drifts 10-20 % between runs.

    python bench/decode.py --threads 2 [--gen-tokens 64] [--draft CHECKPOINT] [--spec-pairs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lowbit.runtime.engine.benchmark import bench_prompt, run_requests
from lowbit.runtime.engine.draft_models import quantize_linears_
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sequence import SamplingParams

MODEL = "smollm2-135m"


def transformers_decode(path, prompt: list[int], gen: int) -> float:
    """tok/s of HF generate (greedy, bf16, batch 1), prefill excluded: (gen - 1) tokens over
    the time of a `gen`-token run minus a 1-token run."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])

    def timed(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    timed(4)
    return (gen - 1) / (timed(gen) - timed(1))


def lowbit_decode(engine, prompt, gen, batch=1) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    run_requests(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prompts = [[prompt[0] + i] + prompt[1:] for i in range(batch)]
    return run_requests(engine, prompts, greedy)


def paired_speedup(plain_engine, engine, prompt, gen, expected, pairs: int) -> dict:
    """Speculative `engine` against `plain_engine`. This VM's speed drifts 10-20 % between runs, so
    the two alternate `pairs` times and the median of the paired ratios is the speedup (same
    wall-clock basis for both: all generated tokens over the whole run)."""
    passes0, stats0 = engine.spec_stats.num_passes, engine.stats()
    ratios, identical = [], True
    for _ in range(pairs):
        base = lowbit_decode(plain_engine, prompt, gen)
        r = lowbit_decode(engine, prompt, gen)
        ratios.append(base["total_s"] / r["total_s"])
        identical &= r["tokens"] == expected == base["tokens"]
    stats, passes = engine.stats(), engine.spec_stats.num_passes - passes0
    accepted = stats.spec_accepted_tokens - stats0.spec_accepted_tokens
    return {"speedup": statistics.median(ratios), "speedups": [round(x, 3) for x in ratios], "identical": identical,
            "mean_accepted_length": (accepted + passes) / max(passes, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--spec-pairs", type=int, default=3,
                    help="plain/speculative run pairs per draft; the median ratio is reported")
    ap.add_argument("--draft", action="append", default=[],
                    help="an extra draft for the float32 target (e.g. a calibrated int4 checkpoint of the same model); repeatable")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = args.gen_tokens
    rows = []

    bf16 = Engine(MODEL, dtype="bfloat16", max_num_seqs=16, max_model_len=1024)
    prompt = bench_prompt(bf16.tokenizer, args.prompt_tokens)
    load_before = os.getloadavg()[0]
    rows.append(("transformers generate bf16", 1, transformers_decode(bf16.model_path, prompt, gen)))
    plain = lowbit_decode(bf16, prompt, gen)
    rows.append(("lowbit bf16", 1, plain["decode_tok_s"]))

    # Speculation in float32: a verify pass runs 1 + k rows through each matmul where plain decoding
    # runs 1, and in bf16 the different rounding flips near-tied argmaxes (measured: outputs then
    # diverge), so identical greedy output is only checkable at full precision.
    fp32 = Engine(MODEL, dtype="float32", max_num_seqs=1, max_model_len=1024)
    plain = lowbit_decode(fp32, prompt, gen)
    rows.append(("lowbit fp32", 1, plain["decode_tok_s"]))
    spec = {}
    for draft in ("ngram", "self:int4", *args.draft):
        engine = Engine(MODEL, dtype="float32", max_num_seqs=1, max_model_len=1024, draft=draft)
        spec[draft] = paired_speedup(fp32, engine, prompt, gen, plain["tokens"], args.spec_pairs)
        del engine
    del fp32

    int4 = bf16
    quantize_linears_(int4.model, "int4", int4.device)
    r1 = lowbit_decode(int4, prompt, gen)
    # Speculation with the int4 target: its matmuls and attention are batch-invariant
    # (native/int4_dot.c, native/paged_decode.c), so a verify of 1 + k rows computes each row
    # exactly as plain decoding does, and the output must be identical at bf16 too.
    # k = 3: a verify of 1 + 3 rows is one pass of the int4 kernel over the weights (4 rows per pass)
    engine = Engine(MODEL, dtype="bfloat16", max_num_seqs=1, max_model_len=1024, draft="ngram", num_speculative_tokens=3)
    quantize_linears_(engine.model, "int4", engine.device)
    spec["ngram, k <= 3 (int4 target)"] = paired_speedup(int4, engine, prompt, gen, r1["tokens"], args.spec_pairs)
    del engine
    # 16 concurrent against batch 1, alternating, median of the paired ratios
    singles, sixteens = [], []
    for _ in range(args.spec_pairs):
        singles.append(lowbit_decode(int4, prompt, gen)["decode_tok_s"])
        sixteens.append(lowbit_decode(int4, prompt, gen, batch=16)["decode_tok_s"])
    rows.append(("lowbit int4 (RTN g128)", 1, statistics.median(singles)))
    rows.append(("lowbit int4 (RTN g128)", 16, statistics.median(sixteens)))
    aggregate = statistics.median([b / a for a, b in zip(singles, sixteens)])
    load_after = os.getloadavg()[0]

    result = {
        "threads": args.threads, "gen_tokens": gen, "prompt_tokens": len(prompt),
        "load_average": [round(load_before, 1), round(load_after, 1)], "cpus": os.cpu_count(),
        "decode": [{"runtime": n, "batch": b, "tok_s": round(t, 1)} for n, b, t in rows],
        "int4_aggregate_16_over_batch_1": aggregate,
        "int4_aggregate_pairs": [round(b / a, 3) for a, b in zip(singles, sixteens)],
        "speculative": spec,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"threads {args.threads}, load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs")
    print("| runtime | batch | decode tok/s |\n| --- | --- | --- |")
    for n, b, t in rows:
        print(f"| {n} | {b} | {t:.1f} |")
    pairs = ", ".join(f"{x:.2f}" for x in result["int4_aggregate_pairs"])
    print(f"int4 aggregate at 16 / batch 1: {aggregate:.2f}x (median of pairs {pairs}; tok/s rows are medians)")
    print("| draft (target) | speedup vs plain target (median; each pair) | mean accepted length | identical greedy output |\n| --- | --- | --- | --- |")
    for d, s in spec.items():
        name = d if "target" in d else f"{d} (fp32 target)"
        pairs = ", ".join(f"{x:.2f}" for x in s.get("speedups", [s["speedup"]]))
        print(f"| {name} | {s['speedup']:.2f}x ({pairs}) | {s['mean_accepted_length']:.2f} | {s['identical']} |")


if __name__ == "__main__":
    main()
