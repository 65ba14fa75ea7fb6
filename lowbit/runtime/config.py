"""ModelConfig: the facts of a Hugging Face config.json that lowbit's runtime needs.

One flat record for every supported family, so model code reads flags (`qk_norm`, `attention_bias`,
per-layer windows) instead of branching on model names. Both config.json spellings are read:
transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and 5 (`rope_parameters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lowbit.errors import LowbitError

# model_type -> family (the module in runtime/models/ that builds it)
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    # mixture-of-experts members: their MLPs are runtime/models/moe.py's block (ModelConfig.moe)
    "mixtral": "llama",
    "qwen2_moe": "llama",
    "qwen3_moe": "llama",
    "olmoe": "llama",
    "gemma3_text": "gemma3",
}

# architectures entry -> model_type, for config.json files that name only the class
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Gemma3ForCausalLM": "gemma3_text",
}

FULL = "full_attention"
SLIDING = "sliding_attention"

ROPE_KINDS = ("default", "linear", "llama3")


@dataclass(slots=True)
class RopeConfig:
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    rope: RopeConfig
    # RoPE of sliding-window layers where it differs (Gemma-3's local base frequency)
    rope_local: RopeConfig | None = None
    attention_bias: bool = False  # q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_full: bool = False  # q/k norms over the whole projection (OLMoE), not per head
    moe: MoeConfig | None = None  # sparse MLP layers (Mixtral, Qwen2/3-MoE, OLMoE)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    query_scale: float = 1.0
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def window(self, layer: int) -> int | None:
        """Tokens a query of this layer sees (itself included), or None for the whole past."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def stored_dtype(self) -> str | None:
        """The dtype config.json says the weights were saved in ("bfloat16", "float16", ...), or None."""
        for key in ("torch_dtype", "dtype"):
            value = self.raw.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
        return None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == SLIDING and self.rope_local is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Every value is checked for type and range here, so a damaged config.json is one LowbitError
        naming the key, never a TypeError deep in model construction."""
        if not isinstance(d, dict):
            raise LowbitError("config.json does not hold a JSON object")
        model_type = _model_type(d)
        family = FAMILIES[model_type]
        default_arch = next(arch for arch, mt in ARCHITECTURES.items() if mt == model_type)
        architecture = (_architectures(d) or [default_arch])[0]
        if family == "gemma3":
            return _gemma3(d, model_type, architecture)
        return _llama_like(d, model_type, architecture)


def _architectures(d: dict[str, Any]) -> list[str]:
    value = d.get("architectures")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise LowbitError(f"config.json: architectures must be a list of class names, got {_show(value)}")
    return value


def _model_type(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise LowbitError(f"config.json: model_type must be a string, got {_show(model_type)}")
    architectures = _architectures(d)
    if model_type in FAMILIES:
        return model_type
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    name = ", ".join(architectures) or model_type or "unknown (config.json names no model_type)"
    hint = " (multimodal Gemma-3; only the text model Gemma3ForCausalLM is supported)" if model_type == "gemma3" else ""
    raise LowbitError(
        f"unsupported architecture {name}{hint}; lowbit runs {', '.join(sorted(ARCHITECTURES))}"
    )


_REQUIRED = object()

# Upper bounds far above any released model (Gemma-3's 262k vocabulary, 16k hidden, 126 layers,
# 10M-token contexts) that keep a damaged number from building a model of billions of meta layers.
_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 13,
    "max_position_embeddings": 1 << 31,
    "sliding_window": 1 << 31,
    "max_window_layers": 1 << 12,
    "sliding_window_pattern": 1 << 12,
    "original_max_position_embeddings": 1 << 31,
}


def _show(value: Any) -> str:
    """A config value for an error line: its JSON text, cut short."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _need(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise LowbitError(f"config.json lacks '{key}'")
    return d[key]


def _int(d: dict[str, Any], key: str, default: Any = _REQUIRED, low: int = 1, falsy_default: bool = False) -> Any:
    """config.json's integer `key` in [low, _LIMITS[key]]; `default` when absent or null (or, with
    falsy_default, also when 0: the old `d.get(key) or default` reading of optional sizes)."""
    value = d.get(key)
    if value is None or (falsy_default and value == 0 and not isinstance(value, bool)):
        if default is _REQUIRED:
            raise LowbitError(f"config.json lacks '{key}'")
        return default
    # JSON has one number type: 4096.0 is an integer, "4096" and true are not
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LowbitError(f"config.json: {key} must be an integer, got {_show(value)}")
    high = _LIMITS.get(key, 1 << 31)
    if not low <= value <= high:
        raise LowbitError(f"config.json: {key} {value} is out of range ({low} to {high})")
    return value


def _float(d: dict[str, Any], key: str, default: float, positive: bool = True) -> float:
    """config.json's finite number `key` (> 0 when `positive`); `default` when absent, null or 0."""
    value = d.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LowbitError(f"config.json: {key} must be a finite number, got {_show(value)}")
    if positive and value <= 0:
        raise LowbitError(f"config.json: {key} must be positive, got {_show(value)}")
    return float(value)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LowbitError(f"config.json: {key} must be true or false, got {_show(value)}")
    return value


def _token_ids(d: dict[str, Any], key: str) -> list[int]:
    value = d.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise LowbitError(f"config.json: {key} must be a token id or a list of them, got {_show(value)}")
    return ids


def _common(d: dict[str, Any], model_type: str, architecture: str, default_act: str) -> dict[str, Any]:
    hidden = _int(d, "hidden_size")
    heads = _int(d, "num_attention_heads")
    head_dim = _int(d, "head_dim", None, falsy_default=True)
    if head_dim is None:
        if hidden % heads:
            raise LowbitError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise LowbitError(f"config.json: head_dim {head_dim} is odd; rotary embeddings rotate pairs of channels")
    kv_heads = _int(d, "num_key_value_heads", heads, falsy_default=True)
    if heads % kv_heads:
        raise LowbitError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    act = d.get("hidden_activation") or d.get("hidden_act") or default_act
    if not isinstance(act, str):
        raise LowbitError(f"config.json: hidden_act must be an activation name, got {_show(act)}")
    bos = _token_ids(d, "bos_token_id")
    if len(bos) > 1:
        raise LowbitError(f"config.json: bos_token_id must be one token id, got {_show(d['bos_token_id'])}")
    softcap = d.get("final_logit_softcapping")
    if softcap is not None:
        softcap = _float(d, "final_logit_softcapping", None)
    return dict(
        model_type=model_type,
        family=FAMILIES[model_type],
        architecture=architecture,
        vocab_size=_int(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size"),
        num_hidden_layers=_int(d, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
        max_position_embeddings=_int(d, "max_position_embeddings", 2048, falsy_default=True),
        hidden_act=act,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(_token_ids(d, "eos_token_id")),
        final_logit_softcapping=softcap,
        raw=dict(d),
    )


def _llama_like(d: dict[str, Any], model_type: str, architecture: str) -> ModelConfig:
    c = _common(d, model_type, architecture, "silu")
    n = c["num_hidden_layers"]
    bias = _bool(d, "attention_bias", False)
    window = _int(d, "sliding_window", None, falsy_default=True)
    if model_type in ("mistral", "mixtral"):
        layer_types = [SLIDING if window else FULL] * n
    elif model_type in ("qwen2", "qwen3"):
        window = window if _bool(d, "use_sliding_window", False) else None
        max_window_layers = _int(d, "max_window_layers", n, low=0)
        layer_types = d.get("layer_types") or [
            SLIDING if window is not None and i >= max_window_layers else FULL for i in range(n)
        ]
    else:
        window = None
        layer_types = [FULL] * n
    c.update(
        tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
        rope=_rope(_flat_rope_params(d), d, default_theta=10000.0),
        attention_bias=True if model_type == "qwen2" else bias,
        o_proj_bias=False if model_type == "qwen2" else bias,
        mlp_bias=_bool(d, "mlp_bias", False),
        qk_norm=model_type == "qwen3",
        layer_types=_layer_types(layer_types, n),
        sliding_window=window,
        query_scale=c["head_dim"] ** -0.5,
    )
    if model_type in MOE_TYPES:
        _moe_fields(c, d, model_type)
    return ModelConfig(**c)


def _gemma3(d: dict[str, Any], model_type: str, architecture: str) -> ModelConfig:
    # attn_logit_softcapping is ignored on purpose: Gemma-3 checkpoints set it null and transformers'
    # Gemma-3 (the reference these weights are checked against) never applies it.
    c = _common(d, model_type, architecture, "gelu_pytorch_tanh")
    n = c["num_hidden_layers"]
    pattern = _int(d, "sliding_window_pattern", 6, falsy_default=True)
    layer_types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    params = _dict(d, "rope_parameters")
    if FULL in params or SLIDING in params:
        global_params = _dict(params, FULL, "rope_parameters.")
        local_params = _dict(params, SLIDING, "rope_parameters.")
    else:
        global_params = _flat_rope_params(d)
        local_params = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    window = _int(d, "sliding_window", None, falsy_default=True)
    bias = _bool(d, "attention_bias", False)
    c.update(
        tie_word_embeddings=_bool(d, "tie_word_embeddings", True),
        rope=_rope(global_params, d, default_theta=1_000_000.0),
        rope_local=_rope(local_params, d, default_theta=10000.0),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        layer_types=_layer_types(layer_types, n),
        sliding_window=window,
        query_scale=_float(d, "query_pre_attn_scalar", 256.0) ** -0.5,
    )
    return ModelConfig(**c)


def _layer_types(types: list[str], n: int) -> tuple[str, ...]:
    if not isinstance(types, list) or len(types) < n or any(t not in (FULL, SLIDING) for t in types[:n]):
        raise LowbitError(f"config.json: layer_types must name {FULL} or {SLIDING} for each of the {n} layers")
    return tuple(types[:n])


def _dict(d: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
    """A sub-object of config.json ({} when absent or null)."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LowbitError(f"config.json: {prefix}{key} must be an object, got {_show(value)}")
    return value


def _flat_rope_params(d: dict[str, Any]) -> dict[str, Any]:
    """One RoPE dict from either spelling: rope_parameters (v5) or rope_theta + rope_scaling (v4)."""
    params = dict(_dict(d, "rope_parameters"))
    params.update(_dict(d, "rope_scaling"))
    if "rope_theta" not in params and d.get("rope_theta") is not None:
        params["rope_theta"] = d["rope_theta"]
    return params


def _rope(params: dict[str, Any], d: dict[str, Any], default_theta: float) -> RopeConfig:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:  # a tuple of strings: comparing never hashes a damaged value
        shown = kind if isinstance(kind, str) else _show(kind)
        raise LowbitError(f"unsupported rope scaling '{shown}'; lowbit supports {', '.join(ROPE_KINDS)}")
    partial = params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise LowbitError(f"unsupported partial_rotary_factor {_show(partial)} in config.json (lowbit needs 1)")
    theta_source = params if params.get("rope_theta") else d
    rope = RopeConfig(theta=_float(theta_source, "rope_theta", default_theta), kind=kind)
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(kind, ())
    for key in needed:
        if params.get(key) is None:
            raise LowbitError(f"config.json: {kind} rope scaling lacks '{key}'")
    if kind == "linear":
        rope.factor = _float(params, "factor", 1.0)
    elif kind == "llama3":
        rope.factor = _float(params, "factor", 1.0)
        rope.low_freq_factor = _float(params, "low_freq_factor", 1.0)
        rope.high_freq_factor = _float(params, "high_freq_factor", 4.0)
        if rope.high_freq_factor == rope.low_freq_factor:
            raise LowbitError("config.json: llama3 rope scaling needs high_freq_factor != low_freq_factor")
        rope.original_max_position_embeddings = _int(
            params, "original_max_position_embeddings",
            _int(d, "max_position_embeddings", 8192, falsy_default=True), falsy_default=True,
        )
    return rope


# ---- mixture of experts -------------------------------------------------------------------------

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_MAX_EXPERTS = 1 << 12  # far above released models (DeepSeek-V3 256, Qwen3 128), below a damaged count


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model (runtime/models/moe.py reads nothing else).

    Families differ only in these facts: Mixtral renormalizes its top-k probabilities and scales the
    expert outputs by them in float32; Qwen2/3-MoE and OLMoE renormalize when `norm_topk_prob` and
    round the weights to the model dtype first; Qwen2-MoE adds a shared expert behind a sigmoid gate.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert (dense layers use ModelConfig.intermediate_size)
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    shared_expert_size: int | None = None
    sparse_layers: tuple[bool, ...] = ()  # per layer: the sparse block, or a dense MLP


def _moe_fields(c: dict[str, Any], d: dict[str, Any], model_type: str) -> None:
    """The MoE families' attention flags and their MoeConfig, into the record `c`; any field whose
    value lowbit would not honour is refused by name."""
    n = c["num_hidden_layers"]
    if model_type == "mixtral":
        experts = _int(d, "num_local_experts")
        size, norm, model_dtype, shared = c["intermediate_size"], True, False, None
    else:
        # transformers 5 writes Qwen3-MoE's count as num_local_experts (its attribute_map), hub files num_experts
        key = "num_experts" if d.get("num_experts") is not None or d.get("num_local_experts") is None else "num_local_experts"
        experts = _int(d, key)
        size = c["intermediate_size"] if model_type == "olmoe" else _int(d, "moe_intermediate_size")
        norm, model_dtype = _bool(d, "norm_topk_prob", False), True
        shared = _int(d, "shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
    if experts > _MAX_EXPERTS:
        raise LowbitError(f"config.json: {experts} experts is out of range (1 to {_MAX_EXPERTS})")
    top_k = _int(d, "num_experts_per_tok")
    if top_k > experts:
        raise LowbitError(f"config.json: num_experts_per_tok {top_k} exceeds the model's {experts} experts")
    sparse = (True,) * n
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if _bool(d, "use_sliding_window", False):
            raise LowbitError(f"config.json: use_sliding_window true is not supported for {model_type}")
        step = _int(d, "decoder_sparse_step", 1)
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in only):
            raise LowbitError(f"config.json: mlp_only_layers must list layer indices below {n}, got {_show(only)}")
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
    if model_type == "qwen2_moe":
        c.update(attention_bias=_bool(d, "qkv_bias", True), o_proj_bias=False)
    if model_type == "olmoe":
        if d.get("clip_qkv") is not None:
            raise LowbitError(f"config.json: clip_qkv {_show(d['clip_qkv'])} is not supported (lowbit needs null)")
        if c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]:
            raise LowbitError("config.json: olmoe needs head_dim * num_attention_heads == hidden_size (its q norm spans hidden_size)")
    c.update(
        qk_norm=model_type in ("qwen3_moe", "olmoe"),
        qk_norm_full=model_type == "olmoe",
        moe=MoeConfig(experts, top_k, size, norm, model_dtype, shared, sparse),
    )
