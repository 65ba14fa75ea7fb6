"""Which models and caches the one-call decode step (kernels/decode_chain.py) can run, and running it.

`build(model, cache)` returns a `ChainedDecoder` when every decoder layer is one the C step
computes exactly as the Python path would: a Llama-family or Gemma-3 layer (q/k norms and Gemma's
post-norms included) with a gated MLP (silu or gelu_tanh) or a sparse MoE block of them (routed
through the C routing the model uses too, kernels/cpu_moe.py), whose q|k|v and gate|up are
joined (runtime/models/fusion.py) and whose projections all run on cpu-int4dot, cpu-int8f or
the batch-invariant dense kernel, float32 activations and the paged cache's fused CPU decode
attention. Anything else returns None and the model's own forward runs (bf16 compute,
quantized KV, outlier side matrices, biases on quantized layers, other kernels).
`why_not(model, cache)` says which.

The runner calls it for the steps whose metadata carries a `decode` index: on the CPU with the
fused attention every step, prefill chunks included (paged_attention.build_metadata); elsewhere
none (the index is built for the fused CPU kernel only).
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from lowbit.kernels import cpu_f32, cpu_moe, cpu_rowops, decode_chain, screened_head
from lowbit.kernels.cpu_f32 import InvariantLinear
from lowbit.quant import intq
from lowbit.quant.registry import get_format, part_layout
from lowbit.runtime import module_swaps
from lowbit.runtime.engine.draft_models import RescoredHead
from lowbit.runtime.engine.paged_attention import StepMetadata
from lowbit.runtime.engine.paged_cache import PagedKVCache
from lowbit.runtime.layers import GatedMLP, RMSNorm
from lowbit.runtime.models.fusion import JoinedDense, JoinedLinear
from lowbit.runtime.models.gemma3 import Gemma3DecoderLayer
from lowbit.runtime.models.llama import LlamaDecoderLayer
from lowbit.runtime.models.moe import SparseMoE
from lowbit.runtime.quant_embedding import QuantEmbedding
from lowbit.runtime.quant_linear import QuantLinear


class Unsupported(Exception):
    """Why a model or cache cannot take the one-call step (a reason, never shown as an error)."""


def _linear(module) -> decode_chain.Linear:
    if isinstance(module, JoinedLinear):
        found = decode_chain.quantized_linear(module.prepared)
    elif isinstance(module, JoinedDense):
        return _linear(module.linear)
    elif type(module) is QuantLinear:
        if module.outliers is not None or module.bias is not None:
            raise Unsupported("a quantized projection with an outlier matrix or a bias")
        found = decode_chain.quantized_linear(module.prepared)
    elif type(module) is InvariantLinear:
        found = decode_chain.dense_linear(module.weight, module.bias, module.bf16_x, module.packed)
    else:
        raise Unsupported(f"a {type(module).__name__} projection")
    if found is None:
        raise Unsupported("a projection on a kernel other than cpu-int4dot, cpu-int8dot, cpu-int8f or the dense float32 one")
    return found


def _check_model(model, cache) -> None:
    inner = model.model
    if not decode_chain.available() or not cpu_f32.available():
        raise Unsupported("the C kernels are not built")
    # (fused_decode: a float32 or bf16-stored pool, never a quantized one)
    if not isinstance(cache, PagedKVCache) or not cache.fused_decode or cache.dtype is not torch.float32:
        raise Unsupported("not a float32 model over the paged float32 cache (or its bf16-stored one) with the fused CPU decode attention")
    if len(inner.rotaries) > decode_chain.MAX_ROPES or not inner.layers:
        raise Unsupported(f"more than {decode_chain.MAX_ROPES} rotary tables, or no layers")
    # one eps and offset rule for every norm (the C step passes one), as rowops_norms asks of a layer's
    norms = [inner.norm] + [m for layer in inner.layers for m in layer.modules() if isinstance(m, RMSNorm)]
    if any(n.eps != inner.norm.eps or n.unit_offset != inner.norm.unit_offset or n.weight.dtype is not torch.float32
           or not n.weight.is_contiguous() for n in norms):
        raise Unsupported("norms of another dtype, eps or kind")


def _gated(mlp) -> decode_chain.MLPSpec:
    if type(mlp) is not GatedMLP or mlp.fused_gate_up is None or mlp.act_name is None:
        raise Unsupported("an MLP whose gate/up are not joined, or an activation the C row op lacks")
    return decode_chain.MLPSpec(_linear(mlp.fused_gate_up), _linear(mlp.down_proj))


def _router(weight: torch.Tensor) -> torch.Tensor:
    # SparseMoE routes through the C routing exactly when this holds (cpu_moe.usable), which the
    # chain's MoE blocks call too
    if weight.dtype is not torch.float32 or not weight.is_contiguous() or not cpu_moe.available() \
            or weight.shape[0] > cpu_moe.MAX_EXPERTS:
        raise Unsupported("a router the C routing does not take")
    return weight.data


def _mlp_spec(mlp) -> decode_chain.MLPSpec | decode_chain.MoESpec:
    if type(mlp) is not SparseMoE:
        return _gated(mlp)
    if mlp.every_expert:
        raise Unsupported("a MoE block in calibration mode (every expert runs)")
    shared = None if mlp.shared_expert is None else _gated(mlp.shared_expert)
    return decode_chain.MoESpec(
        router=_router(mlp.gate.weight), experts=[_gated(e) for e in mlp.experts], top_k=mlp.top_k,
        norm_topk=mlp.norm_topk_prob, shared=shared,
        shared_gate=None if shared is None else _router(mlp.shared_expert_gate.weight)[0])


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight.data


def _layer_spec(layer, rope: int, cache: PagedKVCache) -> decode_chain.ChainLayerSpec:
    # the norms around attention and MLP, as each family's forward_deferred applies them
    if type(layer) is LlamaDecoderLayer:
        norm_mlp, post_attn, post_ffn = layer.post_attention_layernorm, None, None
    elif type(layer) is Gemma3DecoderLayer:
        norm_mlp, post_attn, post_ffn = layer.pre_feedforward_layernorm, layer.post_attention_layernorm, layer.post_feedforward_layernorm
    else:
        raise Unsupported(f"a {type(layer).__name__}")
    attn = layer.self_attn
    if attn.fused_qkv is None:
        raise Unsupported("q/k/v not joined")
    return decode_chain.ChainLayerSpec(
        norm_in=layer.input_layernorm.weight.data, norm_mlp=norm_mlp.weight.data,
        qkv=_linear(attn.fused_qkv), o=_linear(attn.o_proj), mlp=_mlp_spec(layer.mlp),
        key_pool=cache.keys[attn.layer], value_pool=cache.values[attn.layer], window=attn.window, rope=rope,
        q_norm=_weight(attn.q_norm), k_norm=_weight(attn.k_norm), post_attn=_weight(post_attn), post_ffn=_weight(post_ffn))


def _slots(model) -> tuple[list[tuple[dict, str, object]], list[tuple[dict, str, object]]]:
    """Where the modules a chain reads hang, as (the owner's dict, name, the module there now),
    split in two: the top (the model, its layer list, each layer) and everything below. A swap of
    any of them (draft quantization in place, fuse_projections again) makes the chain stale. Read
    straight from the dicts, not through nn.Module.__getattr__ (0.6 ms a step that way on a
    16-layer, 8-expert model)."""
    def at(owner, name: str, table: str = "_modules"):
        d = owner.__dict__ if table == "__dict__" else owner.__dict__[table]
        return d, name, d.get(name)

    inner = model.model
    top = [at(model, "model"), at(inner, "embed_tokens"), at(inner, "norm"), at(inner, "layers")]
    found = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        top.append(at(inner.layers, str(i)))
        found += [at(layer, "self_attn"), at(layer, "mlp"), at(attn, "fused_qkv", "__dict__"), at(attn, "o_proj")]
        if type(mlp) is SparseMoE:
            found += [at(mlp, "experts"), at(mlp, "shared_expert")] + [at(mlp.experts, str(e)) for e in range(len(mlp.experts))]
            members = list(mlp.experts) + ([mlp.shared_expert] if mlp.shared_expert is not None else [])
        else:
            members = [mlp]
        for g in members:
            found += [at(g, "fused_gate_up", "__dict__"), at(g, "down_proj")]
    return top, found


class ChainedDecoder:
    """The decoder layers and final norm of `model` for the runner's steps of short items; rebuilt
    when the model's modules were swapped since, and given up when they no longer fit."""

    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.chain: decode_chain.DecodeChain | None = _chain(model, cache)
        self._watch(_slots(model))
        self.greedy_tokens = 0  # taken through the head (several-step calls, argmax rows): head_screen's clock

    def _watch(self, slots: tuple[list, list]) -> None:
        # parallel lists, so the per-step check runs in C (map, operator.is_): 215 slots on SmolLM2
        # took 0.2 ms a step through a generator expression
        top, below = slots
        self._top = [list(column) for column in zip(*top)]
        self._all = [list(column) for column in zip(*(top + below))]
        self._swaps = module_swaps.count()
        # the layers' hook tables: registering a hook fills one of these very dicts
        self._hook_tables = [table for layer in self.model.model.layers
                             for table in (layer._forward_hooks, layer._forward_pre_hooks)]

    def _stale(self) -> bool:
        """Whether a module the chain reads was swapped since it was built. The top slots are read
        every step (a layer deleted from its list is not an assignment); the rest only when a module
        assignment has happened somewhere since the last look (module_swaps: 75-150 us a step
        saved)."""
        dicts, names, modules = self._top
        if not all(map(operator.is_, map(dict.get, dicts, names), modules)):
            return True
        swaps = module_swaps.count()
        if swaps == self._swaps:
            return False
        dicts, names, modules = self._all
        if not all(map(operator.is_, map(dict.get, dicts, names), modules)):
            return True
        self._swaps = swaps  # checked: nothing this chain reads moved
        return False

    def usable(self, meta: StepMetadata) -> bool:
        """Whether this step can take the C call: short items only, no forward hooks (calibration
        and tests hook modules, as DecoderModel's deferred path checks), the same modules."""
        return meta.decode is not None and self.ready() and self.fits(meta.slot_mapping.numel())

    def ready(self) -> bool:
        """`usable` without the step: no forward hooks, the chain rebuilt if modules moved."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        if self._stale():
            self._watch(_slots(self.model))
            try:
                self.chain = _chain(self.model, self.cache)
            except Unsupported:
                self.chain = None
        return self.chain is not None and not any(self._hook_tables)

    def forward(self, ids: list[int], positions: torch.Tensor, max_position: int, meta: StepMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden] float32, as DecoderModel.forward gives them.
        The C step embeds the rows and indexes the rotary tables itself where it can (the same
        values; the torch calls cost ~0.1 ms a step, their code and data cold after the weights
        streamed through the caches)."""
        inner = self.model.model
        token_ids = torch.tensor(ids, dtype=torch.long)
        d = meta.decode
        cos, sin, scale, embed = self._step_inputs(token_ids, max_position, positions.device)
        if embed is not None:
            h = torch.empty(len(ids), inner.hidden_size)
        else:
            h = inner.embed_tokens(token_ids).float()  # a table kept in bf16 for the tied head: exact
            if inner.scale_embeddings:
                h = h * scale
        return self.chain.run(h.contiguous(), d.positions, meta.slot_mapping, d.items, d.tables, cos, sin,
                              inner.norm.weight.data, embed=embed)

    def _step_inputs(self, token_ids: torch.Tensor, max_position: int, device
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], float, decode_chain.Embedding | None]:
        """The rotary tables grown to max_position (cos, sin), the embedding scale, and the step's own
        embedding of token_ids (None where the C step cannot embed them)."""
        inner = self.model.model
        tables = [rotary.tables(max_position, device) for rotary in inner.rotaries]
        cos, sin = [c for c, _ in tables], [s for _, s in tables]
        # as DecoderModel.forward rounds it: sqrt(hidden) as a float32 value
        scale = torch.tensor(inner.hidden_size**0.5, dtype=torch.float32).item() if inner.scale_embeddings else 1.0
        embed = _embedding_source(inner.embed_tokens)
        if embed is not None:
            embed.ids, embed.scale = token_ids, scale
        return cos, sin, scale, embed

    def fits(self, rows: int) -> bool:
        """Whether a step of `rows` rows stays within every kernel's rows (grouped int8 weights take
        another route past their kernel's)."""
        return self.chain.max_rows is None or rows <= self.chain.max_rows

    def head(self) -> decode_chain.Linear | None:
        """The model's lm_head as the C step can run it after the layers (multi-step decode; a
        draft's RescoredHead by its quantized rows, `head_rescore` doing the rest), or None: a head
        on another kernel, a bias on a quantized head, or logit soft-capping (the runner applies it
        in torch)."""
        if self.model.config.final_logit_softcapping is not None:
            return None
        head = self.model.lm_head
        if type(head) is RescoredHead and self.head_rescore() is None:
            return None  # its quantized rows alone would choose other tokens
        try:
            return _linear(head.fast if type(head) is RescoredHead else head)
        except Unsupported:
            return None

    def head_rescore(self) -> decode_chain.Rescore | None:
        """A draft's RescoredHead's rescoring for the several-step calls (after `head`, its quantized
        rows), None for any other head."""
        head = self.model.lm_head
        if type(head) is not RescoredHead:
            return None
        rows = head.exact.shape[0] if head.vocab is None else head.vocab.numel()
        return decode_chain.rescore(head.exact, head.vocab, head.bias, min(head.TOP, rows))  # as RescoredHead.forward

    def embeds_itself(self) -> bool:
        """Whether the C step embeds token ids itself (the multi-step decode needs it)."""
        return _embedding_source(self.model.model.embed_tokens) is not None

    def decode_steps(self, ids: list[int], steps: int, positions: torch.Tensor, slots: torch.Tensor, meta: StepMetadata,
                     head: decode_chain.Linear) -> tuple[torch.Tensor, int]:
        """`steps` greedy decode steps of one row per sequence (DecodeChain.run_steps): ids the rows'
        last tokens, positions and slots [steps, rows]; meta the first step's metadata (its items
        and block tables, which already hold every later step's slot). Returns the tokens [steps,
        rows] and how many steps gave finite logits."""
        d = meta.decode
        cos, sin, _, embed = self._step_inputs(torch.tensor(ids, dtype=torch.long), int(positions[-1].max()), positions.device)
        screen = self.head_screen()
        self.greedy_tokens += steps * len(ids)
        return self.chain.run_steps(steps, positions, slots, d.items, d.tables, cos, sin, self.model.model.norm.weight.data,
                                    embed, head, screen, self.head_rescore())

    def screened_argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token of the model's head at hidden states h [rows, hidden] (after the
        final norm) through the head's int8 copy, or None where there is none or it cannot decide."""
        screen = self.head_screen()
        self.greedy_tokens += h.shape[0]
        head = self.head() if screen is not None else None
        return None if head is None else screened_head.argmax(screen, head, h)

    def head_screen(self, now: bool = False) -> screened_head.HeadScreen | None:
        """The int8 copy through which greedy rows take a dense head's argmax (kernels/screened_head.py),
        made once this decoder has taken `screened_head.after_tokens()` greedy tokens without it (or
        `now`: `lowbit bench` makes it before timing, as it touches the KV pages) and kept on the head
        module while its weight stays (one copy for every decoder over the head: a layer-prefix
        draft's view shares the model's); None until then, for other heads, or with
        LOWBIT_HEAD_SCREEN=0."""
        lm_head = self.model.lm_head
        if type(lm_head) is not InvariantLinear or lm_head.bias is not None or not screened_head.enabled():
            return None
        weight = lm_head.weight.data
        cached = getattr(lm_head, "_int8_screen", None)  # (the weight's address, its screen)
        if cached is None or cached[0] != weight.data_ptr():
            if not now and self.greedy_tokens < screened_head.after_tokens():
                return None
            cached = (weight.data_ptr(), screened_head.build(weight, lm_head.bf16_x and weight.dtype is torch.bfloat16))
            lm_head._int8_screen = cached  # a plain attribute: not a module, so no swap is counted
        return cached[1]


def _embedding_source(embed) -> decode_chain.Embedding | None:
    """The table part of an embedding lookup the C step can do (ids filled in per step): a plain
    table (float32 or bf16, contiguous), or a tied head's int8 / int4 codes in groups
    (QuantEmbedding, whose rows it dequantizes as quant/intq.py does); None for anything else."""
    if type(embed) is QuantEmbedding:
        qt = embed.qt
        spec = None if qt is None else qt.spec
        # quant/intq.py's codes (8-bit as int8 code - 128, 4-bit two a byte), group scales and zero
        # points, exactly as its part_layout has them, on the CPU and contiguous
        if spec is None or get_format(spec) is not intq or spec.bits not in (4, 8) or spec.double_quant \
                or embed.dtype is not torch.float32:
            return None
        parts = qt.parts()
        for name, (shape, dtype) in part_layout(spec, qt.shape).items():
            t = parts[name]
            if tuple(t.shape) != tuple(shape) or t.dtype is not dtype or not t.is_contiguous() or t.device.type != "cpu":
                return None
        return decode_chain.Embedding(None, qt.qweight, 1.0, qt.scales, intq.group_size_of(spec, qt.shape[1]), spec.bits,
                                      qt.zeros)
    if type(embed) is not nn.Embedding or embed.max_norm is not None:
        return None
    w = embed.weight
    if w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous() or w.device.type != "cpu":
        return None
    return decode_chain.Embedding(None, w.data)


def build(model, cache) -> ChainedDecoder | None:
    try:
        return ChainedDecoder(model, cache)
    except Unsupported:
        return None


def why_not(model, cache) -> str | None:
    """None when `build` succeeds, else the reason it does not."""
    try:
        _chain(model, cache)
    except Unsupported as e:
        return str(e)
    return None


def _chain(model, cache) -> decode_chain.DecodeChain:
    _check_model(model, cache)
    inner = model.model
    specs = [_layer_spec(layer, rope, cache) for layer, rope in zip(inner.layers, inner.layer_rotary)]
    attn = inner.layers[0].self_attn
    acts = {m.act_name for m in model.modules() if isinstance(m, GatedMLP)}
    if len(acts) != 1:
        raise Unsupported("MLPs with different activations")
    config = model.config
    return decode_chain.DecodeChain(
        specs, hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim, block_size=cache.block_size, eps=inner.norm.eps, unit_offset=inner.norm.unit_offset,
        act=cpu_rowops.ACTS[acts.pop()], scale=attn.scale)
