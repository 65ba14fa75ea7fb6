"""Varlen attention over the paged KV pool: the per-step plan and the two CPU/torch paths.

`build_metadata` turns the step's items (block table, first position, token count) into index
tensors once per step; every layer then calls `short_attention` (decodes and other short items,
batched and padded) and `prefill_attention` (one prefill chunk, tiled over queries) through
`PagedKVCache.attend`. Grouped-query attention is computed without repeating K/V: the `group`
query heads that share a kv head are folded into the query-length axis, so one SDPA call sees
q [B, kv_heads, group * q_len, D] against K [B, kv_heads, ctx, D].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SHORT_QUERY = 8  # items with at most this many new tokens join the padded batch
PREFILL_TILE = 256  # query rows per SDPA call in a prefill: scores are TILE x context, never N x N


@dataclass(slots=True)
class ShortBatch:
    q_index: torch.Tensor  # [B, Q] rows of the flattened step (padding repeats row 0)
    q_pos: torch.Tensor  # [B, Q] positions (padding: 0)
    k_slots: torch.Tensor  # [B, L] context slots (padding: slot 0, masked)
    token_index: torch.Tensor  # [valid] flattened rows of the valid (b, q) pairs
    valid_rows: torch.Tensor  # [valid] indices into the [B * Q] padded rows
    identity: bool  # one token per item and the items are the whole step, in order
    block_tables: torch.Tensor | None = None  # [B, blocks] int32, for the Triton decode kernel
    context_lens: torch.Tensor | None = None  # [B] int32
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, group: int) -> torch.Tensor:
        """[B, 1, group * Q, L]: query (b, q) sees key j when j <= its position, within the window."""
        key = (window, group)
        if key not in self._masks:
            B, Q = self.q_pos.shape
            L = self.k_slots.shape[1]
            k_pos = torch.arange(L, device=self.q_pos.device)
            q_pos = self.q_pos[:, :, None]
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            self._masks[key] = allowed[:, None].expand(B, group, Q, L).reshape(B, 1, group * Q, L)
        return self._masks[key]


@dataclass(slots=True)
class PrefillItem:
    token_start: int  # first row in the flattened step
    num_tokens: int
    start: int  # position of the first token
    ctx_slots: torch.Tensor  # [start + num_tokens] slots of positions 0 .. end-1


@dataclass(slots=True)
class DecodeIndex:
    """Per-row index tensors of a step made only of short items, for the fused CPU kernel."""

    positions: torch.Tensor  # [T] int64
    items: torch.Tensor  # [T] int64: row of `tables`
    tables: torch.Tensor  # [B, blocks] int64 block tables (padded with 0)


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each flattened token
    short: ShortBatch | None = None
    prefills: list[PrefillItem] = field(default_factory=list)
    decode: DecodeIndex | None = None  # CPU steps of short items only


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def decode_index(items: list[tuple[list[int], int, int]], block_size: int) -> DecodeIndex:
    positions: list[int] = []
    rows: list[int] = []
    tables = []
    for b, (block_table, start, n) in enumerate(items):
        positions += range(start, start + n)
        rows += [b] * n
        tables.append(block_table[: -(-(start + n) // block_size)])
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return DecodeIndex(torch.tensor(positions, dtype=torch.long), torch.tensor(rows, dtype=torch.long),
                       torch.tensor(padded, dtype=torch.long))


def decode_steps_metadata(items: list[tuple[list[int], int]], steps: int, block_size: int
                          ) -> tuple[StepMetadata, torch.Tensor, torch.Tensor]:
    """Metadata of `steps` decode steps of one row per (block_table, start) item, row b at
    position start + i in step i: the first step's StepMetadata (its block tables cover every
    step's positions) and the positions and slots [steps, rows] of all of them."""
    positions = torch.tensor([[start + i for _, start in items] for i in range(steps)], dtype=torch.long)
    slots = torch.tensor([[_slots(bt, start + i, start + i + 1, block_size)[0] for bt, start in items] for i in range(steps)],
                         dtype=torch.long)
    # the tables as a step of `steps` tokens per item has them: every later step's block included
    tables = decode_index([(bt, start, steps) for bt, start in items], block_size).tables
    index = DecodeIndex(positions[0].clone(), torch.arange(len(items), dtype=torch.long), tables)
    return StepMetadata(slots[0].clone(), decode=index), positions, slots


def build_metadata(items: list[tuple[list[int], int, int]], block_size: int, device: torch.device,
                   with_block_tables: bool = False, fused_decode: bool = False) -> StepMetadata:
    """items: (block_table, start, num_tokens) per scheduled sequence, in flattened order.
    fused_decode: the cache can run kernels/cpu_attention.py (its `short` is then built lazily)."""
    if fused_decode and device.type == "cpu" and items:
        # The fused CPU kernel takes every item, prefill chunks too: each row attends alone, with
        # a decode's very arithmetic, and the step stays one call per layer (and on the one-call
        # step where the model has one). SmolLM2 on 2 Zen 4 cores, against prefill chunks through
        # torch's SDPA layer by layer: 94-token prompts 12-20 % faster, 512 tokens 10-20 %, 2000
        # tokens (four chunks) the same. It needs only per-row positions, slots and block tables
        # (the padded SDPA batch is built lazily if a layer falls back to it).
        slots = [s for bt, start, n in items for s in _slots(bt, start, start + n, block_size)]
        meta = StepMetadata(torch.tensor(slots, dtype=torch.long), decode=decode_index(items, block_size))
        meta.short = _LazyShort(items, block_size, device)
        return meta
    slot_list: list[int] = []
    short: list[tuple[int, list[int], int, int]] = []
    prefills: list[PrefillItem] = []
    row = 0
    for block_table, start, n in items:
        end = start + n
        if n <= SHORT_QUERY:
            slot_list += _slots(block_table, start, end, block_size)
            short.append((row, block_table, start, n))
        else:
            bt = torch.tensor(block_table[: -(-end // block_size)], dtype=torch.long)
            ctx = (bt[:, None] * block_size + torch.arange(block_size)).flatten()[:end]
            slot_list += ctx[start:].tolist()
            prefills.append(PrefillItem(row, n, start, ctx.to(device)))
        row += n
    meta = StepMetadata(torch.tensor(slot_list, dtype=torch.long, device=device), prefills=prefills)
    if short:
        meta.short = _short_batch(short, block_size, device, identity=not prefills and row == len(short),
                                  with_block_tables=with_block_tables)
    return meta


class _LazyShort:
    """Builds the padded ShortBatch on first use (only layers the fused kernel cannot run need it)."""

    def __init__(self, items, block_size, device):
        self._args = (items, block_size, device)
        self._batch = None

    def get(self) -> ShortBatch:
        if self._batch is None:
            items, block_size, device = self._args
            short, row = [], 0
            for bt, start, n in items:
                short.append((row, bt, start, n))
                row += n
            self._batch = _short_batch(short, block_size, device, identity=True, with_block_tables=False)
        return self._batch


def _short_batch(short, block_size: int, device, identity: bool, with_block_tables: bool) -> ShortBatch:
    Q = max(n for _, _, _, n in short)
    ctx_lens = [start + n for _, _, start, n in short]
    L = max(ctx_lens)
    nb = -(-L // block_size)
    tables = [bt[: -(-c // block_size)] for (_, bt, _, _), c in zip(short, ctx_lens)]
    tables = [t + [0] * (nb - len(t)) for t in tables]
    bt = torch.tensor(tables, dtype=torch.long)
    k_slots = (bt[:, :, None] * block_size + torch.arange(block_size)).view(len(short), -1)[:, :L]
    q_index, q_pos, token_index, valid_rows = [], [], [], []
    for b, (row, _, start, n) in enumerate(short):
        q_index.append([row + i for i in range(n)] + [row] * (Q - n))
        q_pos.append(list(range(start, start + n)) + [0] * (Q - n))
        token_index += range(row, row + n)
        valid_rows += range(b * Q, b * Q + n)
    sb = ShortBatch(
        q_index=torch.tensor(q_index, dtype=torch.long).to(device),
        q_pos=torch.tensor(q_pos, dtype=torch.long).to(device),
        k_slots=k_slots.to(device),
        token_index=torch.tensor(token_index, dtype=torch.long).to(device),
        valid_rows=torch.tensor(valid_rows, dtype=torch.long).to(device),
        identity=identity and Q == 1,
    )
    if with_block_tables:
        sb.block_tables = bt.to(device=device, dtype=torch.int32)
        sb.context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return sb


def short_attention(cache, layer: int, qt: torch.Tensor, sb: ShortBatch, scale: float,
                    window: int | None) -> torch.Tensor:
    """qt [T, H, D] of the whole step -> [valid, H, D] for the short items' rows (token_index
    order), or [T, H, D] directly when `sb.identity`."""
    B, Q = sb.q_index.shape
    H, D = qt.shape[1], qt.shape[2]
    kvh = cache.kv_heads
    g = H // kvh
    if Q == 1 and sb.block_tables is not None and qt.is_cuda:
        from lowbit.kernels import triton_paged

        q1 = qt if sb.identity else qt[sb.q_index[:, 0]]
        out = triton_paged.paged_decode(q1, cache, layer, sb.block_tables, sb.context_lens, scale, window)
        return out
    qs = qt.view(B, 1, H, D) if sb.identity else qt[sb.q_index]  # [B, Q, H, D]
    qs = qs.view(B, Q, kvh, g, D).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * Q, D)
    k, v = cache.gather(layer, sb.k_slots)  # [B, L, kvh, D]
    o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=sb.mask(window, g), scale=scale)
    o = o.view(B, kvh, g, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D)
    return o if sb.identity else o[sb.valid_rows]


def prefill_attention(cache, layer: int, q: torch.Tensor, item: PrefillItem, scale: float, window: int | None,
                      new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [n, H, D] of one prefill chunk -> [n, H, D], tiled over PREFILL_TILE query rows.

    new_kv: the chunk's own k, v [n, kv_heads, D], usable instead of a gather when the chunk
    starts at position 0 (nothing cached before it)."""
    n, s = item.num_tokens, item.start
    if new_kv is not None and s == 0:
        k, v = new_kv
    else:
        k, v = cache.gather(layer, item.ctx_slots)
    k = k.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, D]
    v = v.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for c0 in range(0, n, PREFILL_TILE):
        c1 = min(n, c0 + PREFILL_TILE)
        first, last = s + c0, s + c1 - 1  # positions of the tile's queries
        lo = 0 if window is None else max(0, first - window + 1)
        qc = q[c0:c1].transpose(0, 1).unsqueeze(0)
        kc, vc = k[:, :, lo : last + 1], v[:, :, lo : last + 1]
        if first == 0 and (window is None or window >= c1):
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(first, last + 1, device=q.device)[:, None]
            k_pos = torch.arange(lo, last + 1, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[c0:c1] = o[0].transpose(0, 1)
    return out


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """float64 oracle for one sequence: q [n, H, D] at positions [n] over keys/values [ctx, kvh, D]."""
    H, kvh = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(H // kvh, dim=1)
    v = values.double().repeat_interleave(H // kvh, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= positions[:, None]
    if window is not None:
        allowed &= k_pos > positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
