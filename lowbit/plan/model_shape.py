"""ModelShape: every weight a model holds, read off a Hugging Face config.json alone.

Plan never sees a tensor, so the parameter count comes from the hyper-parameters: the token
embedding, per decoder layer the attention and MLP Linears as (out, in) shapes, the norms and
biases, the router and experts of a mixture of experts, and the lm_head (tied or not). Linears
are what a number format quantizes; everything else stays in bf16 unless asked otherwise.

Families read: Llama, Mistral, Qwen2/Qwen3 (+ their MoE variants), Gemma-2/3, Mixtral, and any
config that spells its hyper-parameters the Llama way. A multimodal config's `text_config` is
read instead of the top level (the vision tower is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowbit.errors import LowbitError

FULL = "full_attention"
SLIDING = "sliding_attention"

# Families with Gemma's sandwich norms: pre/post attention and pre/post feed-forward.
_FOUR_NORM_TYPES = {"gemma2", "gemma3", "gemma3_text"}
# Families that normalise q and k per head before RoPE.
_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
# Families whose q/k/v projections carry a bias by default.
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
# Families that default to tied embeddings when the config does not say.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text"}
# Attention schemes plan's KV arithmetic does not describe; refusing beats a wrong number.
_UNSUPPORTED = {
    "deepseek_v2": "multi-head latent attention",
    "deepseek_v3": "multi-head latent attention",
    "mamba": "a state-space model",
    "mamba2": "a state-space model",
}


@dataclass(slots=True, frozen=True)
class LinearShape:
    """One kind of Linear and how many copies of it the model holds."""

    name: str  # e.g. "q_proj", "experts.w1"
    out_features: int
    in_features: int
    copies: int  # layers (× experts for routed experts)
    expert: bool = False  # a routed expert: only experts_per_token of num_experts run per token

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features * self.copies


@dataclass(slots=True)
class ModelShape:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    tied_embeddings: bool
    # attention window per layer; None = the layer attends to the whole context
    layer_windows: tuple[int | None, ...]
    linears: list[LinearShape]
    norm_params: int  # every RMSNorm / LayerNorm weight
    bias_params: int  # Linear biases (kept in bf16 with the Linears' bf16 neighbours)
    router_params: int  # MoE gates: tiny, accuracy-critical, never quantized
    num_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    notes: list[str] = field(default_factory=list)

    # -- counts ---------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of a separate output matrix; 0 when it is the embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        return sum(lin.numel for lin in self.linears)

    @property
    def expert_params(self) -> int:
        return sum(lin.numel for lin in self.linears if lin.expert)

    @property
    def active_linear_params(self) -> int:
        """Linear weights one token multiplies: all dense ones and top-k of the routed experts."""
        dense = self.linear_params - self.expert_params
        if not self.num_experts:
            return dense
        return dense + self.expert_params * self.experts_per_token // self.num_experts

    @property
    def other_params(self) -> int:
        return self.norm_params + self.bias_params + self.router_params

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.lm_head_params + self.linear_params + self.other_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (the usual 'active' count: embeddings and head included)."""
        return self.total_params - self.expert_params + (
            self.expert_params * self.experts_per_token // self.num_experts if self.num_experts else 0
        )

    @property
    def output_params(self) -> int:
        """The matrix that turns the last hidden state into logits (the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def shape_from_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """Build the ModelShape of a config.json (already parsed into a dict)."""
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "llama")
    if model_type in _UNSUPPORTED or "kv_lora_rank" in cfg:
        what = _UNSUPPORTED.get(model_type, "multi-head latent attention")
        raise LowbitError(f"{name}: model_type '{model_type}' uses {what}, which plan does not model yet")

    hidden = _need(cfg, "hidden_size", name)
    layers = _need(cfg, "num_hidden_layers", name)
    heads = _need(cfg, "num_attention_heads", name)
    vocab = _need(cfg, "vocab_size", name)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if hidden <= 0 or layers <= 0 or heads <= 0 or kv_heads <= 0 or head_dim <= 0 or vocab <= 0:
        raise LowbitError(f"{name}: config.json has a non-positive size")
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)))

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    linears = [
        LinearShape("q_proj", q_out, hidden, layers),
        LinearShape("k_proj", kv_out, hidden, layers),
        LinearShape("v_proj", kv_out, hidden, layers),
        LinearShape("o_proj", hidden, q_out, layers),
    ]
    qkv_bias = bool(cfg.get("attention_bias", model_type in _QKV_BIAS_TYPES))
    bias = layers * (q_out + 2 * kv_out) if qkv_bias else 0
    if cfg.get("attention_bias") and model_type not in _QKV_BIAS_TYPES:
        bias += layers * hidden  # Llama's attention_bias covers o_proj too

    norms_per_layer = 4 if model_type in _FOUR_NORM_TYPES else 2
    norms = layers * norms_per_layer * hidden + hidden  # + the final norm
    if model_type in _QK_NORM_TYPES:
        norms += layers * 2 * head_dim

    shape = ModelShape(
        name=name,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=int(cfg.get("max_position_embeddings") or 0),
        tied_embeddings=tied,
        layer_windows=_layer_windows(cfg, model_type, layers),
        linears=linears,
        norm_params=norms,
        bias_params=bias,
        router_params=0,
    )
    _add_mlp(shape, cfg, model_type)
    return shape


def _add_mlp(shape: ModelShape, cfg: dict[str, Any], model_type: str) -> None:
    hidden, layers = shape.hidden_size, shape.num_layers
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if num_experts <= 1:
        inter = _need(cfg, "intermediate_size", shape.name)
        shape.linears += _gated_mlp("", inter, hidden, layers)
        shape.bias_params += layers * (2 * inter + hidden) if mlp_bias else 0
        return

    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= num_experts:
        raise LowbitError(f"{shape.name}: num_experts_per_tok must be between 1 and {num_experts}")
    moe_layers = _moe_layer_count(cfg, layers)
    dense_layers = layers - moe_layers
    expert_inter = int(cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size", shape.name))
    shape.linears += _gated_mlp("experts.", expert_inter, hidden, moe_layers * num_experts, expert=True)
    if dense_layers:
        shape.linears += _gated_mlp("", _need(cfg, "intermediate_size", shape.name), hidden, dense_layers)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared:
        shape.linears += _gated_mlp("shared_expert.", shared, hidden, moe_layers)
        shape.router_params += moe_layers * hidden  # the shared expert's sigmoid gate
    shape.router_params += moe_layers * num_experts * hidden
    shape.num_experts, shape.experts_per_token, shape.moe_layers = num_experts, top_k, moe_layers


def _gated_mlp(prefix: str, inter: int, hidden: int, copies: int, expert: bool = False) -> list[LinearShape]:
    # gate and up read the hidden state, down writes it back (SwiGLU / GeGLU)
    return [
        LinearShape(f"{prefix}gate_proj", inter, hidden, copies, expert),
        LinearShape(f"{prefix}up_proj", inter, hidden, copies, expert),
        LinearShape(f"{prefix}down_proj", hidden, inter, copies, expert),
    ]


def _moe_layer_count(cfg: dict[str, Any], layers: int) -> int:
    # Qwen-MoE can keep some layers dense: `mlp_only_layers` and every `decoder_sparse_step`-th.
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs name a window they do not use unless use_sliding_window
    if not window:
        return (None,) * layers
    window = int(window)
    if layer_types:
        if len(layer_types) != layers:
            raise LowbitError(f"config.json has {len(layer_types)} layer_types for {layers} layers")
        return tuple(window if t == SLIDING else None for t in layer_types)
    if model_type in ("gemma3", "gemma3_text"):
        # Gemma-3: five local layers, then one global, repeating
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))
    if model_type == "gemma2":
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if model_type.startswith("qwen"):
        first = int(cfg.get("max_window_layers") or 0)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # Mistral v0.1 style: every layer slides


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return merged
    return config


def _need(cfg: dict[str, Any], key: str, name: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise LowbitError(f"{name}: config.json has no '{key}'; plan needs it to count parameters")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LowbitError(f"{name}: config.json '{key}' is not a number: {value!r}") from None
