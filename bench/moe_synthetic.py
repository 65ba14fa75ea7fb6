"""A bandwidth-sized synthetic mixture-of-experts checkpoint for speed benchmarks (issue #26).

    python bench/moe_synthetic.py -o DIR [--hidden 1024] [--layers 16] [--experts 8] [--top-k 2]
        [--intermediate 2816] [--heads 16] [--kv-heads 4] [--seed 0]

Mixtral-shaped (per-expert SwiGLU MLPs, softmax top-k router, GQA attention), random weights ~N(0,
0.02) written as bf16 safetensors in transformers' Mixtral layout, with the demo model's tokenizer
(SmolLM2's 49152-token vocabulary) so every lowbit command and llama.cpp's GGUF tools take it. The
defaults give ~1.2 B parameters, a quarter of them active per token (2 of 8 experts): large enough
that a decode step streams its active weights from memory, not from cache. Quality is meaningless
(random weights); only speed is measured on it:

    python bench/moe_synthetic.py -o /tmp/moe-1b
    python bench/vs_llamacpp.py --model /tmp/moe-1b --cases int4 --pairs 2
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def config(args, vocab: int, bos: int, eos: int) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.hidden // args.heads, "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.0, "sliding_window": None,
    }


def tensors(args, vocab: int, gen: torch.Generator):
    """(name, bf16 tensor) in Mixtral's hub layout, one at a time (never the whole model in memory twice)."""
    h, i, d = args.hidden, args.intermediate, args.hidden // args.heads

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    yield "model.embed_tokens.weight", rand(vocab, h)
    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "self_attn.q_proj.weight", rand(args.heads * d, h)
        yield p + "self_attn.k_proj.weight", rand(args.kv_heads * d, h)
        yield p + "self_attn.v_proj.weight", rand(args.kv_heads * d, h)
        yield p + "self_attn.o_proj.weight", rand(h, args.heads * d)
        yield p + "block_sparse_moe.gate.weight", rand(args.experts, h)
        for e in range(args.experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            yield q + "w1.weight", rand(i, h)
            yield q + "w3.weight", rand(i, h)
            yield q + "w2.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)
    yield "lm_head.weight", rand(vocab, h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from lowbit.formats.resolve import resolve_model

    source = Path(resolve_model("smollm2-135m"))  # the tokenizer's home (lowbit assets)
    demo = json.loads((source / "config.json").read_text())
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(args.seed)
    # shards of ~1 GB, as save_pretrained would, with an index
    shard, shards, index, size = {}, [], {}, 0
    for name, t in tensors(args, demo["vocab_size"], gen):
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= 1 << 30:
            shards.append(shard)
            shard, size = {}, 0
    if shard:
        shards.append(shard)
    total = 0
    for n, part in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(tmp / file), metadata={"format": "pt"})
        for name, t in part.items():
            index[name] = file
            total += t.numel()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}))
    cfg = config(args, demo["vocab_size"], demo.get("bos_token_id", 1), demo.get("eos_token_id", 2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in _SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    experts = args.layers * args.experts * 3 * args.hidden * args.intermediate
    active = total - experts * (1 - args.top_k / args.experts) - demo["vocab_size"] * args.hidden  # embedding: rows only
    print(f"wrote {args.out}: {total / 1e9:.2f} B parameters, {active / 1e9:.2f} B read per token "
          f"({args.top_k} of {args.experts} experts, the head included)")


if __name__ == "__main__":
    main()
