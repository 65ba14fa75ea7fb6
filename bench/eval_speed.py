"""Eval throughput: lowbit's runtime beside transformers on the same chunks with the same scoring.

    python bench/eval_speed.py                          # smollm2-135m on wiki-eval, ctx 2048, 3 chunks
    python bench/eval_speed.py MODEL_DIR [MODEL_DIR ...] --chunks 2 --data wiki-eval --ctx 2048

Each model directory gets one row: lowbit's tokens/s and PPL, transformers' (AutoModelForCausalLM,
fp32, eager attention) tokens/s and PPL, and the speed ratio. Both run through the same
lowbit.runtime.evaluate.evaluate_tokens, so tokenization, chunking and scoring are identical and
only the forward pass differs. A directory transformers cannot load (e.g. a lowbit int4 checkpoint)
gets "n/a" in the transformers columns.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from lowbit.data.text import load_text
from lowbit.formats.resolve import resolve_model
from lowbit.runtime.evaluate import EvalResult, evaluate_tokens, plan_windows, tokenize_for_eval
from lowbit.runtime.loader import load_model
from lowbit.runtime.tokenizer import load_tokenizer


class TransformersCausalLM(torch.nn.Module):
    """transformers' model behind lowbit's forward contract (logits from `logits_start` on)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config

    def forward(self, input_ids, positions=None, cache=None, logits_start=0):
        keep = input_ids.shape[1] - logits_start
        return self.hf(input_ids, logits_to_keep=keep, use_cache=False).logits


def load_transformers(path) -> TransformersCausalLM:
    from transformers import AutoModelForCausalLM

    from lowbit.formats.foreign import detect_checkpoint_kind

    # transformers does not refuse lowbit's native layout: it would fill the Linears with random
    # weights and report a meaningless speed, so such a directory gets n/a instead.
    if detect_checkpoint_kind(path) == "native":
        raise ValueError("lowbit native checkpoint")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return TransformersCausalLM(hf.eval())


def run_one(model, tokens, windows, bos_id) -> EvalResult:
    # One untimed window first, so one-off costs (allocations, lazy init) are not charged to either side.
    evaluate_tokens(model, tokens, windows[:1], bos_id=bos_id)
    return evaluate_tokens(model, tokens, windows, bos_id=bos_id)


def bench_model(path, text: str, ctx: int, chunks: int) -> dict:
    path = resolve_model(path)
    tokenizer = load_tokenizer(path)
    tokens, bos_id = tokenize_for_eval(tokenizer, text)
    windows = plan_windows(len(tokens), ctx, chunks)
    row = {"model": str(path), "tokens": sum(w.end - w.start for w in windows)}
    ours = run_one(load_model(path, dtype=torch.float32), tokens, windows, bos_id)
    row.update(lowbit_tps=ours.tokens_per_s, lowbit_ppl=ours.ppl)
    try:
        reference = load_transformers(path)
    except Exception as exc:  # noqa: BLE001 - a checkpoint transformers cannot read just gets n/a
        row.update(hf_tps=None, hf_ppl=None, note=f"transformers: {type(exc).__name__}")
        return row
    theirs = run_one(reference, tokens, windows, bos_id)
    row.update(hf_tps=theirs.tokens_per_s, hf_ppl=theirs.ppl, note="")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["smollm2-135m"], help="model directories or demo names")
    parser.add_argument("--data", default="wiki-eval")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = load_text(args.data)
    table = Table(title=f"lowbit eval vs transformers: {args.data}, ctx {args.ctx}, {args.chunks} chunks, fp32, {torch.get_num_threads()} threads")
    for column in ("model", "lowbit tok/s", "transformers tok/s", "ratio", "lowbit PPL", "transformers PPL", "note"):
        table.add_column(column)
    started = time.perf_counter()
    for model in args.models:
        row = bench_model(model, text, args.ctx, args.chunks)
        hf_tps = row["hf_tps"]
        table.add_row(
            model,
            f"{row['lowbit_tps']:.0f}",
            f"{hf_tps:.0f}" if hf_tps else "n/a",
            f"{row['lowbit_tps'] / hf_tps:.2f}x" if hf_tps else "n/a",
            f"{row['lowbit_ppl']:.4f}",
            f"{row['hf_ppl']:.4f}" if row["hf_ppl"] else "n/a",
            row["note"],
        )
    console = Console(width=160)
    console.print(table)
    console.print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
