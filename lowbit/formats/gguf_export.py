"""lowbit checkpoint → one GGUF file llama.cpp runs: weights, hyper-parameters, tokenizer, chat template.

Per projection weight the GGUF type is `--gguf-type` when given, else the type that holds the
source exactly (int4 and int8 with groups of 32, 64, 128 … → Q4_0 and Q8_0, mxfp4 → MXFP4, dense bf16 → BF16), else
Q4_K (Q8_0 for 8-bit sources). Exact writes copy codes and scales; everything else is
requantized from the dequantized weight (llama.cpp's Q4_K reference algorithm, lowbit's RTN for
Q4_0/Q8_0/MXFP4) and only with `allow_requant`. Q4_K needs rows of 256: like llama-quantize,
narrower rows fall back (to Q4_0 here). Norms are F32, embeddings keep their dense dtype.
Llama's q/k rows are permuted into llama.cpp's interleaved rotary order (Qwen's are not).
Architectures: llama (incl. Mistral-style and Mixtral), qwen2, qwen3, gemma3 (text; see
gguf_export_gemma3 for its norms and sliding layers), and the MoE families
qwen2moe (shared expert: ffn_*_shexp, ffn_gate_inp_shexp), qwen3moe and olmoe. Every MoE
family stacks each kind of expert projection into blk.L.ffn_{gate,up,down}_exps [experts, rows,
columns] and calls the router ffn_gate_inp; llama.cpp builds every layer of them as a sparse
block and fixes per architecture whether top-k probabilities are renormalized, so models it
would run differently (a dense layer among sparse ones, the other renormalization, OLMoE with
grouped k/v heads, whose k norm llama.cpp sizes to the hidden width) are refused up front.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from lowbit.errors import LowbitError, UsageError
from lowbit.formats.checkpoint import Checkpoint
from lowbit.formats.gguf_arch import _GLOBAL, ARCHITECTURES, gguf_block_name, llama3_rope_divisors, permute_qk
from lowbit.formats.gguf_blocks import exact_gguf_type, fits_read_as, gguf_spec, to_gguf_bytes
from lowbit.formats.gguf_export_gemma3 import check_llama_cpp_gemma3, write_gemma3_metadata
from lowbit.formats.gguf_export_vocab import write_vocabulary
from lowbit.formats.gguf_q4k import QK_K, dequantize_q4_k, quantize_q4_k
from lowbit.formats.requant import LayerChange, dequantized, refuse_unless_allowed, requantized, source_label
from lowbit.quant.qtensor import QTensor
from lowbit.quant.rtn import tensor_relative_error

GGUF_TYPES = ("bf16", "q8_0", "q4_0", "q4_k", "mxfp4")
_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gemma3_text": "gemma3"}
_MOE_ARCHS = ("qwen2moe", "qwen3moe", "olmoe")
# An expert's projection: llama.cpp stacks each kind over the experts into one 3-D tensor
# blk.L.ffn_{gate,up,down}_exps [experts, rows, columns].
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_FILE_TYPE = {"BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q5_0": 8, "Q4_K": 15, "MXFP4": 38}  # llama_ftype (MOSTLY_*)


def parse_gguf_type(name: str | None) -> str | None:
    if name is None:
        return None
    key = name.lower().replace("-", "_")
    if key not in GGUF_TYPES:
        raise UsageError(f"unknown GGUF type '{name}' (choose {', '.join(GGUF_TYPES)})")
    return key.upper()


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for a Hugging Face tensor (None: not part of a GGUF, e.g. rotary buffers)."""
    parts = hf_name.split(".")
    suffix = parts[-1]
    base = ".".join(parts[:-1])
    if base.startswith("model.layers."):
        layer, gguf_part = parts[2], gguf_block_name(".".join(parts[3:-1]), arch)
        if gguf_part is not None:
            return f"blk.{layer}.{gguf_part}.{suffix}"
    for gguf_part, hf_part in _GLOBAL.items():
        if hf_part == base:
            return f"{gguf_part}.{suffix}"
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise LowbitError(f"tensor {hf_name} has no GGUF counterpart in llama.cpp's llama/qwen layout")


def _choose(value: torch.Tensor | QTensor, forced: str | None) -> tuple[str, str | None]:
    """(GGUF type to write, reason it is not exact or None) for one projection weight."""
    k = value.shape[1]
    exact = exact_gguf_type(value.spec, k, value.scales) if isinstance(value, QTensor) else None
    if forced is None:
        if exact:
            return exact, None
        if not isinstance(value, QTensor):
            forced = "BF16"
        else:
            forced = "Q8_0" if value.spec.bits == 8 else "Q4_K"
    if forced == exact:
        return forced, None
    if forced == "BF16":
        w = dequantized(value)
        if torch.equal(w.bfloat16().float(), w):
            return "BF16", None
        return "BF16", f"{source_label(value)} values are not all representable in bf16"
    target = forced
    if forced == "Q4_K" and k % QK_K:
        target = "Q4_0"
    if forced in ("Q4_0", "Q8_0", "MXFP4") and k % 32:
        raise LowbitError(f"in_features {k} is not a multiple of 32, which every GGUF block type here needs")
    reason = f"{source_label(value)} is not {forced}" + (f" (rows of {k} are not a multiple of 256: written as Q4_0, as llama-quantize falls back)" if target != forced else "")
    return target, reason


def _encode(module: str, value: torch.Tensor | QTensor, gtype: str, exact: bool) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 rows of GGUF blocks, the float32 weights they decode to)."""
    if gtype == "BF16":
        w = dequantized(value).bfloat16()
        return w.view(torch.uint8).numpy(), w.float()
    if gtype == "Q4_K":
        raw = quantize_q4_k(dequantized(value))
        return raw, dequantize_q4_k(raw, tuple(value.shape))
    qt = value if exact else requantized(module, dequantized(value), gguf_spec(gtype))
    return to_gguf_bytes(qt, gtype), qt.dequantize()


def write_gguf(
    ckpt: Checkpoint,
    out_path: Path,
    gguf_type: str | None = None,
    allow_requant: bool = False,
    progress=None,
) -> tuple[list[LayerChange], list[str]]:
    """Write `ckpt` as a GGUF file at `out_path` (a temporary path: the caller renames it)."""
    import gguf  # late: the gguf package is slow to import and only --to gguf needs it

    config = ckpt.config
    model_type = config.get("model_type")
    arch = _ARCH.get(model_type)
    if arch is None:
        raise LowbitError(f"GGUF export supports {', '.join(_ARCH)} models, not '{model_type}'")
    forced = parse_gguf_type(gguf_type)
    tensors = ckpt.tensors()
    if arch in _MOE_ARCHS:
        _check_llama_cpp_moe(arch, config, tensors)
    if arch == "gemma3":
        check_llama_cpp_gemma3(config)
    projections = set(ckpt.linear_weights())
    plan: dict[str, tuple[str, str | None]] = {}
    problems = []
    for module in sorted(projections):
        value = tensors[f"{module}.weight"]
        gtype, reason = _choose(value, forced)
        if forced is None and reason is None and fits_read_as(value, ckpt.stored_as.get(module)):
            gtype = ckpt.stored_as[module]  # read from Q5_0 as int8 codes: written back as Q5_0
        if module in ckpt.unexpressed:
            reason = reason or ckpt.unexpressed[module][1]
        plan[module] = (gtype, reason)
        if reason:
            problems.append((module, reason))
    refuse_unless_allowed(f"GGUF {forced or 'blocks'}", problems, allow_requant)

    writer = gguf.GGUFWriter(str(out_path), arch)
    notes = _write_metadata(writer, ckpt, arch, plan)
    heads, kv_heads = int(config["num_attention_heads"]), int(config.get("num_key_value_heads", config["num_attention_heads"]))
    tied = _tied(ckpt)
    changes: list[LayerChange] = []
    names = [n for n in tensors if not (tied and n == "lm_head.weight")]
    if tied and arch in ("qwen2moe", "olmoe"):
        # llama.cpp's qwen2moe and olmoe require an output matrix: a tied head is written out
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
        names.append("lm_head.weight")
    norm_offset = ARCHITECTURES[arch].norm_offset  # Gemma's 1 + w norms, as gguf_import subtracts it
    experts: dict[tuple[int, str], dict[int, str]] = {}  # (layer, kind) -> expert -> tensor name
    for done, hf_name in enumerate(sorted(names, key=_order), start=1):
        match = _EXPERT.match(hf_name)
        if match:
            experts.setdefault((int(match[1]), match[3]), {})[int(match[2])] = hf_name
            continue
        target = gguf_name(hf_name, arch)
        if target is None:
            continue
        value = tensors[hf_name]
        if norm_offset and hf_name.endswith("norm.weight"):
            value = value.float() + norm_offset
        module = hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None
        n_rows = heads if ".q_proj." in hf_name else kv_heads
        permute = arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name)
        if module in plan:
            gtype, reason = plan[module]
            raw, decoded = _encode(module, value, gtype, reason is None)
            if reason:
                changes.append(LayerChange(module, source_label(value), gtype, reason, tensor_relative_error(dequantized(value), decoded)))
            if permute:
                order = permute_qk(torch.arange(value.shape[0]), n_rows)
                raw = raw[order.numpy()]
            writer.add_tensor(target, np.ascontiguousarray(raw), raw_dtype=getattr(gguf.GGMLQuantizationType, gtype))
        else:
            dense = dequantized(value) if isinstance(value, QTensor) else value
            if permute:
                dense = permute_qk(dense, n_rows)
            _add_dense(writer, target, dense, gguf)
        if progress is not None:
            progress(done, len(names), hf_name)
    for (layer, kind), by_expert in sorted(experts.items()):
        changes += _add_experts(writer, layer, kind, by_expert, tensors, plan, gguf)
    rope = _rope_freqs(config)
    if rope is not None:
        writer.add_tensor("rope_freqs.weight", rope.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changes, notes


def _add_experts(writer, layer: int, kind: str, by_expert: dict[int, str], tensors, plan, gguf) -> list[LayerChange]:
    """One stacked blk.L.ffn_KIND_exps tensor from the experts' projections: each expert's rows of
    blocks, encoded as a 2-D weight is, one after the other (llama.cpp's [experts, rows, blocks])."""
    changes, rows, types = [], [], set()
    for e in range(len(by_expert)):
        if e not in by_expert:
            raise LowbitError(f"layer {layer} has no {kind}_proj for expert {e}: cannot stack the experts for GGUF")
        hf_name = by_expert[e]
        value, module = tensors[hf_name], hf_name[: -len(".weight")]
        gtype, reason = plan[module]
        raw, decoded = _encode(module, value, gtype, reason is None)
        if reason:
            changes.append(LayerChange(module, source_label(value), gtype, reason, tensor_relative_error(dequantized(value), decoded)))
        rows.append(raw)
        types.add(gtype)
    if len(types) != 1:
        raise LowbitError(f"layer {layer}'s {kind}_proj experts would be written as {sorted(types)}: GGUF stacks one type")
    writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", np.ascontiguousarray(np.stack(rows)),
                      raw_dtype=getattr(gguf.GGMLQuantizationType, types.pop()))
    return changes


def _check_llama_cpp_moe(arch: str, config: dict, tensors: dict) -> None:
    """Refuse what llama.cpp's qwen2moe / qwen3moe / olmoe graphs would compute differently."""
    dense = sorted({int(m[1]) for m in map(_DENSE_MLP.match, tensors) if m})
    if dense:
        raise LowbitError(f"layer {dense[0]} has a dense MLP (decoder_sparse_step / mlp_only_layers): "
                          f"llama.cpp's {arch} builds every layer as a sparse block, so it cannot be exported")
    norm, llama_cpp_norm = bool(config.get("norm_topk_prob", False)), arch == "qwen3moe"
    if norm != llama_cpp_norm:
        raise LowbitError(f"norm_topk_prob {str(norm).lower()}: llama.cpp's {arch} {'always' if llama_cpp_norm else 'never'} "
                          "renormalizes the top-k probabilities, so it would run this model differently")
    heads = int(config["num_attention_heads"])
    if arch == "olmoe" and int(config.get("num_key_value_heads", heads)) != heads:
        raise LowbitError("olmoe with num_key_value_heads != num_attention_heads: llama.cpp sizes OLMoE's k norm "
                          "to the hidden width, so it cannot load this model")


def _order(name: str):
    # token_embd first, blocks by index, then the output norm and head: the order llama.cpp writes
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    return (2, 0, name)


def _add_dense(writer, name: str, tensor: torch.Tensor, gguf) -> None:
    if tensor.dim() == 1 or name.endswith("norm.weight") or tensor.dtype == torch.float32:
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    elif tensor.dtype == torch.float16:
        writer.add_tensor(name, tensor.contiguous().numpy())
    else:
        raw = tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)


def _tied(ckpt: Checkpoint) -> bool:
    if "lm_head.weight" not in ckpt.dense and "lm_head" not in ckpt.qtensors:
        return True
    return bool(ckpt.config.get("tie_word_embeddings", False))


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(config: dict) -> dict | None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    return None if kind in (None, "default") else scaling


def _rope_freqs(config: dict) -> torch.Tensor | None:
    scaling = _rope_scaling(config)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return None
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return llama3_rope_divisors(
        _rope_theta(config), head_dim, float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)), int(scaling.get("original_max_position_embeddings", 8192)),
    ).float()


def _write_metadata(writer, ckpt: Checkpoint, arch: str, plan: dict) -> list[str]:
    config = ckpt.config
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    default_name = ckpt.source_dir.name if ckpt.source_dir is not None else "lowbit export"
    if ckpt.gguf is not None and ckpt.gguf.has("general.name"):  # a GGUF re-exported keeps its name
        default_name = str(ckpt.gguf.get("general.name"))
    writer.add_name(str(config.get("_name_or_path") or default_name))
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:  # Mixtral (llama.cpp's llama architecture with experts) and the MoE architectures
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if arch in ("qwen2moe", "qwen3moe"):  # olmoe's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads", heads)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_freq_base(_rope_theta(config))
    if head_dim != int(config["hidden_size"]) // heads or arch in ("qwen3", "qwen3moe", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        write_gemma3_metadata(writer, config)
    scaling = _rope_scaling(config)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "linear":
        import gguf  # late: the gguf package is slow to import and only --to gguf needs it

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif scaling and (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        raise LowbitError(f"rope scaling {scaling.get('rope_type') or scaling.get('type')} cannot be exported to GGUF by lowbit")
    types = Counter(t for t, _ in plan.values())
    if types:
        writer.add_file_type(_FILE_TYPE[types.most_common(1)[0][0]])
    writer.add_quantization_version(2)
    vocab_size = int(config["vocab_size"])
    writer.add_vocab_size(vocab_size)
    if ckpt.gguf is not None:
        return _copy_gguf_tokenizer(writer, ckpt.gguf)
    return write_vocabulary(writer, ckpt, vocab_size)


def _copy_gguf_tokenizer(writer, source) -> list[str]:
    import gguf  # late: the gguf package is slow to import and only --to gguf needs it

    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = gguf.GGUFValueType(field.types[-1]) if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), gguf.GGUFValueType(field.types[0]), sub_type=sub)
    return []
