"""Helpers of bench/gpu_check.sh: the tiny model of its --dry-run, and its JSON outputs as markdown.

    python bench/gpu_check.py tiny-model DIR          # a tiny random Llama + byte tokenizer + DIR/text.txt
    python bench/gpu_check.py pack DIR                # the demo model's config and tokenizer + wiki-eval, for a
                                                      # machine that cannot fetch or build the demo assets
    python bench/gpu_check.py shape-model PACK DIR    # random weights in the packed model's shape, with its tokenizer
    python bench/gpu_check.py setup                   # versions and the device, as markdown lines
    python bench/gpu_check.py pytest LOG [LOG ...]    # pytest's counts, summed over the logs
    python bench/gpu_check.py eval CPU_JSON [--gpu GPU_JSON | --skip REASON]
    python bench/gpu_check.py bench LABEL=JSON [LABEL=JSON ...]

Each report command prints markdown on stdout and exits non-zero when its input holds no result.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TINY_TEXT = ("The quick brown fox jumps over the lazy dog. " * 4 + "Numbers like 1234 and 5678 appear too.\n") * 40


def tiny_model(directory: Path) -> None:
    """A 2-layer random Llama with a byte-level tokenizer (ids 0-255 the bytes, 256 <s>, 257 </s>)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=258, max_position_embeddings=1024,
                         bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.1 * torch.randn(p.shape))
    model.to(torch.bfloat16).save_pretrained(directory)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    (directory / "text.txt").write_text(TINY_TEXT)


PACKED_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def pack(directory: Path) -> None:
    """What a device machine with no package index needs of the demo assets, in a few MB: the
    weights (269 MB) do not fit the 64 MiB a device call carries, so the check there runs random
    weights of the same shape (shape_model), with the real tokenizer and text."""
    import shutil

    from lowbit.paths import data_asset_path, model_asset_path

    source = model_asset_path("smollm2-135m")
    if not (source / "config.json").exists():
        raise SystemExit(f"gpu_check: {source} is missing: run `lowbit assets --only smollm2-135m,wiki` first")
    directory.mkdir(parents=True, exist_ok=True)
    for name in PACKED_MODEL_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, directory / name)
    shutil.copy2(data_asset_path("wiki-eval"), directory / "wiki-eval.txt")


def shape_model(pack_dir: Path, directory: Path) -> None:
    """The packed config with random weights (transformers' own init, seed 0), saved as bf16 beside
    the packed tokenizer: the real model's shapes and bytes per token, not its perplexity."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(pack_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(directory)
    for name in PACKED_MODEL_FILES:
        if (pack_dir / name).exists():
            shutil.copy2(pack_dir / name, directory / name)


def setup() -> int:
    import platform

    import torch

    lines = [f"- python {platform.python_version()}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"]
    try:
        import triton

        lines.append(f"- triton {triton.__version__}")
    except ImportError:
        lines.append("- triton: not installed")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        lines.append("- device: CPU only")
    print("\n".join(lines))
    return 0


def pytest_summary(logs: list[Path]) -> int:
    """One line: passed / failed / skipped / errors summed over pytest logs (one per shard)."""
    totals: dict[str, int] = {}
    missing = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", text, re.M)
        if not found:
            missing.append(log.name)
            continue
        for count, word in re.findall(r"(\d+) (\w+)", found[-1][0]):
            word = {"error": "errors", "warning": "warnings"}.get(word, word)
            totals[word] = totals.get(word, 0) + int(count)
    parts = ", ".join(f"{n} {w}" for w, n in sorted(totals.items()))
    print(f"pytest over {len(logs)} process(es): {parts or 'nothing ran'}"
          + (f"; no summary line in {', '.join(missing)}" if missing else ""))
    return 0 if totals.get("passed") and not missing and not totals.get("failed") and not totals.get("errors") else 1


def _load(path: str | None) -> dict | None:
    if not path or not Path(path).exists():
        return None
    text = Path(path).read_text()
    start = text.find("{")  # stdout may carry a line before the JSON object
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def eval_report(cpu_json: str, gpu_json: str | None, skip: str | None) -> int:
    cpu, gpu = _load(cpu_json), _load(gpu_json)
    if cpu is None:
        print("no CPU result")
        return 1
    lines = [f"`lowbit eval {cpu['model']}` on {cpu['data']}: ctx {cpu['ctx']}, {cpu['chunks']} chunks, "
             f"{cpu['tokens_scored']} tokens scored, {cpu['dtype']}", "",
             "| device | PPL | ± | eval s | tokens/s |", "| --- | --- | --- | --- | --- |"]
    for name, r in (("cpu", cpu), ("cuda", gpu)):
        if r is not None:
            name = r.get("device", name)
            t = r.get("timings", {})
            lines.append(f"| {name} | {r['ppl']:.4f} | {r['ppl_err']:.4f} | {t.get('eval_s', 0):.1f} | {t.get('tokens_per_s', 0):.0f} |")
    if gpu is not None:
        rel = abs(gpu["ppl"] - cpu["ppl"]) / cpu["ppl"]
        lines += ["", f"second run's PPL against the CPU's: {rel:.2e} relative difference"]
    elif skip:
        lines += ["", f"GPU eval skipped: {skip}"]
    else:
        print("\n".join(lines + ["", "no GPU result"]))
        return 1
    print("\n".join(lines))
    return 0


def bench_report(pairs: list[str]) -> int:
    lines = ["| model | device | dtype | batch | decode tok/s | inter-token ms | TTFT s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    ok = True
    extra = []
    for pair in pairs:
        label, _, path = pair.partition("=")
        r = _load(path)
        if r is None or not r.get("decode"):
            lines.append(f"| {label} | – | – | – | no result | – | – |")
            ok = False
            continue
        for d in r["decode"]:
            lines.append(f"| {label} | {r['device']} | {r['dtype']} | {d['batch']} | {d['decode_tok_s']:.1f} | "
                         f"{d['inter_token_latency_ms']:.2f} | {d['ttft_s']:.3f} |")
        one = r["decode"][0]
        extra.append(f"{label}: prefill {r['prefill_tok_s']:.0f} tok/s; batch {r['decode'][-1]['batch']} over batch "
                     f"{one['batch']}: {r['decode'][-1]['decode_tok_s'] / one['decode_tok_s']:.2f}×; weights at batch 1 "
                     f"{r['weight_bandwidth_gbs']:.1f} GB/s of {r['stream_bandwidth_gbs']:.1f} GB/s measured streaming")
    print("\n".join(lines + [""] + [f"- {e}" for e in extra]))
    return 0 if ok else 1


def distill_report(path: str) -> int:
    """`lowbit distill --json` of the int4 student on the GPU: held-out KLD before and after, time."""
    r = _load(path)
    if r is None or "heldout_kld_after" not in r:
        print("no distill result")
        return 1
    print("| device | bf16 | block steps | steps | held-out KLD before | after | seconds |\n"
          "| --- | --- | --- | --- | --- | --- | --- |\n"
          f"| {r.get('device')} | {r.get('bf16')} | {r['block_steps']} | {r['steps']} | {r['heldout_kld_before']:.4f} | "
          f"{r['heldout_kld_after']:.4f} | {r['seconds']:.1f} |")
    return 0 if r["heldout_kld_after"] < r["heldout_kld_before"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tiny-model").add_argument("dir", type=Path)
    sub.add_parser("pack").add_argument("dir", type=Path)
    shape = sub.add_parser("shape-model")
    shape.add_argument("pack", type=Path)
    shape.add_argument("dir", type=Path)
    sub.add_parser("setup")
    sub.add_parser("pytest").add_argument("logs", type=Path, nargs="+")
    ev = sub.add_parser("eval")
    ev.add_argument("cpu_json")
    ev.add_argument("--gpu")
    ev.add_argument("--skip")
    sub.add_parser("bench").add_argument("pairs", nargs="+")
    sub.add_parser("distill").add_argument("json")
    args = ap.parse_args(argv)
    if args.cmd == "tiny-model":
        tiny_model(args.dir)
        return 0
    if args.cmd == "pack":
        pack(args.dir)
        return 0
    if args.cmd == "shape-model":
        shape_model(args.pack, args.dir)
        return 0
    if args.cmd == "setup":
        return setup()
    if args.cmd == "pytest":
        return pytest_summary(args.logs)
    if args.cmd == "eval":
        return eval_report(args.cpu_json, args.gpu, args.skip)
    if args.cmd == "distill":
        return distill_report(args.json)
    return bench_report(args.pairs)


if __name__ == "__main__":
    sys.exit(main())
