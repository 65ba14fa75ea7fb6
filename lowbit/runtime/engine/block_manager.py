"""Paged KV cache bookkeeping: which physical blocks each sequence owns, and the prefix cache.

The KV pool is `num_blocks` blocks of `block_size` token slots; a sequence's block table maps its
logical block i (tokens i*block_size ...) to a physical block. Nothing here touches tensors: the
model runner turns block tables into slot indices.

Prefix caching. Once a FULL block's keys and values are computed, the block is registered under
hash(parent block's hash, its token ids), so the hash names the whole prefix up to and including
that block. A new sequence walks its tokens block by block from the start and reuses every block
it finds (verifying the stored token ids, so a hash collision costs a miss, not a wrong answer).
A block nobody references but that holds a registered prefix stays cached; it is evicted, least
recently released first, only when a fresh block is needed and the plain free list is empty.

The plain free list is a stack: a released block is handed out again first. Its memory is written
already (on the CPU the pool's pages appear on first write, kernels/hugepages.lazy_zeros) and may
still be in cache; handing out the pool front to back instead made every new prompt fault in fresh
pages (a 512-token SmolLM2 prefill spent 9 % of its time writing its K/V, most of it faults).
Only blocks whose KV is computed are registered, so a hit never reads KV still being prefilled.

Every block is in exactly one of three states:
  in use      ref_count > 0 (shared prefix blocks have ref_count > 1)
  cached      ref_count == 0, holds a registered prefix, in `evictable` (LRU order)
  free        ref_count == 0, holds nothing, in `free_ids`
"Free" in the counters below means free + cached: both can be handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from lowbit.errors import UsageError
from lowbit.runtime.engine.sequence import Sequence

ROOT_HASH = -1  # parent hash of a sequence's first block


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic across runs (PYTHONHASHSEED only salts
    # str/bytes) and 64-bit; collisions are caught by the token check in match_prefix.
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    token_ids: tuple[int, ...] = ()  # the tokens the hash was computed from, for verification


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise UsageError(f"the KV cache needs at least one block, got {num_blocks}")
        if not isinstance(block_size, int) or block_size < 1:
            raise UsageError(f"KV block size must be a positive integer, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently released
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Prefix-cache counters, in TOKENS: tokens looked up at allocation / tokens found cached.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- counters -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of seq, whole blocks only.

        The last token is never covered: the model must run on at least one token to give the
        logits the next token is sampled from, and recomputing into a shared block would write
        into a block other sequences read. So a block-aligned, fully cached prompt recomputes
        its last block.
        """
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        parent, hits = ROOT_HASH, []
        for i in range((seq.num_tokens - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        return hits

    def register_computed(self, seq: Sequence) -> None:
        """Hash and register the full blocks whose KV is now computed (call after each step)."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]].hash if i else ROOT_HASH
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.hash = block_hash(parent, block.token_ids)
            # A twin computed concurrently may own the hash already; keep the first one.
            if self.enable_prefix_caching:
                self.cached.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix that no sequence holds (benchmarks want a cold cache)."""
        while self.evictable:
            self.free_ids.appendleft(self._evict_lru())

    # -- allocation ---------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> bool:
        hits = self.match_prefix(seq) if use_prefix_cache else []
        # Hit blocks already in use cost nothing; cached (evictable) hits leave the free pool.
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.num_free_blocks >= self.blocks_needed(seq.num_tokens) - shared

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks; sets num_cached_tokens.

        use_prefix_cache=False computes every token afresh (a sequence that wants its prompt's
        logits); its blocks are still registered once computed, for others to reuse."""
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already holds blocks")
        hits = self.match_prefix(seq) if use_prefix_cache else []
        for block_id in hits:  # claim the hits first so the evictions below cannot take them
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        fresh = [self._take_free_block() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.num_hashed_blocks = len(hits)
        if use_prefix_cache:
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether slots exist (or can be made) for all tokens plus num_lookahead draft tokens."""
        missing = self.blocks_needed(seq.num_tokens + num_lookahead) - len(seq.block_table)
        return self.num_free_blocks >= missing

    def append_slot(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Add blocks so every token (plus num_lookahead) has a slot; a no-op inside a block."""
        while len(seq.block_table) * self.block_size < seq.num_tokens + num_lookahead:
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        # Release the tail first: it enters the LRU earlier and is evicted before the head,
        # which is what other prefixes are likelier to share.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    # -- internals ----------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.evictable:
            block_id = self._evict_lru()
        else:
            raise RuntimeError("out of KV blocks: check can_allocate/can_append first")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict_lru(self) -> int:
        block_id, _ = self.evictable.popitem(last=False)
        block = self.blocks[block_id]
        del self.cached[block.hash]
        block.hash, block.token_ids = None, ()
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            self.evictable[block_id] = None  # most recently released goes last
        else:
            block.hash, block.token_ids = None, ()
            self.free_ids.appendleft(block_id)
