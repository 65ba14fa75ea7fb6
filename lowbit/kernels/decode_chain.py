"""The decoder layers of an engine step in one C call (native/decode_layers.c): the structs it reads.

A `DecodeChain` holds, per layer, the norm weights, the projections (q|k|v joined, o, and the
MLP's gate|up joined and down, or a MoE block's router and experts) as the C kernels take them,
and the layer's KV pools; `run` computes a step of short items (decodes, speculative verifies)
through all of them and the final norm. The C side only sequences the kernels the Python path
calls (int4_vnni.c / int4_dot.c, int8_gemv.c, f32_dot.c, rowops.c, paged_decode.c, moe_route.c),
with the same arguments, so the hidden states are bit for bit the Python path's; what it saves is
the interpreter between ~7 calls a layer, and the OpenMP workers' sleep in those pauses
(docs/kernels.md, "One call per step").

This module knows kernels, not models: runtime/engine/decode_chain.py decides which model and
cache can take it and hands over the weights.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import c_float, c_int32, c_int64, c_void_p
from dataclasses import dataclass

import torch

from lowbit.kernels import cpu_f32, cpu_int4dot, cpu_int8
from lowbit.kernels.prepared import PreparedWeight
from lowbit.native import decode_layers, f32_dot, int4_dot, int4_vnni, int8_gemv, moe_route, paged_decode, rowops

MAX_ROPES = 4  # decode_layers.c MAX_ROPES
# "0": every kernel of a step opens its own OpenMP region, as before the one-region step (run_layers
# in native/decode_layers.c); the same bits either way, so this is for measuring it and for the tests
TEAM_ENV = "LOWBIT_CHAIN_TEAM"
_INT4, _DENSE, _INT8F = 1, 2, 3


class ChainLinear(ctypes.Structure):
    _fields_ = [("kind", c_int32), ("pad", c_int32), ("fn", c_void_p), ("w", c_void_p), ("bias", c_void_p),
                ("n", c_int64), ("k", c_int64), ("ldw", c_int64), ("scales", c_void_p), ("groups", c_int64),
                ("group", c_int64), ("packed_fn", c_void_p), ("packed", c_void_p), ("packed_rows", c_int64)]


class ChainMLP(ctypes.Structure):
    _fields_ = [("gate_up", ChainLinear), ("down", ChainLinear)]


class ChainMoE(ctypes.Structure):
    _fields_ = [("router", c_void_p), ("experts", c_int64), ("top_k", c_int64), ("norm_topk", c_int32), ("pad", c_int32),
                ("expert", c_void_p), ("shared", c_void_p), ("shared_gate", c_void_p)]


class ChainLayer(ctypes.Structure):
    _fields_ = [("norm_in", c_void_p), ("norm_mlp", c_void_p), ("qkv", ChainLinear), ("o", ChainLinear),
                ("mlp", ChainMLP), ("moe", c_void_p), ("kpool", c_void_p), ("vpool", c_void_p),
                ("window", c_int64), ("rope", c_int64), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("q_norm_width", c_int64), ("k_norm_width", c_int64), ("post_attn", c_void_p), ("post_ffn", c_void_p)]


class Chain(ctypes.Structure):
    _fields_ = [("rmsnorm", c_void_p), ("add_rmsnorm", c_void_p), ("act_mul", c_void_p), ("moe_route", c_void_p), ("moe_shared_gate", c_void_p),
                ("layers", c_void_p), ("n_layers", c_int64), ("hidden", c_int64), ("heads", c_int64),
                ("kv_heads", c_int64), ("head_dim", c_int64), ("inter", c_int64), ("max_top_k", c_int64),
                ("block_size", c_int64), ("eps", c_float), ("scale", c_float), ("unit_offset", c_int32), ("act", c_int32),
                ("pool_bf16", c_int32), ("team", c_int32), ("paged_write", c_void_p), ("paged_attend", c_void_p)]


class ChainStep(ctypes.Structure):
    _fields_ = [("rows", c_int64), ("nb", c_int64), ("pos", c_void_p), ("slots", c_void_p), ("items", c_void_p),
                ("tables", c_void_p), ("cos_table", c_void_p * MAX_ROPES), ("sin_table", c_void_p * MAX_ROPES),
                ("table_rows", c_int64),
                ("ids", c_void_p), ("embed", c_void_p), ("embed_rows", c_int64), ("embed_bf16", c_int32),
                ("embed_scale", c_float), ("embed_scales", c_void_p), ("embed_group", c_int64), ("embed_scale_dtype", c_int32),
                ("embed_bits", c_int32), ("embed_zeros", c_void_p)]


class ChainRescore(ctypes.Structure):
    _fields_ = [("top_rows", c_void_p), ("rescore_rows", c_void_p), ("exact", c_void_p), ("exact_bf16", c_int32),
                ("pad", c_int32), ("vocab", c_void_p), ("bias", c_void_p), ("top", c_int64)]


def entry(lib, name: str) -> int:
    """The address of a library function (what a C struct of function pointers holds)."""
    return ctypes.cast(getattr(lib, name), c_void_p).value


def available() -> bool:
    return all(lib() is not None for lib in (decode_layers.library, rowops.library, paged_decode.library))


@dataclass(slots=True)
class Linear:
    """One projection as the chain calls it; `keep` holds what its pointers point into; `max_rows`
    the most rows its path runs on this kernel (None: any)."""

    struct: ChainLinear
    keep: object
    max_rows: int | None = None


def quantized_linear(pw: PreparedWeight) -> Linear | None:
    """A prepared weight on cpu-int4dot, cpu-int8dot or cpu-int8f, or None for any other path."""
    return int4_linear(pw) if pw.path in (cpu_int4dot.PATH, cpu_int4dot.INT8_PATH) else int8_linear(pw)


def int8_linear(pw: PreparedWeight) -> Linear | None:
    """A cpu-int8f prepared weight (grouped ones only up to the rows cpu_int8.matmul runs in C)."""
    if pw.path != cpu_int8.PATH or not cpu_int8.available():
        return None
    n, k = pw.shape
    codes, scales, params = pw.tensors["codes"], pw.tensors["scales"], pw.params
    struct = ChainLinear(_INT8F, 0, entry(int8_gemv.library(), "lowbit_int8f_matmul"), codes.data_ptr(), None, n, k,
                         codes.stride(0), scales.data_ptr(), params["groups"], params["group"])
    return Linear(struct, pw, cpu_int8.GROUPED_KERNEL_ROWS if params["groups"] > 1 else None)


def int4_linear(pw: PreparedWeight) -> Linear | None:
    """A cpu-int4dot prepared weight (either activation route) or a cpu-int8dot one (8-bit codes on
    the same int8-activation kernel), or None for any other path."""
    if pw.path not in (cpu_int4dot.PATH, cpu_int4dot.INT8_PATH) or not cpu_int4dot.available():
        return None
    lib, name = (int4_vnni.library(), "lowbit_i4v_matmul") if pw.params["act"] == "int8" else (int4_dot.library(), "lowbit_i4_matmul")
    n, k = pw.shape
    return Linear(ChainLinear(_INT4, 0, entry(lib, name), ctypes.addressof(pw.params["struct"]), None, n, k, 0), pw)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, bf16_x: bool = False, packed=None) -> Linear | None:
    """A float32 or bf16-stored weight [N, K] (+ float32 bias) on f32_dot.c, as InvariantLinear runs
    it for float32 rows (bf16_x: a bf16 weight whose rows of x are rounded to bf16 first,
    `--dense-activations bf16`; packed: its packed copy, kernels/cpu_bf16pack.py, read by steps of
    up to cpu_f32.PACKED_MAX_ROWS rows as InvariantLinear reads it); None where InvariantLinear
    would not call that kernel."""
    if not cpu_f32.available() or weight.device.type != "cpu" or weight.stride(-1) != 1 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    n, k = weight.shape
    struct = ChainLinear(_DENSE, 0, entry(f32_dot.library(), cpu_f32.kernel_name(weight.dtype, bf16_x)), weight.data_ptr(),
                         None if bias is None else bias.data_ptr(), n, k, weight.stride(0))
    if packed is not None:
        struct.packed_fn = entry(f32_dot.library(), "lowbit_bf16pxw_matmul")
        struct.packed, struct.packed_rows = ctypes.addressof(packed.struct), cpu_f32.PACKED_MAX_ROWS
    return Linear(struct, (weight, bias, packed))


@dataclass(slots=True)
class Rescore:
    """A draft head's rescoring as the several-step call runs it after the quantized head (rowops.c
    lowbit_top_rows and lowbit_rescore_rows, runtime/engine/draft_models.py RescoredHead's calls):
    each row's `top` best get exact[id] . x (+ bias[id]), id = vocab[index] where the head scores
    part of the vocabulary; `keep` holds the tensors its struct points into."""

    struct: ChainRescore
    keep: object


def rescore(exact: torch.Tensor, vocab: torch.Tensor | None, bias: torch.Tensor | None, top: int) -> Rescore | None:
    """The struct for a float head [vocab size, K] (float32 or bf16, contiguous, CPU), its scored
    token ids (int64, ascending) and bias (float32), or None where rowops.c does not take them."""
    lib = rowops.library()
    if (lib is None or exact.dtype not in (torch.float32, torch.bfloat16) or not exact.is_contiguous() or not exact.is_cpu
            or vocab is not None and (vocab.dtype is not torch.long or not vocab.is_contiguous())
            or bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous())):
        return None
    struct = ChainRescore(entry(lib, "lowbit_top_rows"), entry(lib, "lowbit_rescore_rows"), exact.data_ptr(),
                          int(exact.dtype is torch.bfloat16), 0, _ptr(vocab), _ptr(bias), top)
    return Rescore(struct, (exact, vocab, bias))


@dataclass(slots=True)
class MLPSpec:
    """A gated MLP: gate|up joined [2I, hidden], down [hidden, I]."""

    gate_up: Linear
    down: Linear

    def struct(self) -> ChainMLP:
        return ChainMLP(self.gate_up.struct, self.down.struct)

    @property
    def inter(self) -> int:
        return self.gate_up.struct.n // 2

    def linears(self) -> tuple[Linear, Linear]:
        return self.gate_up, self.down


@dataclass(slots=True)
class MoESpec:
    """A sparse MoE block: router [experts, hidden] float32, one MLP per expert, top_k and
    renormalization as the model routes; optionally a shared expert and its gate weight [hidden]."""

    router: torch.Tensor
    experts: list[MLPSpec]
    top_k: int
    norm_topk: bool
    shared: MLPSpec | None = None
    shared_gate: torch.Tensor | None = None

    def mlps(self) -> list[MLPSpec]:
        return self.experts + ([self.shared] if self.shared is not None else [])


@dataclass(slots=True)
class ChainLayerSpec:
    """One decoder layer; norms are float32 weights [width] sharing the chain's eps and offset rule."""

    norm_in: torch.Tensor  # before attention
    norm_mlp: torch.Tensor  # before the MLP
    qkv: Linear
    o: Linear
    mlp: MLPSpec | MoESpec
    key_pool: torch.Tensor  # [slots, kv_heads, head_dim] float32, or bf16 (every layer's alike)
    value_pool: torch.Tensor
    window: int | None
    rope: int  # index into the step's cos/sin tables
    q_norm: torch.Tensor | None = None  # per head ([head_dim]) or over the whole projection
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # Gemma's norms of the attention and MLP outputs
    post_ffn: torch.Tensor | None = None


@dataclass(slots=True)
class Embedding:
    """The rows a step embeds itself: token ids [T] int64 into table [V, hidden] (float32 or bf16,
    contiguous), each row times scale (a float32 value, 1.0 for none). With `scales`, table holds
    int8 or int4 codes as quant/intq.py stores them (`bits`), scales [V, ceil(hidden / group)]
    (float32, bf16 or float16) their groups' scales and `zeros` (uint8, same shape, or None:
    symmetric) their zero points: a row is (code - zero) * scale in float32, as intq dequantizes it."""

    ids: torch.Tensor | None  # set per step
    table: torch.Tensor
    scale: float = 1.0
    scales: torch.Tensor | None = None
    group: int = 0
    bits: int = 8
    zeros: torch.Tensor | None = None


_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # ChainStep.embed_scale_dtype


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeChain:
    """Layers of one model as decode_layers.c runs them. Dimensions: hidden, heads, kv_heads,
    head_dim; eps and unit_offset of every norm; act 0 silu, 1 gelu_tanh (every MLP's)."""

    def __init__(self, layers: list[ChainLayerSpec], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, eps: float, unit_offset: bool, act: int, scale: float):
        self._keep = layers
        self._layers = (ChainLayer * len(layers))()
        self._moe = []  # the C structs of MoE blocks (and their expert arrays), alive as long as the chain
        mlps: list[MLPSpec] = []
        top_k = 0
        for slot, spec in zip(self._layers, layers):
            slot.norm_in, slot.norm_mlp = spec.norm_in.data_ptr(), spec.norm_mlp.data_ptr()
            slot.qkv, slot.o = spec.qkv.struct, spec.o.struct
            if isinstance(spec.mlp, MoESpec):
                slot.moe = self._moe_struct(spec.mlp)
                mlps += spec.mlp.mlps()
                top_k = max(top_k, spec.mlp.top_k)
            else:
                slot.mlp = spec.mlp.struct()
                mlps.append(spec.mlp)
            slot.kpool, slot.vpool = spec.key_pool.data_ptr(), spec.value_pool.data_ptr()
            slot.window, slot.rope = spec.window or 0, spec.rope
            slot.q_norm, slot.k_norm = _ptr(spec.q_norm), _ptr(spec.k_norm)
            slot.q_norm_width = 0 if spec.q_norm is None else spec.q_norm.numel()
            slot.k_norm_width = 0 if spec.k_norm is None else spec.k_norm.numel()
            slot.post_attn, slot.post_ffn = _ptr(spec.post_attn), _ptr(spec.post_ffn)
        rows = rowops.library()
        paged = paged_decode.library()
        route = moe_route.library() if top_k else None
        self._chain = Chain(
            entry(rows, "lowbit_rmsnorm"), entry(rows, "lowbit_add_rmsnorm"), entry(rows, "lowbit_act_mul"),
            route and entry(route, "lowbit_moe_route"), route and entry(route, "lowbit_moe_shared_gate"),
            ctypes.addressof(self._layers), len(layers), hidden, heads, kv_heads, head_dim, max(m.inter for m in mlps), top_k,
            block_size, eps, scale, int(unit_offset), act, int(layers[0].key_pool.dtype == torch.bfloat16),
            int(os.environ.get(TEAM_ENV, "1") != "0"), entry(paged, "lowbit_paged_write"), entry(paged, "lowbit_paged_attend"))
        if any(spec.key_pool.dtype != layers[0].key_pool.dtype or spec.value_pool.dtype != layers[0].key_pool.dtype
               or spec.key_pool.dtype not in (torch.float32, torch.bfloat16) for spec in layers):
            raise ValueError("the chain's KV pools must all be float32 or all bf16")
        self._run = decode_layers.library().lowbit_decode_layers
        self.num_layers = len(layers)
        self.hidden = hidden
        linears = [lin for spec in layers for lin in (spec.qkv, spec.o)] + [lin for m in mlps for lin in m.linears()]
        limits = [lin.max_rows for lin in linears if lin.max_rows]
        self.max_rows = min(limits) if limits else None  # a step of more rows takes the Python path

    def _moe_struct(self, moe: MoESpec) -> int:
        experts = (ChainMLP * len(moe.experts))(*(m.struct() for m in moe.experts))
        shared = moe.shared.struct() if moe.shared is not None else None
        block = ChainMoE(moe.router.data_ptr(), len(moe.experts), moe.top_k, int(moe.norm_topk), 0, ctypes.addressof(experts),
                         None if shared is None else ctypes.addressof(shared), _ptr(moe.shared_gate))
        self._moe += [experts, shared, block]
        return ctypes.addressof(block)

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, items: torch.Tensor, tables: torch.Tensor,
            cos: list[torch.Tensor], sin: list[torch.Tensor], final_norm: torch.Tensor | None,
            first: int = 0, last: int | None = None, *, embed: Embedding | None = None) -> torch.Tensor:
        """x [T, hidden] float32 rows (the embeddings; updated in place to the residual stream) ->
        final_norm(stream) [T, hidden], or x itself without a final norm. positions, slots, items
        [T] and tables [B, blocks] int64 as paged_attention.DecodeIndex has them; cos/sin per
        rotary, whole float32 tables [positions, head_dim / 2] (contiguous) the step indexes by
        `positions` itself. With `embed`, x is only storage: the step fills it with the rows'
        embeddings first."""
        step = _step(x.shape[0], positions, slots, items, tables, cos, sin, embed)
        out = x if final_norm is None else torch.empty_like(x)
        rc = self._run(ctypes.byref(self._chain), ctypes.byref(step), first, self.num_layers if last is None else last,
                       x.data_ptr(), None if final_norm is None else final_norm.data_ptr(), out.data_ptr(),
                       torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"lowbit_decode_layers failed with code {rc}")
        return out

    def run_steps(self, steps: int, positions: torch.Tensor, slots: torch.Tensor, items: torch.Tensor, tables: torch.Tensor,
                  cos: list[torch.Tensor], sin: list[torch.Tensor], final_norm: torch.Tensor, embed: Embedding,
                  head: Linear, screen=None, rescore: Rescore | None = None) -> tuple[torch.Tensor, int]:
        """`steps` greedy decode steps of the same T rows in one C call (native/decode_layers.c
        lowbit_decode_steps): positions and slots [steps, T] int64, each step's rows as `run` takes
        them; embed.ids [T] the first step's tokens, the later steps' those the step before chose
        (the first index of each row's largest logit of `head`, a projection [V, hidden] as the
        model's lm_head runs it; through `screen`, kernels/screened_head.py, where given: the same
        tokens; `rescore`: a draft head's candidates rescored first). Returns the chosen tokens
        [steps, T] and how many steps gave finite logits: fewer than `steps` (the rows after it
        unset) means NaN or inf logits."""
        t = positions.shape[1]
        step = _step(t, positions[0], slots[0], items, tables, cos, sin, embed)
        tokens = torch.empty(steps, t, dtype=torch.long)
        x, hidden = torch.empty(t, self.hidden), torch.empty(t, self.hidden)
        logits = torch.empty(t, head.struct.n)
        done = c_int64(0)
        rc = decode_layers.library().lowbit_decode_steps(
            ctypes.byref(self._chain), ctypes.byref(step), ctypes.byref(head.struct),
            None if screen is None else ctypes.byref(screen.struct), None if rescore is None else ctypes.byref(rescore.struct),
            entry(rowops.library(), "lowbit_logit_rows"),
            steps, positions.data_ptr(), slots.data_ptr(), tokens.data_ptr(), final_norm.data_ptr(), x.data_ptr(),
            hidden.data_ptr(), logits.data_ptr(), ctypes.byref(done), torch.get_num_threads())
        if rc not in (0, -5):
            raise RuntimeError(f"lowbit_decode_steps failed with code {rc}")
        return tokens, done.value


def _step(t: int, positions: torch.Tensor, slots: torch.Tensor, items: torch.Tensor, tables: torch.Tensor,
          cos: list[torch.Tensor], sin: list[torch.Tensor], embed: Embedding | None) -> ChainStep:
    """The C struct of one step of t rows (DecodeChain.run's arguments); valid while they live."""
    step = ChainStep(t, tables.shape[1], positions.data_ptr(), slots.data_ptr(), items.data_ptr(), tables.data_ptr())
    for i, (c, s) in enumerate(zip(cos, sin)):
        step.cos_table[i], step.sin_table[i] = c.data_ptr(), s.data_ptr()
    step.table_rows = min(table.shape[0] for table in cos + sin)
    if embed is not None:
        step.ids, step.embed, step.embed_rows = embed.ids.data_ptr(), embed.table.data_ptr(), embed.table.shape[0]
        step.embed_bf16, step.embed_scale = int(embed.table.dtype == torch.bfloat16), embed.scale
        if embed.scales is not None:
            step.embed_scales, step.embed_group = embed.scales.data_ptr(), embed.group
            step.embed_scale_dtype = _SCALE_DTYPES[embed.scales.dtype]
            step.embed_bits, step.embed_zeros = embed.bits, _ptr(embed.zeros)
    return step
