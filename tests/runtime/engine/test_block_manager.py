import random
from collections import Counter

import pytest

from lowbit.errors import UsageError
from lowbit.runtime.engine import block_manager as bm_module
from lowbit.runtime.engine.block_manager import BlockManager
from lowbit.runtime.engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, tokens)


def compute_all(bm, s):
    """What a model step does to the bookkeeping: every token's KV is now in the cache."""
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def check_invariants(bm, live):
    table_refs = Counter(b for s in live for b in s.block_table)
    free = set(bm.free_ids)
    evictable = set(bm.evictable)
    assert len(free) == len(bm.free_ids), "a block is on the free list twice"
    assert not free & evictable
    assert not (free | evictable) & set(table_refs), "a referenced block is free"
    assert len(free) + len(evictable) + len(table_refs) == bm.num_blocks
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == table_refs.get(block.block_id, 0)
        if block.block_id in free:
            assert block.hash is None and block.token_ids == ()
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
        assert bm.blocks[block_id].ref_count > 0 or block_id in evictable
    for s in live:
        assert len(s.block_table) == bm.blocks_needed(s.num_tokens)


def test_allocate_append_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3 and bm.usage == 3 / 8
    assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0
    compute_all(bm, s)
    for t in (10, 11):  # fills block 2 (slots 8..11): no new block
        s.append_token(t)
        assert bm.can_append(s)
        bm.append_slot(s)
        assert len(s.block_table) == 3
    s.append_token(12)  # slot 12 starts block 3
    bm.append_slot(s)
    assert len(s.block_table) == 4
    check_invariants(bm, [s])
    bm.free(s)
    assert s.block_table == [] and bm.num_used_blocks == 0
    check_invariants(bm, [])


def test_prefix_hit_reuses_physical_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    a = seq(system + [1, 2], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(system + [7, 8, 9], "b")
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.num_query_tokens == 14 + 15 and bm.num_hit_tokens == 12
    assert bm.hit_rate == pytest.approx(12 / 29)
    check_invariants(bm, [a, b])


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12), "a")
    bm.allocate(a)
    a.num_computed_tokens = 6  # a chunked prefill has run 6 tokens: one full block is computed
    bm.register_computed(a)
    b = seq(range(13), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(range(8), "b")
    bm.allocate(b)
    # Both blocks are cached, but the last token must run to give logits: the last block is
    # recomputed in a block of b's own, never written into a's.
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = seq(range(9), "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    compute_all(bm, a)
    b = seq([9, 9, 9, 9, 5], "b")  # same (forced) hash for its first block, other tokens
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    c = seq([1, 2, 3, 4, 6], "c")  # genuine match still hits
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    check_invariants(bm, [a, b, c])


def test_unreferenced_blocks_stay_cached_and_evict_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq([1, 2, 3], "a"), seq([5, 6, 7], "b")
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
    a_head, b_head = a.block_table[0], b.block_table[0]
    bm.free(a)  # released first = least recently used
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    # 3 tokens need 2 blocks: the two plain free blocks go first, nothing evicted yet.
    c = seq([20, 21, 22], "c")
    bm.allocate(c)
    assert len(bm.evictable) == 2
    # The next block must evict: a's head goes (released before b's), b's stays cached.
    d = seq([30], "d")
    bm.allocate(d)
    assert d.block_table == [a_head]
    assert bm.match_prefix(seq([1, 2, 3])) == []
    assert bm.match_prefix(seq([5, 6, 7])) == [b_head]
    check_invariants(bm, [c, d])


def test_hits_are_claimed_before_evicting_and_touch_recency():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3], "a")
    bm.allocate(a)
    compute_all(bm, a)
    a_head = a.block_table[0]
    bm.free(a)
    c = seq([5, 6, 7], "c")
    bm.allocate(c)
    compute_all(bm, c)
    c_head = c.block_table[0]
    bm.free(c)
    assert list(bm.evictable) == [a_head, c_head] and len(bm.free_ids) == 1
    # b hits a's head, the LRU-first block, and needs two more: one free, one evicted. The hit
    # must be claimed first, so the eviction takes c's head instead.
    b = seq([1, 2, 9, 9, 9], "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[0] == a_head and b.num_cached_tokens == 2
    assert c_head in b.block_table and not bm.evictable
    check_invariants(bm, [b])
    compute_all(bm, b)
    bm.free(b)
    # Released again, a's head is now the most recently used cached block.
    assert list(bm.evictable)[-1] == a_head


def test_can_allocate_counts_shared_and_cached_hits():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.num_free_blocks == 1
    # 2 of its 3 blocks are shared with a running sequence: only 1 free block is needed.
    assert bm.can_allocate(seq([1, 2, 3, 4, 7]))
    assert not bm.can_allocate(seq([1, 2, 9, 9, 7]))


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq([1, 2, 3], "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = seq([1, 2, 3], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.evictable


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3], "a")
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.evictable and not bm.cached and len(bm.free_ids) == 8


def test_bad_sizes():
    with pytest.raises(UsageError, match="at least one block"):
        BlockManager(0)
    with pytest.raises(UsageError, match="block size"):
        BlockManager(4, block_size=0)


def test_randomized_operations_keep_invariants():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=24, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([0, 4, 8, 10]))] for _ in range(4)]
    live: list[Sequence] = []
    hits = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            s = seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))], str(step))
            if bm.can_allocate(s):
                free_before = bm.num_free_blocks
                bm.allocate(s)
                hits += s.num_cached_tokens > 0
                assert bm.num_free_blocks >= 0 and bm.num_free_blocks <= free_before
                # A hit verifies tokens, so reused blocks really hold this sequence's tokens.
                for i in range(s.num_cached_tokens // bm.block_size):
                    assert bm.blocks[s.block_table[i]].token_ids == tuple(s.token_ids[i * 4 : i * 4 + 4])
                live.append(s)
        elif op < 0.8 and live:
            s = rng.choice(live)
            compute_all(bm, s)
            s.append_token(rng.randrange(50))
            if bm.can_append(s):
                bm.append_slot(s)
            else:
                live.remove(s)
                bm.free(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        check_invariants(bm, live)
    assert hits > 50  # the shared prefixes were actually exercised


def test_released_blocks_are_handed_out_again_first():
    # the free list is a stack: memory already written (and faulted in) is reused before the pool's
    # untouched blocks, and a cold cache (reset_prefix_cache) gives back the blocks it held
    bm = BlockManager(num_blocks=64, block_size=4)
    a = seq(list(range(10)), "a")  # 3 blocks: two full, one partial
    bm.allocate(a)
    first = list(a.block_table)
    assert first == [0, 1, 2]
    bm.free(a)  # nothing registered: all three go back to the free list
    b = seq(list(range(100, 110)), "b")
    bm.allocate(b)
    assert sorted(b.block_table) == first
    compute_all(bm, b)
    bm.free(b)  # its two full blocks stay cached, the partial one is free again
    assert len(bm.evictable) == 2
    c = seq(list(range(200, 203)), "c")
    bm.allocate(c)
    assert c.block_table[0] in first  # the partial block, not block 3
    bm.free(c)
    bm.reset_prefix_cache()
    d = seq(list(range(300, 312)), "d")
    bm.allocate(d)
    assert sorted(d.block_table) == first
    check_invariants(bm, [d])
