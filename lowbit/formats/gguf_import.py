"""GGUF → Hugging Face directory: config.json, generation_config.json, safetensors, tokenizer.

Weights are dequantized one tensor at a time by lowbit's reader, renamed and un-permuted
here, cast to the requested dtype and written in shards of at most 2 GB. A mixture-of-experts
file's stacked expert tensors (blk.L.ffn_{gate,up,down}_exps [experts, rows, columns]) are split
into transformers' per-expert weights (model.layers.L.mlp.experts.E.{gate,up,down}_proj), their
shapes checked against the expert count and widths first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lowbit.errors import LowbitError
from lowbit.formats.dense_cast import RoundingTally, cast_dense
from lowbit.quant.dtypes import parse_dtype
from lowbit.formats.atomic import atomic_dir, check_output_path
from lowbit.formats.gguf_arch import ArchSpec, arch_spec, expert_names, hf_tensor_name, is_stacked, model_identity, unpermute_qk
from lowbit.formats.gguf_reader import GGUFFile, open_gguf
from lowbit.formats.gguf_tokenizer import end_of_generation_ids, write_tokenizer_files

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

SHARD_BYTES = 2 * 1024**3

# progress(done, total, tensor_name) after each tensor is written
ProgressFn = Callable[[int, int, str], None]


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    tally: RoundingTally | None = None,
) -> Path:
    """Convert a GGUF file into a Hugging Face-style checkpoint directory and return its path;
    `tally` counts the tensors that `dtype` rounds (a Q4_0 block's values in bf16)."""
    torch_dtype = parse_dtype(dtype)
    out_dir = Path(out_dir)
    check_output_path(out_dir, overwrite)  # fail before spending minutes on the weights
    gguf = open_gguf(gguf_path)
    spec = arch_spec(gguf)
    config = spec.build_config(gguf)
    tied = _embeddings_tied(gguf)
    config["tie_word_embeddings"] = tied
    names = _plan_tensors(gguf, spec, tied, config)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        _write_weights(gguf, spec, config, names, torch_dtype, tmp, progress, tally)
        _write_config(model_identity(spec, gguf), config, torch_dtype, tmp)
        write_tokenizer_files(gguf, tmp)
        _write_generation_config(gguf, config, tmp)
    return out_dir


def _embeddings_tied(gguf: GGUFFile) -> bool:
    """Tied when the GGUF has no separate output matrix, or stores the embedding twice."""
    if not gguf.has_tensor("output.weight"):
        return True
    out, emb = gguf.info("output.weight"), gguf.info("token_embd.weight")
    if out.type_name != emb.type_name or out.shape != emb.shape:
        return False
    return gguf.raw_bytes("output.weight") == gguf.raw_bytes("token_embd.weight")


def _plan_tensors(gguf: GGUFFile, spec: ArchSpec, tied: bool, config: dict[str, Any]) -> list[tuple[str, str]]:
    """(gguf name, HF name) for every tensor to write, checked up front so a bad file fails fast:
    every tensor's shape against the config the metadata gives, and the layer count."""
    plan = []
    for name in gguf.tensor_names():
        hf_name = hf_tensor_name(spec, name)
        if hf_name is None or (tied and name == "output.weight"):
            continue
        plan.append((name, hf_name))
    if not any(hf == "model.embed_tokens.weight" for _, hf in plan):
        raise LowbitError(f"{gguf.path.name} has no token_embd.weight tensor")
    _check_shapes(gguf, config, plan, spec.qk_norm_full)
    return plan


def expert_count(config: dict[str, Any]) -> int:
    """The number of experts of an imported MoE config (0 for a dense model)."""
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def _expected_shapes(config: dict[str, Any], qk_norm_full: bool = False) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(shapes of the model-wide tensors, shapes of each layer's tensors by suffix) that config implies."""
    h, v, ff, d = config["hidden_size"], config["vocab_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    experts, expert_ff = expert_count(config), int(config.get("moe_intermediate_size") or ff)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    q_norm, k_norm = ((q,), (kv,)) if qk_norm_full else ((d,), (d,))
    model = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": q_norm, "self_attn.k_norm.weight": k_norm,
        "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
        "mlp.gate_proj.bias": (ff,), "mlp.up_proj.bias": (ff,), "mlp.down_proj.bias": (h,),
    }
    if experts:
        layer.update({
            "mlp.gate.weight": (experts, h),
            "mlp.experts.gate_proj.weight": (experts, expert_ff, h), "mlp.experts.up_proj.weight": (experts, expert_ff, h),
            "mlp.experts.down_proj.weight": (experts, h, expert_ff),
            "mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight": (shared, h),
            "mlp.shared_expert.down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h),
        })
    return model, layer


def _check_shapes(gguf: GGUFFile, config: dict[str, Any], plan: list[tuple[str, str]], qk_norm_full: bool) -> None:
    model, layer = _expected_shapes(config, qk_norm_full)
    layers = config["num_hidden_layers"]
    seen = set()
    for name, hf_name in plan:
        if hf_name.startswith("model.layers."):
            index, _, suffix = hf_name[len("model.layers."):].partition(".")
            if int(index) >= layers:
                raise LowbitError(f"{gguf.path.name}: tensor {name} belongs to layer {index}, but block_count is {layers}")
            seen.add(int(index))
            expected = layer.get(suffix)
        else:
            expected = model.get(hf_name)
        shape = tuple(gguf.info(name).shape)
        if expected == (1, shape[0]) and len(shape) == 1:
            shape = expected  # the shared expert's gate: [hidden] or [1, hidden], llama.cpp takes either
        if expected is not None and shape != expected:
            raise LowbitError(f"{gguf.path.name}: tensor {name} has shape {list(shape)}, the metadata implies {list(expected)}")
    if len(seen) != layers:
        raise LowbitError(f"{gguf.path.name}: block_count is {layers}, but tensors exist for {len(seen)} layer(s)")


def hf_tensors(gguf: GGUFFile, spec: ArchSpec, config: dict[str, Any], name: str, hf_name: str) -> list[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) pairs one GGUF tensor becomes: one, or one per expert of a stacked tensor."""
    if is_stacked(hf_name):
        stacked = gguf.tensor(name)
        return list(zip(expert_names(hf_name, stacked.shape[0]), stacked.unbind(0)))
    weight = _hf_tensor(gguf, spec, config, name)
    if hf_name.endswith("shared_expert_gate.weight") and weight.dim() == 1:
        weight = weight[None]
    return [(hf_name, weight)]


def _hf_tensor(gguf: GGUFFile, spec: ArchSpec, config: dict[str, Any], name: str) -> torch.Tensor:
    weight = gguf.tensor(name)
    part = name.split(".")[-2] if name.startswith("blk.") else ""
    if spec.permute_qk and part == "attn_q":
        weight = unpermute_qk(weight, config["num_attention_heads"])
    elif spec.permute_qk and part == "attn_k":
        weight = unpermute_qk(weight, config["num_key_value_heads"])
    if spec.norm_offset and name.endswith("norm.weight"):
        weight = weight - spec.norm_offset
    return weight


def _write_weights(
    gguf: GGUFFile,
    spec: ArchSpec,
    config: dict[str, Any],
    plan: list[tuple[str, str]],
    dtype: torch.dtype,
    out: Path,
    progress: ProgressFn | None,
    tally: RoundingTally | None,
) -> None:
    # Shards are written as they fill (memory stays at one shard) and named once their count is known.
    written: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total_bytes = 0

    def flush() -> None:
        path = out / f"shard-{len(written) + 1}.partial"
        save_file(current, str(path), metadata={"format": "pt"})
        written.append((path, list(current)))

    for done, (name, plan_name) in enumerate(plan, start=1):
        for hf_name, tensor in hf_tensors(gguf, spec, config, name, plan_name):
            tensor = cast_dense(hf_name, tensor, dtype, tally).contiguous()
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > SHARD_BYTES:
                flush()
                current, current_bytes = {}, 0
            current[hf_name] = tensor
            current_bytes += size
            total_bytes += size
        if progress is not None:
            progress(done, len(plan), name)
    flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, (path, keys) in enumerate(written, start=1):
        filename = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / filename)
        weight_map.update({key: filename for key in keys})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_config(identity: tuple[str, str], config: dict[str, Any], dtype: torch.dtype, out: Path) -> None:
    model_type, hf_class = identity
    full = {"architectures": [hf_class], "model_type": model_type, **config}
    full["torch_dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")


def _write_generation_config(gguf: GGUFFile, config: dict[str, Any], out: Path) -> None:
    generation: dict[str, Any] = {}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    eos = end_of_generation_ids(gguf)
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token_id" in config:
        generation["pad_token_id"] = config["pad_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
