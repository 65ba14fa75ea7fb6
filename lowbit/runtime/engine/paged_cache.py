"""The paged KV cache tensors and the varlen attention that reads them.

One pool per layer holds every sequence's keys (and one its values) as `num_blocks * block_size`
token slots of [kv_heads, head_dim]; token p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` (block_manager.py owns the tables).
A step runs all scheduled sequences as ONE flattened batch [1, T] (model forward unchanged);
`runtime.attention.attend` hands each layer's (q, k, v) to `PagedKVCache.attend` (the
`AttentionCache` interface, runtime/attention.py), which writes
k, v into the pool at the step's slot mapping and attends per sequence:

- on the CPU with a bf16/float32 pool (`fused_decode`), every item, prefill chunks included, in
  one C call per layer that rotates, writes and attends row by row (`rotate_and_attend`);
- otherwise short items (decodes, speculative verifies, draft catch-ups: <= SHORT_QUERY tokens) in one
  padded batch: gather each sequence's context slots, one SDPA call with a [B, q, ctx] mask
  (causal by position, context length, sliding window). On CUDA a pure-decode batch uses the
  Triton kernel (triton_paged.py), which reads the blocks in place;
- prefill chunks one by one, tiled over query chunks of PREFILL_TILE (attention.py's
  `prefill_attention`), so no N x N score matrix is ever formed.

Quantized KV (`kv_dtype` "int8" or "fp8"): values are stored with one float32 scale per token
and kv head (absmax / qmax), and dequantized when gathered. `kv_dtype` "bf16" under a float32
model stores keys and values rounded to bf16 (half the bytes a long context reads at every step,
as llama.cpp's default f16 cache; the fused CPU kernel reads them widened exactly against float32
queries); under a bf16 model it is the default pool itself.
"""

from __future__ import annotations

from functools import partial

import torch

from lowbit.errors import UsageError
from lowbit.kernels import hugepages
from lowbit.runtime.attention import AttentionCache
from lowbit.runtime.config import ModelConfig
from lowbit.runtime.engine import paged_attention as pa

KV_DTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
FLOAT_KV_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}  # a float pool of its own dtype: no scales
AUTO = "auto"


def check_kv_dtype(kv_dtype: str | None) -> None:
    """A one-line usage error for a --kv-dtype this cache does not store."""
    if kv_dtype not in (None, AUTO) and kv_dtype not in KV_DTYPES and kv_dtype not in FLOAT_KV_DTYPES:
        raise UsageError(f"unknown KV cache dtype '{kv_dtype}' "
                         f"(choose from {', '.join([AUTO, *FLOAT_KV_DTYPES, *KV_DTYPES])})")


def resolve_kv_dtype(kv_dtype: str | None, dtype: torch.dtype, device: torch.device, config: ModelConfig) -> str | None:
    """--kv-dtype as the engine's cache stores it: None (or "auto") is the dtype the checkpoint was
    saved in where that is bf16 and the model computes in float32 on a CPU, else the compute dtype's
    own pool (None). vLLM's "auto" is the model's dtype and llama.cpp's default cache is f16: a bf16
    checkpoint's float32 cache held twice their bytes, and at depth attention reads all of them every
    step (SmolLM2 int4 beside llama.cpp at 1024 positions: 1.16x with float32 keys and values, 1.41x
    with bf16; docs/kv-cache.md). Only the CPU's fused attention is measured with a bf16 pool under a
    float32 model, so elsewhere auto keeps the compute dtype. "f32" asks for the float32 pool."""
    check_kv_dtype(kv_dtype)
    if kv_dtype in (None, AUTO):
        stored_bf16 = config.stored_dtype == "bfloat16"
        return "bf16" if stored_bf16 and dtype == torch.float32 and torch.device(device).type == "cpu" else None
    if kv_dtype == "f32" and dtype != torch.float32:
        raise UsageError(f"--kv-dtype f32 needs a float32 model (--dtype f32); this one computes in "
                         f"{str(dtype).removeprefix('torch.')}")
    return kv_dtype


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_dtype: str | None = None) -> int:
    """Bytes one token's keys and values take over all layers (scales included)."""
    if kv_dtype in FLOAT_KV_DTYPES:
        dtype, kv_dtype = FLOAT_KV_DTYPES[kv_dtype], None
    per_head = config.head_dim * (dtype.itemsize if kv_dtype is None else 1) + (0 if kv_dtype is None else 4)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


class PagedKVCache(AttentionCache):
    """The engine's cache: steps are one flattened sequence (`flat_rows`), so the model hands it rows
    and tries `rotate_and_attend` (the fused CPU decode kernel) before `attend`. `length` stays 0
    and check_room/advance do nothing: positions come from the step's metadata (`meta`)."""

    flat_rows = True

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_dtype: str | None = None):
        check_kv_dtype(kv_dtype)
        if kv_dtype in FLOAT_KV_DTYPES and FLOAT_KV_DTYPES[kv_dtype] == dtype:
            kv_dtype = None  # the model's own dtype: the plain pool
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        slots = num_blocks * block_size
        # fp8 is stored as its bytes: CPU index ops do not take float8 tensors
        self.store_dtype = store = (dtype if kv_dtype is None else FLOAT_KV_DTYPES[kv_dtype] if kv_dtype in FLOAT_KV_DTYPES
                                    else torch.int8 if kv_dtype == "int8" else torch.uint8)
        self.quantized = kv_dtype in KV_DTYPES
        shape = (slots, self.kv_heads, self.head_dim)
        n = config.num_hidden_layers
        # on CPU, zeros whose pages appear as blocks are first written (hugepages.lazy_zeros): the
        # default cache is sized for many long sequences, most of it never touched
        zeros = hugepages.lazy_zeros if self.device.type == "cpu" else partial(torch.zeros, device=self.device)
        self.keys = [zeros(shape, dtype=store) for _ in range(n)]
        self.values = [zeros(shape, dtype=store) for _ in range(n)]
        if not self.quantized:
            self.key_scales = self.value_scales = None
        else:
            sshape = (slots, self.kv_heads, 1)
            self.key_scales = [torch.ones(sshape, device=self.device) for _ in range(n)]
            self.value_scales = [torch.ones(sshape, device=self.device) for _ in range(n)]
        self.meta: pa.StepMetadata | None = None  # set by the runner before each forward
        from lowbit.kernels.cpu_attention import supported

        # Whether kernels/cpu_attention.py can run this cache's decode steps (the runner then plans
        # steps of short items for it, and `rotate_and_attend` takes them).
        self.fused_decode: bool = (self.device.type == "cpu" and not self.quantized and supported(dtype, self.head_dim)
                                   and (store == dtype or dtype == torch.float32))

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        if self.key_scales is not None:
            total += sum(t.numel() * t.element_size() for t in self.key_scales + self.value_scales)
        return total

    def touch(self, blocks: int) -> None:
        """Write the first `blocks` blocks of every layer so their pages exist before a timed run.
        The pool's pages appear on first write (lazy_zeros; a 2 MB huge page took ~2 ms to fault in
        this VM), and the block manager hands out the lowest never-used block when its stack of
        released ones is empty, so blocks 0..n-1 are the ones any run of n blocks writes. llama.cpp
        clears its whole KV buffer when it creates it; a server's pool is written once and reused."""
        slots = min(blocks, self.num_blocks) * self.block_size
        for t in self.keys + self.values:
            t[:slots].mul_(1)  # a write that keeps every bit (a cached prefix stays valid)

    # check_room / advance: AttentionCache's no-ops (the block manager owns the room).

    # -- writing and reading -----------------------------------------------------------------
    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, D] into the pool at slots [T]."""
        if not self.quantized:
            self.keys[layer].index_copy_(0, slots, k.to(self.store_dtype))
            self.values[layer].index_copy_(0, slots, v.to(self.store_dtype))
            return
        store, qmax = KV_DTYPES[self.kv_dtype]
        for pool, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            x = x.float()
            scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / qmax
            q = x / scale
            q = q.round().clamp(-qmax, qmax).to(store) if store == torch.int8 else q.to(store).view(torch.uint8)
            pool[layer].index_copy_(0, slots, q)
            scales[layer].index_copy_(0, slots, scale)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at slots [...] -> [..., kv_heads, D] in the model dtype."""
        k, v = self.keys[layer][slots], self.values[layer][slots]
        if not self.quantized:
            return k.to(self.dtype), v.to(self.dtype)  # (no copy when the pool is the model's dtype)
        if self.kv_dtype == "fp8":
            k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
        return ((k.float() * self.key_scales[layer][slots]).to(self.dtype),
                (v.float() * self.value_scales[layer][slots]).to(self.dtype))

    def rotate_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor | None:
        """The fused CPU path (every step, where `fused_decode`): q [T, H*D], k/v [T, kvh*D] before RoPE,
        cos/sin [.., T, D/2] -> out [T, H*D]; None when this step or cache cannot use it."""
        meta = self.meta
        if meta is None or meta.decode is None or self.quantized or not self.fused_decode:
            return None
        if q.dtype != self.dtype or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return None
        from lowbit.kernels.cpu_attention import paged_decode

        d = meta.decode
        cos = cos.reshape(-1, cos.shape[-1]).contiguous()
        sin = sin.reshape(-1, sin.shape[-1]).contiguous()
        return paged_decode(q, k, v, cos, sin, d.positions, meta.slot_mapping, d.items, d.tables,
                            self.keys[layer], self.values[layer], self.block_size, window, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
               window: int | None) -> torch.Tensor:
        """q [1, H, T, D], new k/v [1, kv_heads, T, D] of the flattened step -> out [1, H, T, D]."""
        meta = self.meta
        if isinstance(meta.short, pa._LazyShort):
            meta.short = meta.short.get()
        qt = q[0].transpose(0, 1)  # [T, H, D]
        kt = k[0].transpose(0, 1)
        vt = v[0].transpose(0, 1)
        self._write(layer, kt, vt, meta.slot_mapping)
        if meta.short is not None and not meta.prefills and meta.short.identity:
            out = pa.short_attention(self, layer, qt, meta.short, scale, window)  # already [T, H, D]
        else:
            out = torch.empty_like(qt)
            if meta.short is not None:
                out[meta.short.token_index] = pa.short_attention(self, layer, qt, meta.short, scale, window)
            for item in meta.prefills:
                rows = slice(item.token_start, item.token_start + item.num_tokens)
                new_kv = None if self.quantized or self.store_dtype != self.dtype else (kt[rows], vt[rows])
                out[rows] = pa.prefill_attention(self, layer, qt[rows], item, scale, window, new_kv)
        return out.transpose(0, 1).unsqueeze(0)
