"""What each supported GGUF architecture means in Hugging Face terms: tensor names and config.json.

llama.cpp renames tensors (`blk.3.attn_q.weight`) and keeps hyper-parameters under
`<arch>.<key>`; this module maps both back to the names and config keys transformers uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lowbit.errors import LowbitError
from lowbit.formats.gguf_reader import GGUFFile, printable

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Mixture-of-experts blocks (llama.cpp's llama arch with experts = Mixtral, qwen2moe, qwen3moe, olmoe):
# the router, Qwen2-MoE's shared expert and its sigmoid gate. The experts' projections are stacked
# per kind into one 3-D tensor [experts, rows, columns]; STACKED names them, and
# `expert_names` gives the per-expert HF names a stacked tensor splits into.
_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
STACKED = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_STACKED_HF = {f"mlp.experts.{kind}": gguf_part for gguf_part, kind in STACKED.items()}

# Gemma-3 has four norms per block; llama.cpp's `ffn_norm` is the one *before* the MLP.
_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tensors llama.cpp derives from the config; they carry no weights of their own.
_DERIVED = {"rope_freqs.weight"}


@dataclass(slots=True)
class ArchSpec:
    gguf_name: str
    model_type: str
    hf_class: str
    block_map: dict[str, str]
    build_config: Callable[[GGUFFile], dict[str, Any]]
    # llama.cpp interleaves q/k rows for its rotary kernel only in its Llama converter.
    permute_qk: bool = False
    # Gemma stores norm weights as (1 + w) because its RMSNorm multiplies by (1 + w).
    norm_offset: float = 0.0
    # Reads llama.cpp's mixture-of-experts tensors (router, stacked experts, shared expert).
    moe: bool = False
    # (model_type, HF class) when the file has experts but the architecture name is a dense
    # family's (llama.cpp's "llama" with expert_count is Mixtral).
    moe_identity: tuple[str, str] | None = None
    # OLMoE's q/k norms span the whole projection, not one head
    qk_norm_full: bool = False


def hf_tensor_name(spec: ArchSpec, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors derived from the config.

    A stacked expert tensor (`blk.L.ffn_gate_exps.weight`) gets the name of its kind without an
    expert index (`model.layers.L.mlp.experts.gate_proj.weight`): `expert_names` splits it."""
    if gguf_name in _DERIVED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in spec.block_map:
            return f"model.layers.{parts[1]}.{spec.block_map[parts[2]]}.{suffix}"
        if spec.moe and parts[2] in _MOE_BLOCK:
            return f"model.layers.{parts[1]}.{_MOE_BLOCK[parts[2]]}.{suffix}"
        if spec.moe and parts[2] in STACKED and suffix == "weight":
            return f"model.layers.{parts[1]}.mlp.experts.{STACKED[parts[2]]}.weight"
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    raise LowbitError(f"GGUF tensor {printable(gguf_name)} has no known counterpart in a {spec.gguf_name} checkpoint")


def is_stacked(hf_name: str) -> bool:
    """Whether `hf_tensor_name` gave this name to a stacked expert tensor."""
    return hf_name.startswith("model.layers.") and hf_name.split(".", 3)[3].removesuffix(".weight") in _STACKED_HF


def expert_names(hf_name: str, experts: int) -> list[str]:
    """The per-expert HF names of a stacked tensor's name (`...mlp.experts.gate_proj.weight` →
    `...mlp.experts.0.gate_proj.weight`, ...), in the order of the stacked tensor's first axis."""
    head, _, kind = hf_name.removesuffix(".weight").rpartition(".")
    return [f"{head}.{e}.{kind}.weight" for e in range(experts)]


def llama_cpp_swa_layers(pattern: int, n_layers: int) -> list[bool]:
    """Which layers slide under llama.cpp's `sliding_window_pattern` number: every `pattern`-th
    layer (the last of each group) attends globally; 0 means all slide."""
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]


def gguf_block_name(hf_part: str, arch: str = "llama") -> str | None:
    """llama.cpp's block tensor name for a layer's HF module in architecture `arch`
    (`self_attn.q_proj` → `attn_q`, `mlp.gate` → `ffn_gate_inp`), None when there is none."""
    spec = ARCHITECTURES.get(arch)
    for table in ((spec.block_map if spec else _LLAMA_BLOCK), _MOE_BLOCK):
        for gguf_part, hf in table.items():
            if hf == hf_part:
                return gguf_part
    return None


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k weights (and biases) for one projection.

    llama.cpp reorders each head's rows from [first half | second half] to interleaved
    pairs so its rotary kernel can rotate adjacent elements; HF rotates halves.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def permute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation (the inverse of `unpermute_qk`), used to check the round trip."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(weight.shape)


def _require(gguf: GGUFFile, suffix: str) -> Any:
    value = gguf.arch_get(suffix)
    if value is None:
        raise LowbitError(f"{gguf.path.name} lacks the metadata key {gguf.architecture}.{suffix}")
    return value


# Far above any released model; a damaged count must not make a config of billions of layers.
_MAX_COUNT = {"block_count": 1 << 12, "attention.head_count": 1 << 12, "attention.head_count_kv": 1 << 12}


def _int_key(gguf: GGUFFile, key: str, value: Any, low: int = 1, high: int = 1 << 31) -> int:
    """A metadata value that must be an integer in [low, high] (a key whose type byte was damaged
    reads as a string, float or list: named, not a ValueError later)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LowbitError(f"{gguf.path.name}: metadata {key} must be an integer, got {str(value)[:40]!r}")
    value = int(value)
    if not low <= value <= high:
        raise LowbitError(f"{gguf.path.name}: metadata {key} {value} is out of range ({low} to {high})")
    return value


def _arch_int(gguf: GGUFFile, suffix: str, default: Any = None, low: int = 1) -> int:
    value = _require(gguf, suffix) if default is None else gguf.arch_get(suffix, default)
    return _int_key(gguf, f"{gguf.architecture}.{suffix}", value, low, _MAX_COUNT.get(suffix, 1 << 31))


def _arch_float(gguf: GGUFFile, suffix: str, default: float) -> float:
    value = gguf.arch_get(suffix, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value <= 0:
        raise LowbitError(f"{gguf.path.name}: metadata {gguf.architecture}.{suffix} must be a positive number, got {str(value)[:40]!r}")
    return float(value)


def _vocab_size(gguf: GGUFFile) -> int:
    value = gguf.arch_get("vocab_size")
    if value is not None:
        return _int_key(gguf, f"{gguf.architecture}.vocab_size", value)
    if not gguf.has_tensor("token_embd.weight"):
        raise LowbitError(f"{gguf.path.name} has no token_embd.weight tensor")
    return int(gguf.info("token_embd.weight").shape[0])


def _common_config(gguf: GGUFFile) -> dict[str, Any]:
    hidden = _arch_int(gguf, "embedding_length")
    heads = _arch_int(gguf, "attention.head_count")
    kv_heads = _arch_int(gguf, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise LowbitError(f"{gguf.path.name}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if not gguf.has(f"{gguf.architecture}.attention.key_length") and hidden % heads:
        raise LowbitError(f"{gguf.path.name}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = _arch_int(gguf, "attention.key_length", hidden // heads)
    if head_dim % 2:
        raise LowbitError(f"{gguf.path.name}: head dimension {head_dim} is odd; rotary embeddings rotate pairs of channels")
    config: dict[str, Any] = {
        "vocab_size": _vocab_size(gguf),
        "hidden_size": hidden,
        "intermediate_size": _arch_int(gguf, "feed_forward_length"),
        "num_hidden_layers": _arch_int(gguf, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _arch_int(gguf, "context_length", 2048),
        "rms_norm_eps": _arch_float(gguf, "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _arch_float(gguf, "rope.freq_base", 10000.0),
        "tie_word_embeddings": True,  # settled by the importer once it has looked at output.weight
    }
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf.has(gguf_key):
            config[key] = _int_key(gguf, gguf_key, gguf.get(gguf_key), low=0)
    rope_scaling = _rope_scaling(gguf, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(gguf: GGUFFile, head_dim: int) -> dict[str, Any] | None:
    kind = gguf.arch_get("rope.scaling.type")
    factor = gguf.arch_get("rope.scaling.factor")
    if gguf.has_tensor("rope_freqs.weight"):
        return _llama3_rope_scaling(gguf, head_dim)
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    original = gguf.arch_get("rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise LowbitError(f"{gguf.path.name} uses rope scaling '{kind}', which lowbit cannot import")


def _llama3_rope_scaling(gguf: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Recover Llama-3's rope_scaling from llama.cpp's precomputed per-frequency factors.

    llama.cpp stores only the divisors (1 for high frequencies, `factor` for low ones);
    HF wants the parameters, so try the published Llama 3.x values and insist they reproduce
    the stored divisors exactly.
    """
    stored = gguf.tensor("rope_freqs.weight").double().flatten()
    theta = float(gguf.arch_get("rope.freq_base", 10000.0))
    rot_dim = int(gguf.arch_get("rope.dimension_count", head_dim))
    factor = float(stored.max())
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384)):
        expected = llama3_rope_divisors(theta, rot_dim, factor, low, high, original)
        if expected.shape == stored.shape and torch.allclose(expected, stored, rtol=1e-4, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise LowbitError(f"{gguf.path.name} has rope_freqs that match no Llama-3 rope scaling lowbit knows")


def llama3_rope_divisors(theta: float, rot_dim: int, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Per-frequency divisors of Llama-3 rope scaling, as llama.cpp stores them in rope_freqs."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen) - low) / (high - low)
    scaled = (1 - smooth) / factor + smooth  # the frequency multiplier in the blended band
    divisors = 1.0 / scaled
    divisors = torch.where(wavelen < original / high, torch.ones_like(divisors), divisors)
    return torch.where(wavelen > original / low, torch.full_like(divisors, factor), divisors)


def _llama_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _common_config(gguf)
    config.update(
        hidden_act="silu",
        attention_bias=gguf.has_tensor("blk.0.attn_q.bias"),
        mlp_bias=gguf.has_tensor("blk.0.ffn_up.bias"),
    )
    if gguf.arch_get("expert_count"):  # Mixtral: softmax over the experts, top-k renormalized
        config.update(_expert_counts(gguf, "num_local_experts"), sliding_window=None)
        config.pop("mlp_bias")
    return config


def _expert_counts(gguf: GGUFFile, key: str) -> dict[str, int]:
    experts = _arch_int(gguf, "expert_count", low=1)
    used = _arch_int(gguf, "expert_used_count", low=1)
    if used > experts:
        raise LowbitError(f"{gguf.path.name}: expert_used_count {used} exceeds expert_count {experts}")
    return {key: experts, "num_experts_per_tok": used}


def has_experts(spec: ArchSpec, gguf: GGUFFile) -> bool:
    return spec.moe and bool(gguf.arch_get("expert_count"))


def model_identity(spec: ArchSpec, gguf: GGUFFile) -> tuple[str, str]:
    """(model_type, HF class name) for config.json."""
    if spec.moe_identity is not None and has_experts(spec, gguf):
        return spec.moe_identity
    return spec.model_type, spec.hf_class


def _expert_size(gguf: GGUFFile, config: dict[str, Any]) -> int:
    # llama.cpp's fallback when the key is absent: the dense size shared over the used experts
    fallback = max(1, config["intermediate_size"] // config["num_experts_per_tok"])
    return _arch_int(gguf, "expert_feed_forward_length", fallback)


# llama.cpp builds every layer of these three as a sparse block and fixes whether the top-k
# probabilities are renormalized per architecture (qwen2moe and olmoe: no; qwen3moe: yes).
def _qwen2moe_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _qwen2_config(gguf)
    config.update(_expert_counts(gguf, "num_experts"))
    config.update(
        moe_intermediate_size=_expert_size(gguf, config),
        shared_expert_intermediate_size=_arch_int(gguf, "expert_shared_feed_forward_length", config["intermediate_size"]),
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        qkv_bias=gguf.has_tensor("blk.0.attn_q.bias"),
    )
    return config


def _qwen3moe_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _qwen3_config(gguf)
    config.update(_expert_counts(gguf, "num_experts"))
    config.update(moe_intermediate_size=_expert_size(gguf, config), norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], use_sliding_window=False)
    return config


def _olmoe_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _common_config(gguf)
    config.update(_expert_counts(gguf, "num_experts"))
    config.update(hidden_act="silu", norm_topk_prob=False, clip_qkv=None, attention_bias=False)
    return config


def _qwen2_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _common_config(gguf)
    config.update(hidden_act="silu", use_sliding_window=False)
    return config


def _qwen3_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _common_config(gguf)
    config.update(hidden_act="silu", attention_bias=gguf.has_tensor("blk.0.attn_q.bias"))
    return config


def _gemma3_config(gguf: GGUFFile) -> dict[str, Any]:
    config = _common_config(gguf)
    n_layers = config["num_hidden_layers"]
    window = gguf.arch_get("attention.sliding_window")
    pattern = gguf.arch_get("attention.sliding_window_pattern", 6)  # llama.cpp's default for Gemma-3
    if not window:
        sliding = [False] * n_layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern][:n_layers]
    else:
        pattern = int(pattern)
        sliding = llama_cpp_swa_layers(pattern, n_layers)
    # Gemma-3 27B scales queries by 1/sqrt(hidden/heads); the other sizes by 1/sqrt(head_dim).
    pre_attn_scalar = config["head_dim"]
    if n_layers == 62:
        pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(window) if window else None,
        sliding_window_pattern=int(pattern) if not isinstance(pattern, list) else None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=float(gguf.arch_get("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=pre_attn_scalar,
        final_logit_softcapping=gguf.arch_get("final_logit_softcapping"),
        attn_logit_softcapping=None,
        attention_bias=False,
    )
    config.setdefault("rope_scaling", None)
    return config


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "llama", "LlamaForCausalLM", _LLAMA_BLOCK, _llama_config, permute_qk=True,
                      moe=True, moe_identity=("mixtral", "MixtralForCausalLM")),
    "qwen2moe": ArchSpec("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", _LLAMA_BLOCK, _qwen2moe_config, moe=True),
    "qwen3moe": ArchSpec("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _LLAMA_BLOCK, _qwen3moe_config, moe=True),
    "olmoe": ArchSpec("olmoe", "olmoe", "OlmoeForCausalLM", _LLAMA_BLOCK, _olmoe_config, moe=True, qk_norm_full=True),
    "qwen2": ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", _LLAMA_BLOCK, _qwen2_config),
    "qwen3": ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", _LLAMA_BLOCK, _qwen3_config),
    "gemma3": ArchSpec("gemma3", "gemma3_text", "Gemma3ForCausalLM", _GEMMA3_BLOCK, _gemma3_config, norm_offset=1.0),
}


def arch_spec(gguf: GGUFFile) -> ArchSpec:
    arch = gguf.architecture
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise LowbitError(
            f"GGUF architecture '{printable(arch)}' is not supported by lowbit convert (supported: {', '.join(ARCHITECTURES)})"
        ) from None
