"""RTN quality per format: SmolLM2 quantized by `lowbit quantize`, scored on wiki-eval against bf16.

    python bench/quality.py                         # every format, ctx 2048, the first 2 chunks
    python bench/quality.py --chunks 10 --formats int4-g32 nvfp4 --json results.json

Rows go to bench/results/quality.json (replaced) unless --json names another file.

For each format the demo model is quantized with lowbit's pipeline (RTN, searched scales, lm_head
and embeddings kept), written and loaded back as a native checkpoint, and run with the reference
kernel path (fp32 dequantize-then-matmul, so the figures are the format's, not a kernel's
rounding). The bf16 model runs once; its logits are cached on disk and replayed as the base of
every KL divergence, so each format costs one forward pass per chunk. Columns: bits per weight
over the Linears and over the whole model, tensor bytes, PPL, mean KLD vs bf16 (± its standard
error), same-top-token %, and the seconds quantization took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("LOWBIT_KERNEL", "reference")  # exact fp32 numerics of each format

sys.path.insert(0, str(Path(__file__).resolve().parent))
from base_logits import RecordingModel, ReplayModel  # noqa: E402
from lowbit.data.text import load_text  # noqa: E402
from lowbit.formats.resolve import resolve_model  # noqa: E402
from lowbit.compress.pipeline import quantize_model  # noqa: E402
from lowbit.runtime.evaluate import evaluate_tokens, plan_windows, tokenize_for_eval  # noqa: E402
from lowbit.runtime.loader import load_model  # noqa: E402
from lowbit.runtime.tokenizer import load_tokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = [
    "int4-g32", "int4-g64", "int4-g128", "nvfp4", "mxfp4-floor", "mxfp4-roundup", "mxfp4", "nf4",
    "int8", "fp8", "fp8-block128", "int4-asym-g32", "int4-asym-g64", "int4-asym-g128",
]


def run(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    tokens, bos_id = tokenize_for_eval(tokenizer, load_text(args.data))
    windows = plan_windows(len(tokens), args.ctx, args.chunks)
    work = Path(tempfile.mkdtemp(prefix="lowbit-quality-", dir=args.workdir))
    rows = []
    try:
        base = load_model(model_dir, dtype=torch.float32)
        recorder = RecordingModel(base, work)
        started = time.perf_counter()
        result = evaluate_tokens(recorder, tokens, windows, bos_id)
        size = sum(p.numel() * 2 for p in base.parameters())  # bf16 on disk
        rows.append({"format": "bf16", "linear_bpw": 16.0, "bpw": 16.0, "mb": size / 1e6, "ppl": result.ppl,
                     "ppl_err": result.ppl_err, "kld": 0.0, "kld_err": 0.0, "same_top": 100.0,
                     "quantize_s": 0.0, "eval_s": time.perf_counter() - started})
        _log(rows[-1])
        config = base.config
        del base, recorder
        for label in args.formats:
            out = work / label
            summary = quantize_model(model_dir, label, out_dir=out, overwrite=True)
            model = load_model(out, dtype=torch.float32)
            result = evaluate_tokens(model, tokens, windows, bos_id, base_model=ReplayModel(work, config))
            k = result.kld
            rows.append({"format": label, "linear_bpw": summary.linear_bits_per_weight, "bpw": summary.bits_per_weight,
                         "mb": summary.bytes_after / 1e6, "ppl": result.ppl, "ppl_err": result.ppl_err,
                         "kld": k.mean, "kld_err": k.err, "same_top": k.same_top_pct,
                         "quantize_s": summary.seconds, "eval_s": result.eval_s})
            _log(rows[-1])
            del model
            shutil.rmtree(out, ignore_errors=True)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"chunks": len(windows), "ctx": args.ctx, "rows": rows}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _log(row: dict) -> None:
    print(f"{row['format']}: PPL {row['ppl']:.4f}, KLD {row['kld']:.5f}, same top {row['same_top']:.2f} % "
          f"({row['quantize_s']:.0f} s quantize, {row['eval_s']:.0f} s eval)", file=sys.stderr, flush=True)


def markdown(rows: list[dict]) -> str:
    lines = ["| format | bits/weight (Linears) | bits/weight (all) | size MB | PPL | KLD vs bf16 | same top % | quantize s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['linear_bpw']:.3f} | {r['bpw']:.3f} | {r['mb']:.1f} | {r['ppl']:.3f} ± {r['ppl_err']:.3f} | "
            f"{r['kld']:.4f} ± {r['kld_err']:.4f} | {r['same_top']:.2f} | {r['quantize_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-eval")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=2, help="the first N chunks of ctx tokens (default 2)")
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the temporary checkpoints and base logits go")
    parser.add_argument("--json", default=str(RESULTS / "quality.json"),
                        help="write the rows to this JSON file, replacing it (updated after each format; default bench/results/quality.json)")
    args = parser.parse_args()
    rows = run(args)
    print(f"{args.model} on {args.data}: ctx {args.ctx}, first {args.chunks} chunks, RTN, KLD vs bf16 (fp32 compute)")
    print(markdown(rows))


if __name__ == "__main__":
    main()
