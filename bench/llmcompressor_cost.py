"""What the same calibrate + GPTQ run costs llm-compressor: wall time and peak RSS of its `oneshot`
with GPTQModifier on CPU, fed the exact token windows lowbit's own GPTQ calibrates on.

Settings (issue 4's reference run): W4A16 symmetric int4, group size 64 (group 128 does not divide
SmolLM2's 576 columns), lm_head kept dense, GPTQModifier's defaults (dampening 0.01, static
act-order, blocks of 128), everything on CPU in the model's bf16.

Two steps, two interpreters (llm-compressor pins its own transformers, so it lives in a venv):

    # 1. lowbit's calibration windows -> IDS.pt (system python, where lowbit is installed)
    python bench/llmcompressor_cost.py --dump-ids /tmp/ids-128x512.pt --samples 128 --seqlen 512
    # 2. llm-compressor on exactly those ids, measured as a fresh child process (the venv)
    python -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/lcvenv/bin/python bench/llmcompressor_cost.py --samples 128 --seqlen 512 \\
        --ids /tmp/ids-128x512.pt -o /tmp/lc-128x512
    # 3. score the compressed-tensors checkpoint with lowbit
    lowbit eval /tmp/lc-128x512 --data wiki-eval --chunks 10 --ctx 2048 --base smollm2-135m --json

Step 2 forks a child that does the whole job (import, load, oneshot, save) and reads the child's
wall time and peak RSS from wait4, as bench/gptq_cost.py does for `lowbit quantize`; the child
also reports the seconds spent inside oneshot alone. Run it under the shared CPU lock. The row goes
to bench/results/llmcompressor_cost.json (replaced) unless --json names another file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

MODEL = "~/.cache/lowbit/models/smollm2-135m"
RESULTS = Path(__file__).resolve().parent / "results"



def dump_ids(args: argparse.Namespace) -> None:
    """Save lowbit's calibration windows (the ones `lowbit quantize --data` would draw) as [S, T] int64."""
    import torch

    from lowbit.compress.calibrate import prepare_calibration

    inputs = prepare_calibration(args.model, args.data, args.samples, args.seqlen, args.seed)
    torch.save(inputs.ids.clone(), args.dump_ids)
    print(f"{args.dump_ids}: ids {tuple(inputs.ids.shape)} from '{args.data}' (sha256 {inputs.data_hash}), "
          f"seed {args.seed}", file=sys.stderr)


def recipe(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])


def child(args: argparse.Namespace) -> None:
    """The measured job: load the model, run oneshot GPTQ on the given ids, save compressed."""
    began = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(args.ids)
    if ids.shape != (args.samples, args.seqlen):
        sys.exit(f"{args.ids} holds ids {tuple(ids.shape)}, not --samples {args.samples} x --seqlen {args.seqlen}")
    rows = ids.tolist()
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model_dir = os.path.expanduser(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = time.perf_counter()
    oneshot(model=model, tokenizer=tokenizer, dataset=dataset, recipe=recipe(args.group_size),
            num_calibration_samples=args.samples, max_seq_length=args.seqlen, shuffle_calibration_samples=False)
    oneshot_s = time.perf_counter() - started
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    Path(args.output, "oneshot.json").write_text(json.dumps(
        {"oneshot_s": round(oneshot_s, 1), "child_s": round(time.perf_counter() - began, 1),
         "threads": torch.get_num_threads(), "dtype": str(model.dtype)}))


def measure(args: argparse.Namespace) -> None:
    cmd = [sys.executable, __file__, "--child", "--ids", str(args.ids), "--samples", str(args.samples),
           "--seqlen", str(args.seqlen), "--group-size", str(args.group_size), "--model", args.model,
           "-o", str(args.output)]
    load = os.getloadavg()[0]
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"llm-compressor run failed (exit {os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    import llmcompressor
    import torch
    import transformers

    inner = json.loads(Path(args.output, "oneshot.json").read_text())
    row = {"tool": f"llmcompressor {llmcompressor.__version__}", "torch": torch.__version__,
           "transformers": transformers.__version__, "model": Path(args.model).name, "samples": args.samples,
           "seqlen": args.seqlen, "group_size": args.group_size, "seconds": round(wall, 1), **inner,
           "peak_rss_mb": round(usage.ru_maxrss / 1024), "load_before": round(load, 2),
           "load_after": round(os.getloadavg()[0], 2), "output": str(args.output)}
    print(json.dumps(row))
    if args.json:
        # the file holds one pair: this row, and lowbit's from bench/gptq_cost.py run back to back
        # on the same machine (added by hand, as "lowbit"); a new run replaces both
        report = {"date": time.strftime("%Y-%m-%d"), "llmcompressor": row}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--model", default=MODEL, help="model directory (lowbit name for --dump-ids)")
    ap.add_argument("--dump-ids", type=Path, help="write lowbit's calibration windows here and stop (system python)")
    ap.add_argument("--data", default="wiki-calib", help="calibration text, for --dump-ids")
    ap.add_argument("--seed", type=int, default=0, help="lowbit's sampling seed, for --dump-ids")
    ap.add_argument("--ids", type=Path, help="token windows [samples, seqlen] from --dump-ids")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("-o", "--output", type=Path, help="compressed-tensors checkpoint to write")
    ap.add_argument("--json", type=Path, default=RESULTS / "llmcompressor_cost.json",
                    help="write the measured row here, replacing the file (default bench/results/llmcompressor_cost.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dump_ids:
        if args.model == MODEL:
            args.model = "smollm2-135m"
        return dump_ids(args)
    if not args.ids or not args.output:
        ap.error("--ids and -o are required (make the ids with --dump-ids)")
    if args.child:
        return child(args)
    if args.output.exists():
        ap.error(f"{args.output} exists; pick a new -o")
    measure(args)


if __name__ == "__main__":
    main()
