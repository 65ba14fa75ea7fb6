"""ModelConfig: the facts of a Hugging Face config.json that lowbit's runtime needs.

One flat record for every supported family, so model code reads flags (`qk_norm`, `attention_bias`,
per-layer windows) instead of branching on model names. Both config.json spellings are read:
transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and 5 (`rope_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowbit.errors import LowbitError

# model_type -> family (the module in runtime/models/ that builds it)
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma3_text": "gemma3",
}

# architectures entry -> model_type, for config.json files that name only the class
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
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

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == SLIDING and self.rope_local is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = _model_type(d)
        family = FAMILIES[model_type]
        default_arch = next(arch for arch, mt in ARCHITECTURES.items() if mt == model_type)
        architecture = (d.get("architectures") or [default_arch])[0]
        if family == "gemma3":
            return _gemma3(d, model_type, architecture)
        return _llama_like(d, model_type, architecture)


def _model_type(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    architectures = d.get("architectures") or []
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


def _need(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise LowbitError(f"config.json lacks '{key}'")
    return d[key]


def _common(d: dict[str, Any], model_type: str, architecture: str, default_act: str) -> dict[str, Any]:
    hidden = int(_need(d, "hidden_size"))
    heads = int(_need(d, "num_attention_heads"))
    if d.get("head_dim") is None and hidden % heads:
        raise LowbitError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    eos = d.get("eos_token_id")
    return dict(
        model_type=model_type,
        family=FAMILIES[model_type],
        architecture=architecture,
        vocab_size=int(_need(d, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_need(d, "intermediate_size")),
        num_hidden_layers=int(_need(d, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or default_act,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        raw=dict(d),
    )


def _llama_like(d: dict[str, Any], model_type: str, architecture: str) -> ModelConfig:
    c = _common(d, model_type, architecture, "silu")
    n = c["num_hidden_layers"]
    bias = bool(d.get("attention_bias", False))
    window = d.get("sliding_window")
    if model_type == "mistral":
        layer_types = [SLIDING if window else FULL] * n
    elif model_type in ("qwen2", "qwen3"):
        window = window if d.get("use_sliding_window") else None
        layer_types = d.get("layer_types") or [
            SLIDING if window is not None and i >= d.get("max_window_layers", n) else FULL for i in range(n)
        ]
    else:
        window = None
        layer_types = [FULL] * n
    c.update(
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope=_rope(_flat_rope_params(d), d, default_theta=10000.0),
        attention_bias=True if model_type == "qwen2" else bias,
        o_proj_bias=False if model_type == "qwen2" else bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        layer_types=_layer_types(layer_types, n),
        sliding_window=int(window) if window else None,
        query_scale=c["head_dim"] ** -0.5,
    )
    return ModelConfig(**c)


def _gemma3(d: dict[str, Any], model_type: str, architecture: str) -> ModelConfig:
    # attn_logit_softcapping is ignored on purpose: Gemma-3 checkpoints set it null and transformers'
    # Gemma-3 (the reference these weights are checked against) never applies it.
    c = _common(d, model_type, architecture, "gelu_pytorch_tanh")
    n = c["num_hidden_layers"]
    pattern = int(d.get("sliding_window_pattern") or 6)
    layer_types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        global_params = params.get(FULL) or {}
        local_params = params.get(SLIDING) or {}
    else:
        global_params = _flat_rope_params(d)
        local_params = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    window = d.get("sliding_window")
    c.update(
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        rope=_rope(global_params, d, default_theta=1_000_000.0),
        rope_local=_rope(local_params, d, default_theta=10000.0),
        attention_bias=bool(d.get("attention_bias", False)),
        o_proj_bias=bool(d.get("attention_bias", False)),
        qk_norm=True,
        layer_types=_layer_types(layer_types, n),
        sliding_window=int(window) if window else None,
        query_scale=float(d.get("query_pre_attn_scalar") or 256) ** -0.5,
    )
    return ModelConfig(**c)


def _layer_types(types: list[str], n: int) -> tuple[str, ...]:
    if len(types) < n or any(t not in (FULL, SLIDING) for t in types[:n]):
        raise LowbitError(f"config.json: layer_types must name {FULL} or {SLIDING} for each of the {n} layers")
    return tuple(types[:n])


def _flat_rope_params(d: dict[str, Any]) -> dict[str, Any]:
    """One RoPE dict from either spelling: rope_parameters (v5) or rope_theta + rope_scaling (v4)."""
    params = dict(d.get("rope_parameters") or {})
    params.update(d.get("rope_scaling") or {})
    if "rope_theta" not in params and d.get("rope_theta") is not None:
        params["rope_theta"] = d["rope_theta"]
    return params


def _rope(params: dict[str, Any], d: dict[str, Any], default_theta: float) -> RopeConfig:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise LowbitError(f"unsupported rope scaling '{kind}'; lowbit supports {', '.join(ROPE_KINDS)}")
    if float(params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise LowbitError("unsupported partial_rotary_factor != 1 in config.json")
    theta = float(params.get("rope_theta") or d.get("rope_theta") or default_theta)
    rope = RopeConfig(theta=theta, kind=kind)
    if kind == "linear":
        rope.factor = float(params["factor"])
    elif kind == "llama3":
        try:
            rope.factor = float(params["factor"])
            rope.low_freq_factor = float(params["low_freq_factor"])
            rope.high_freq_factor = float(params["high_freq_factor"])
        except KeyError as exc:
            raise LowbitError(f"config.json: llama3 rope scaling lacks {exc}") from None
        rope.original_max_position_embeddings = int(
            params.get("original_max_position_embeddings") or d.get("max_position_embeddings") or 8192
        )
    return rope
