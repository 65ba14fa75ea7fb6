"""lm-evaluation-harness against `lowbit serve`, given only base_url and model (no tokenizer path):
a multiple-choice task and a loglikelihood_rolling perplexity task from local files
(bench/lm_eval_tasks/), and the perplexity checked against `lowbit eval` on the same tokens.

    python bench/lm_eval_serve.py                            # the demo model, lm-eval from ~/venvs/tools
    python bench/lm_eval_serve.py --model ./my-int4 --lm-eval /path/to/venv/bin/lm_eval
    python bench/lm_eval_serve.py --batch-size 8              # 8 prompts per request

Not in CI: lm-eval has its own venv (its dependencies are not lowbit's):

    python -m venv ~/venvs/tools && ~/venvs/tools/bin/pip install "lm-eval[api]==0.4.13"

What is compared. lm-eval's rolling loglikelihood of a document is the sum of log p(token_i |
BOS, token_0 .. token_i-1) over ALL its tokens, the context being the tokenizer's BOS
(`prefix_token_id`, read from /tokenizer_info and /tokenize), in windows of max_length (2048)
tokens: every document here is one window. `lowbit eval` scores a text's tokens after the first,
so it is run on BOS text + document with --ctx = --stride = the token count (one window, every
token after BOS scored): the same conditional log-probabilities of the same tokens. The figure
compared is each document's total log-likelihood (lm-eval's per-document result, read from
--log_samples) against -ln(ppl) x tokens_scored of `lowbit eval --json`, and their token
perplexity exp(-sum LL / sum tokens). lm-eval's word_perplexity and byte_perplexity divide the
same total by words and bytes instead of tokens, so they follow from it and are reported as is.

Writes bench/results/lm_eval_serve.json; exits 1 if a perplexity differs by more than 0.1 %.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from servers import free_port, wait_ready  # noqa: E402
ROOT = HERE.parent
TASKS = HERE / "lm_eval_tasks"
RESULT = HERE / "results" / "lm_eval_serve.json"
TOLERANCE = 1e-3  # the 0.1 %


def run_lm_eval(lm_eval: str, base: str, model: str, out: Path, batch_size: int = 1) -> dict:
    # batch_size > 1: lm-eval sends that many prompts in one request (the server runs them side by side)
    cmd = [lm_eval, "--model", "local-completions", "--batch_size", str(batch_size),
           "--model_args", f"base_url={base}/v1/completions,model={model}",
           "--include_path", str(TASKS), "--tasks", "lowbit_mc,lowbit_ppl",
           "--output_path", str(out), "--log_samples"]
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)  # the task files name their data from the repo root
    elapsed = time.perf_counter() - started
    results = json.loads(Path(sorted(glob.glob(str(out / "*" / "results_*.json")))[-1]).read_text())
    samples = sorted(glob.glob(str(out / "*" / "samples_lowbit_ppl_*.jsonl")))[-1]
    per_doc = {}
    for line in Path(samples).read_text().splitlines():
        sample = json.loads(line)
        per_doc[sample["doc_id"]] = float(sample["filtered_resps"][0])
    return {"results": results["results"], "doc_loglikelihoods": [per_doc[i] for i in sorted(per_doc)],
            "seconds": elapsed}


def lowbit_eval_docs(model: str, dtype: str, threads: int | None) -> list[dict]:
    """lowbit eval on BOS + each document, one window over all of it (see the module docstring)."""
    from lowbit.formats.resolve import resolve_model
    from lowbit.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model))
    # lm-eval's prefix_token_id: the BOS token's id, or the EOS token's where that is missing (or 0)
    bos = tokenizer.special_tokens.get("bos_token")
    if bos is None or not tokenizer.encode(bos, add_bos=False)[0]:
        bos = tokenizer.special_tokens["eos_token"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, line in enumerate((TASKS / "ppl_docs.jsonl").read_text().splitlines()):
            text = bos + json.loads(line)["text"]
            n = len(tokenizer.encode(text, add_bos=False))
            if n % 2:
                sys.exit(f"ppl_docs.jsonl line {i + 1}: BOS + text is {n} tokens; lowbit eval's --ctx must be even")
            path = Path(tmp) / f"doc{i}.txt"
            path.write_text(text, encoding="utf-8")
            cmd = ["lowbit", "eval", model, "--data", str(path), "--ctx", str(n), "--stride", str(n), "--dtype", dtype,
                   "--json"] + (["--threads", str(threads)] if threads else [])
            print("+", " ".join(cmd), flush=True)
            report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            loglik = -math.log(report["ppl"]) * report["tokens_scored"]
            out.append({"tokens_scored": report["tokens_scored"], "ppl": report["ppl"], "loglikelihood": loglik})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=1, help="lm-eval's batch_size: prompts per request")
    ap.add_argument("--lm-eval", default=str(Path.home() / "venvs" / "tools" / "bin" / "lm_eval"))
    ap.add_argument("--base-url", default=None, help="a server already running (it must serve --model, f32)")
    args = ap.parse_args()

    proc = None
    base = args.base_url
    name = args.model
    if base is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = ["lowbit", "serve", args.model, "--port", str(port), "--dtype", args.dtype, "--kv-memory", "512MiB"]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd)
    try:
        if proc is not None:
            wait_ready(base, proc)
        with tempfile.TemporaryDirectory() as tmp:
            harness = run_lm_eval(args.lm_eval, base, name, Path(tmp), args.batch_size)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    ours = lowbit_eval_docs(args.model, args.dtype, args.threads)
    theirs = harness["doc_loglikelihoods"]
    tokens = sum(d["tokens_scored"] for d in ours)
    ppl_server = math.exp(-sum(theirs) / tokens)
    ppl_eval = math.exp(-sum(d["loglikelihood"] for d in ours) / tokens)
    rel = abs(ppl_server - ppl_eval) / ppl_eval
    mc = harness["results"]["lowbit_mc"]
    ppl = harness["results"]["lowbit_ppl"]
    print()
    print("| document | tokens | lm-eval via lowbit serve: loglikelihood | lowbit eval: loglikelihood | difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for i, (a, b) in enumerate(zip(theirs, ours)):
        print(f"| {i} | {b['tokens_scored']} | {a:.6f} | {b['loglikelihood']:.6f} | {abs(a - b['loglikelihood']):.2e} |")
    print(f"\ntoken perplexity: lm-eval through the server {ppl_server:.6f}, lowbit eval {ppl_eval:.6f} "
          f"(relative difference {rel:.2e}; limit {TOLERANCE:g})")
    print(f"lm-eval lowbit_ppl: word_perplexity {ppl['word_perplexity,none']:.4f}, "
          f"byte_perplexity {ppl['byte_perplexity,none']:.4f}, bits_per_byte {ppl['bits_per_byte,none']:.4f}")
    print(f"lm-eval lowbit_mc ({len((TASKS / 'mc_questions.jsonl').read_text().splitlines())} questions): "
          f"acc {mc['acc,none']:.4f}, acc_norm {mc['acc_norm,none']:.4f}; lm-eval ran {harness['seconds']:.1f} s")
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps({
        "model": args.model, "dtype": args.dtype, "batch_size": args.batch_size, "lm_eval": harness["results"],
        "doc_loglikelihoods_server": theirs, "lowbit_eval": ours, "token_ppl_server": ppl_server,
        "token_ppl_lowbit_eval": ppl_eval, "relative_difference": rel, "lm_eval_seconds": harness["seconds"],
    }, indent=2) + "\n")
    if rel > TOLERANCE:
        sys.exit(f"perplexities differ by {rel:.2e} (> {TOLERANCE:g})")


if __name__ == "__main__":
    main()
