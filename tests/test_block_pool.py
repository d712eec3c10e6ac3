"""Block pool and prefix index (docs/design.md §4): lifecycle, LRU order, ref counts, pins,
invalidation, integrity checks, and the collision guard of the index."""

from __future__ import annotations

import random
import re

import pytest

from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.hashing import block_hash, hash_blocks, root_hash
from prefixcache.cache.prefix_index import PrefixIndex

B = 16
FP = "test-model"


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _compute(pool: BlockPool, tokens: list[int], ns: str | None = None) -> list[int]:
    """Allocate blocks for the full blocks of ``tokens`` and register them (a finished prefill).
    Returns the block table, still referenced (ref 1 each)."""
    root = root_hash(FP, ns, block_size=B)
    keys = hash_blocks(tokens, B, root)
    table = pool.allocate(len(keys))
    assert table is not None
    for i, (b, k) in enumerate(zip(table, keys)):
        parent = keys[i - 1] if i else root
        assert pool.register(b, k, parent, tokens[i * B : (i + 1) * B], ns) == b
    return table


def _cache(pool: BlockPool, tokens: list[int], ns: str | None = None) -> list[int]:
    """As _compute, then release: the blocks end up cached (ref 0, evictable)."""
    table = _compute(pool, tokens, ns)
    pool.release(table)
    return table


def _match(pool: BlockPool, tokens: list[int], ns: str | None = None):
    root = root_hash(FP, ns, block_size=B)
    return pool.match(hash_blocks(tokens, B, root), tokens, root)


# ---- allocation and LRU order ------------------------------------------------------------------
def test_fresh_pool_counts():
    pool = BlockPool(8, B)
    c = pool.counts()
    assert (c.free, c.cached, c.in_use, c.pinned, c.total) == (8, 0, 0, 0, 8)
    assert pool.num_allocatable == 8
    pool.check_integrity([])
    with pytest.raises(ValueError):
        BlockPool(0, B)


def test_allocate_takes_free_blocks_before_evicting():
    pool = BlockPool(6, B)
    cached = _cache(pool, _tokens(3 * B, 1))  # 3 cached, 3 free
    got = pool.allocate(3)
    assert got is not None and not set(got) & set(cached)
    assert pool.evicted_blocks == 0
    assert _match(pool, _tokens(3 * B, 1)).block_ids == cached  # still all cached
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (0, 3, 3)
    pool.check_integrity([got])


def test_lru_evicts_oldest_release_first():
    pool = BlockPool(4, B)
    a = _cache(pool, _tokens(B, 1))
    b = _cache(pool, _tokens(B, 2))
    c = _cache(pool, _tokens(B, 3))
    d = _cache(pool, _tokens(B, 4))
    assert pool.counts().free == 0
    assert pool.allocate(1) == a
    assert pool.evicted_blocks == 1
    assert pool.allocate(2) == b + c
    assert pool.evicted_blocks == 3
    assert _match(pool, _tokens(B, 4)).block_ids == d
    assert _match(pool, _tokens(B, 1)).block_ids == []
    assert pool.index.was_evicted(hash_blocks(_tokens(B, 1), B, root_hash(FP, block_size=B))[0])


def test_blocks_released_together_evict_tail_before_head():
    pool = BlockPool(4, B)
    table = _cache(pool, _tokens(4 * B, 1))
    # Evicting one at a time takes the last block of the table first, the first block last.
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order == list(reversed(table))
    # After each eviction the head of the prompt is still a hit.
    pool2 = BlockPool(4, B)
    t2 = _cache(pool2, _tokens(4 * B, 1))
    pool2.allocate(1)
    assert _match(pool2, _tokens(4 * B, 1)).block_ids == t2[:3]


def test_acquire_of_cached_block_removes_it_from_lru():
    pool = BlockPool(3, B)
    a = _cache(pool, _tokens(B, 1))
    b = _cache(pool, _tokens(B, 2))
    c = _cache(pool, _tokens(B, 3))
    m = _match(pool, _tokens(B, 1))
    assert m.block_ids == a
    pool.acquire(m.block_ids)  # a hit protects the oldest block
    assert pool.ref_count(a[0]) == 1
    assert pool.num_allocatable == 2
    assert pool.allocate(2) == b + c
    assert pool.allocate(1) is None  # a is in use: not evictable
    pool.check_integrity([a, b, c])
    # Released again, it goes to the back of the LRU (most recent), still cached.
    pool.release(a)
    assert _match(pool, _tokens(B, 1)).block_ids == a
    assert pool.allocate(1) == a


def test_acquire_of_free_block_is_an_error():
    pool = BlockPool(2, B)
    with pytest.raises(AssertionError):
        pool.acquire([0])


def test_release_to_zero_without_key_goes_free():
    pool = BlockPool(3, B)
    t = pool.allocate(2)
    pool.release(t)
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (3, 0, 0)
    with pytest.raises(AssertionError):
        pool.release(t)  # double release


def test_ref_counts_with_two_sequences_sharing_blocks():
    pool = BlockPool(8, B)
    toks = _tokens(3 * B, 1)
    seq_a = _compute(pool, toks)
    seq_a += pool.allocate(1)  # private tail
    m = _match(pool, toks)
    assert m.block_ids == seq_a[:3] and m.num_tokens == 3 * B
    pool.acquire(m.block_ids)
    seq_b = list(m.block_ids) + pool.allocate(1)
    assert [pool.ref_count(x) for x in seq_a] == [2, 2, 2, 1]
    pool.check_integrity([seq_a, seq_b])
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (3, 0, 5)
    pool.release(seq_a)
    pool.check_integrity([seq_b])
    assert [pool.ref_count(x) for x in seq_b] == [1, 1, 1, 1]
    # Still in use by B: nothing of it is evictable.
    assert pool.num_allocatable == 4
    pool.release(seq_b)
    pool.check_integrity([])
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (5, 3, 0)
    assert _match(pool, toks).block_ids == seq_a[:3]


def test_allocate_none_has_no_side_effects():
    pool = BlockPool(5, B)
    cached = _cache(pool, _tokens(3 * B, 1))
    held = pool.allocate(1)
    before = (pool.counts(), pool.evicted_blocks, len(pool.index))
    assert pool.allocate(5) is None
    assert (pool.counts(), pool.evicted_blocks, len(pool.index)) == before
    assert _match(pool, _tokens(3 * B, 1)).block_ids == cached
    pool.check_integrity([held])
    assert pool.allocate(0) == []
    got = pool.allocate(4)
    assert got is not None and len(set(got)) == 4
    assert pool.evicted_blocks == 3


def test_evicted_blocks_counter():
    pool = BlockPool(4, B)
    _cache(pool, _tokens(4 * B, 1))
    assert pool.evicted_blocks == 0
    t = pool.allocate(3)
    assert pool.evicted_blocks == 3
    pool.release(t)  # unkeyed: they go free, not cached
    pool.allocate(4)
    assert pool.evicted_blocks == 4


# ---- pins --------------------------------------------------------------------------------------
def test_pinned_blocks_survive_an_eviction_storm_until_ttl():
    pool = BlockPool(10, B, max_pinned_blocks=4)
    sys_prompt = _tokens(2 * B, 1)
    pinned = _cache(pool, sys_prompt)
    assert pool.pin(pinned, ttl_seconds=60.0, now=1000.0) == 2
    assert pool.counts().pinned == 2
    assert pool.num_allocatable == 8
    rng = random.Random(0)
    for i in range(50):  # churn: cache and evict many other prompts
        n = rng.randint(1, 8)
        t = _compute(pool, _tokens(n * B, 100 + i))
        pool.check_integrity([t])
        pool.release(t)
        assert pool.allocate(9) is None
    assert pool.evicted_blocks > 100
    assert _match(pool, sys_prompt).block_ids == pinned
    assert pool.expire_pins(now=1059.9) == 0
    assert pool.num_allocatable == 8
    assert pool.expire_pins(now=1060.0) == 2
    assert pool.counts().pinned == 0
    assert pool.num_allocatable == 10
    pool.check_integrity([])
    got = pool.allocate(10)
    assert set(pinned) <= set(got)
    assert _match(pool, sys_prompt).block_ids == []


def test_pin_without_ttl_and_pin_of_in_use_block():
    pool = BlockPool(4, B)
    t = _compute(pool, _tokens(2 * B, 1))
    pool.pin(t, ttl_seconds=None, now=0.0)  # pinned while in use
    pool.release(t)
    c = pool.counts()
    assert (c.cached, c.pinned) == (2, 2)
    assert pool.num_allocatable == 2
    assert pool.expire_pins(now=1e12) == 0
    assert pool.allocate(3) is None
    # A hit on a pinned idle block works and keeps the pin.
    m = _match(pool, _tokens(2 * B, 1))
    pool.acquire(m.block_ids)
    pool.check_integrity([t])
    pool.release(t)
    assert pool.counts().pinned == 2
    pool.check_integrity([])


def test_pin_extends_but_never_shortens_deadline():
    pool = BlockPool(4, B)
    t = _cache(pool, _tokens(B, 1))
    pool.pin(t, ttl_seconds=100.0, now=0.0)
    assert pool.pin(t, ttl_seconds=10.0, now=0.0) == 0  # already pinned: not new
    assert pool.expire_pins(now=50.0) == 0
    pool.pin(t, ttl_seconds=100.0, now=50.0)
    assert pool.expire_pins(now=120.0) == 0
    assert pool.expire_pins(now=150.0) == 1


def test_pin_budget_exceeded_raises_with_numbers():
    pool = BlockPool(10, B, max_pinned_blocks=4)
    a = _cache(pool, _tokens(3 * B, 1))
    b = _cache(pool, _tokens(2 * B, 2))
    pool.pin(a, ttl_seconds=10.0, now=0.0)
    with pytest.raises(ValueError) as ei:
        pool.pin(b, ttl_seconds=10.0, now=0.0)
    msg = str(ei.value)
    # The message names what is pinned (3), what was asked (2) and the budget (4).
    for n in ("3", "2", "4"):
        assert re.search(rf"\b{n}\b", msg), msg
    assert "pin" in msg.lower()
    # Nothing of b was pinned; the pool is intact.
    assert pool.counts().pinned == 3
    assert pool.num_allocatable == 7
    pool.check_integrity([])
    assert pool.pin(b[:1], ttl_seconds=10.0, now=0.0) == 1
    # Re-pinning already pinned blocks costs no budget.
    assert pool.pin(a + b[:1], ttl_seconds=10.0, now=0.0) == 0


def test_pin_quotas_sum_within_the_ceiling_so_renewing_tenants_never_starve_another():
    """Two tenants pinning up to their quotas and renewing forever leave the third its own
    quota: the quotas sum within the ceiling. Renewal is allowed within the quota."""
    pool = BlockPool(40, B, max_pinned_blocks=9)
    with pytest.raises(ValueError, match="sum to 10 blocks"):
        pool.set_pin_quotas({"a": 5, "b": 5})  # half each for two of three tenants: too much
    pool.set_pin_quotas({"a": 3, "b": 3, "c": 3})
    a, b, c = (_cache(pool, _tokens(4 * B, seed)) for seed in (1, 2, 3))
    assert pool.pin(a[:3], ttl_seconds=10.0, now=0.0, owner="a") == 3
    assert pool.pin(b[:3], ttl_seconds=10.0, now=0.0, owner="b") == 3
    for t in range(1, 50):  # renewing, again and again, within the quota
        assert pool.pin(a[:3], ttl_seconds=10.0, now=t * 5.0, owner="a") == 0
        assert pool.pin(b[:3], ttl_seconds=10.0, now=t * 5.0, owner="b") == 0
        assert pool.expire_pins(now=t * 5.0) == 0
    with pytest.raises(ValueError, match="quota"):
        pool.pin(a[3:], ttl_seconds=10.0, now=250.0, owner="a")  # over a's own quota
    assert pool.pin(c[:3], ttl_seconds=10.0, now=250.0, owner="c") == 3  # c gets all of its own
    assert pool.counts().pinned == 9 and pool.pinned_by("c") == 3
    # Quotas that shrink leave an owner over them: it renews nothing until it is back within.
    pool.set_pin_quotas({"a": 2, "b": 3, "c": 3})
    with pytest.raises(ValueError, match="quota"):
        pool.pin(a[:3], ttl_seconds=10.0, now=251.0, owner="a")
    assert pool.expire_pins(now=260.0) == 9  # every TTL ends (none was renewed past 260)
    assert pool.pin(a[:2], ttl_seconds=10.0, now=260.0, owner="a") == 2  # back within it
    pool.check_integrity([])


def test_pin_of_uncached_block_raises_and_pins_nothing():
    pool = BlockPool(4, B)
    cached = _cache(pool, _tokens(B, 1))
    t = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.pin(t, ttl_seconds=1.0, now=0.0)
    with pytest.raises(ValueError):
        pool.pin(cached + t, ttl_seconds=1.0, now=0.0)
    # All or nothing: the valid block in the failed call was not pinned either.
    assert pool.counts().pinned == 0
    assert pool.num_allocatable == 3
    pool.check_integrity([t])


# ---- invalidation ------------------------------------------------------------------------------
def test_invalidate_namespace_idle_blocks_go_free():
    pool = BlockPool(8, B)
    a = _cache(pool, _tokens(2 * B, 1), ns="a")
    b = _cache(pool, _tokens(2 * B, 2), ns="b")
    pool.pin(a[:1], ttl_seconds=None, now=0.0)
    assert pool.invalidate("a") == 2
    pool.check_integrity([])
    c = pool.counts()
    assert (c.free, c.cached, c.pinned) == (6, 2, 0)
    assert _match(pool, _tokens(2 * B, 1), ns="a").block_ids == []
    assert _match(pool, _tokens(2 * B, 2), ns="b").block_ids == b
    # Invalidation is not eviction.
    assert pool.evicted_blocks == 0
    key0 = hash_blocks(_tokens(2 * B, 1), B, root_hash(FP, "a", block_size=B))[0]
    assert not pool.index.was_evicted(key0)


def test_invalidate_namespace_in_use_blocks_lose_key_and_free_on_release():
    pool = BlockPool(8, B)
    toks = _tokens(3 * B, 1)
    held = _compute(pool, toks, ns="a")
    pool.pin(held[:1], ttl_seconds=None, now=0.0)
    other = _cache(pool, _tokens(B, 2), ns=None)
    assert pool.invalidate("a") == 3
    assert pool.counts().pinned == 0
    # No hit on the dropped content, even though the blocks are still referenced.
    assert _match(pool, toks, ns="a").block_ids == []
    pool.check_integrity([held])
    assert all(pool.ref_count(x) == 1 for x in held)
    pool.release(held)
    pool.check_integrity([])
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (7, 1, 0)
    assert _match(pool, _tokens(B, 2)).block_ids == other
    # The same content can be computed and cached again afterwards.
    again = _cache(pool, toks, ns="a")
    assert _match(pool, toks, ns="a").block_ids == again


def test_invalidate_all():
    pool = BlockPool(10, B)
    _cache(pool, _tokens(2 * B, 1), ns="a")
    _cache(pool, _tokens(2 * B, 2), ns="b")
    _cache(pool, _tokens(2 * B, 3), ns=None)
    held = _compute(pool, _tokens(B, 4), ns="c")
    assert pool.invalidate(None, all_namespaces=True) == 7
    assert len(pool.index) == 0
    pool.check_integrity([held])
    pool.release(held)
    c = pool.counts()
    assert (c.free, c.cached, c.in_use) == (10, 0, 0)


def test_invalidate_default_namespace_only():
    pool = BlockPool(6, B)
    _cache(pool, _tokens(B, 1), ns=None)
    a = _cache(pool, _tokens(B, 2), ns="a")
    assert pool.invalidate(None) == 1
    assert _match(pool, _tokens(B, 2), ns="a").block_ids == a


# ---- integrity check catches corruption --------------------------------------------------------
def test_check_integrity_catches_wrong_ref_count():
    pool = BlockPool(6, B)
    t = _compute(pool, _tokens(2 * B, 1))
    pool.check_integrity([t])
    pool._ref[t[0]] += 1  # corrupt: a reference nobody holds
    with pytest.raises(AssertionError):
        pool.check_integrity([t])


def test_check_integrity_catches_ref_count_table_mismatch():
    pool = BlockPool(6, B)
    t = _compute(pool, _tokens(2 * B, 1))
    with pytest.raises(AssertionError):
        pool.check_integrity([t, t[:1]])  # a table that holds no reference
    with pytest.raises(AssertionError):
        pool.check_integrity([])  # leaked references


def test_check_integrity_catches_lost_block():
    pool = BlockPool(6, B)
    pool._free.pop()
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_block_in_two_lists():
    pool = BlockPool(6, B)
    t = _cache(pool, _tokens(B, 1))
    pool._free.append(t[0])
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_parked_referenced_block():
    pool = BlockPool(6, B)
    t = _cache(pool, _tokens(B, 1))
    pool._ref[t[0]] = 1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_free_block_with_key():
    pool = BlockPool(6, B)
    t = _cache(pool, _tokens(B, 1))
    del pool._lru[t[0]]
    pool._free.append(t[0])
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---- prefix index ------------------------------------------------------------------------------
def test_index_collision_guard_compares_tokens():
    idx = PrefixIndex(B)
    root = root_hash(FP, block_size=B)
    toks_a = _tokens(2 * B, 1)
    toks_b = list(toks_a)
    toks_b[B + 5] += 1  # second block differs
    keys_a = hash_blocks(toks_a, B, root)
    for i, k in enumerate(keys_a):
        idx.insert(k, 10 + i, keys_a[i - 1] if i else root, toks_a[i * B : (i + 1) * B], None)
    assert idx.match(keys_a, toks_a, root).block_ids == [10, 11]
    # Simulated collision: the keys of A presented with the tokens of B.
    m = idx.match(keys_a, toks_b, root)
    assert m.block_ids == [10] and m.num_tokens == B
    toks_c = [t + 1 for t in toks_a]
    assert idx.match(keys_a, toks_c, root).block_ids == []
    idx.check_integrity()


def test_index_parent_mismatch_does_not_hit():
    idx = PrefixIndex(B)
    toks = _tokens(B, 1)
    root_a, root_b = root_hash(FP, "a", block_size=B), root_hash(FP, "b", block_size=B)
    key = block_hash(root_a, toks)
    idx.insert(key, 3, root_a, toks, "a")
    assert idx.match([key], toks, root_a).block_ids == [3]
    assert idx.match([key], toks, root_b).block_ids == []
    # A chain whose second key's stored parent is not the first key does not hit past block 0.
    toks2 = _tokens(2 * B, 2)
    k0 = block_hash(root_a, toks2[:B])
    k1 = block_hash(k0, toks2[B:])
    idx.insert(k0, 4, root_a, toks2[:B], "a")
    idx.insert(k1, 5, root_b, toks2[B:], "a")  # recorded with the wrong parent
    assert idx.match([k0, k1], toks2, root_a).block_ids == [4]


def test_index_duplicate_insert_returns_existing_block():
    idx = PrefixIndex(B)
    root = root_hash(FP, block_size=B)
    toks = _tokens(B, 1)
    key = block_hash(root, toks)
    assert idx.insert(key, 7, root, toks, None) == 7
    assert idx.insert(key, 9, root, toks, None) == 7
    assert idx.key_of(9) is None and idx.key_of(7) == key
    assert len(idx) == 1
    idx.check_integrity()


def test_index_match_has_no_side_effects_and_remove():
    idx = PrefixIndex(B, evicted_memory=2)
    root = root_hash(FP, block_size=B)
    keys = []
    for i in range(4):
        toks = _tokens(B, i)
        k = block_hash(root, toks)
        keys.append(k)
        idx.insert(k, i, root, toks, None)
    assert len(idx.children(root)) == 4
    for i in range(4):
        assert idx.remove_block(i, evicted=True) == keys[i]
    assert idx.remove_block(0, evicted=True) is None
    # Evicted memory is bounded: the oldest are forgotten.
    assert [idx.was_evicted(k) for k in keys] == [False, False, True, True]
    assert len(idx) == 0 and idx.children(root) == []
    idx.check_integrity()


def test_pool_register_duplicate_keeps_first_block():
    pool = BlockPool(4, B)
    toks = _tokens(B, 1)
    a = _compute(pool, toks)
    b = pool.allocate(1)
    root = root_hash(FP, block_size=B)
    assert pool.register(b[0], block_hash(root, toks), root, toks, None) == a[0]
    pool.release(b)  # the duplicate was never indexed: it goes free
    pool.release(a)
    c = pool.counts()
    assert (c.free, c.cached) == (3, 1)
    pool.check_integrity([])


def test_index_match_tokens_hashes_and_walks_like_match():
    idx = PrefixIndex(B)
    root = root_hash(FP, block_size=B)
    toks = _tokens(6 * B, 1)
    keys = hash_blocks(toks, B, root)
    for i, k in enumerate(keys[:4]):  # the first 4 blocks are cached
        idx.insert(k, 20 + i, keys[i - 1] if i else root, toks[i * B : (i + 1) * B], None)
    other = list(toks)
    other[2 * B + 1] += 1  # diverges in block 2
    for prompt in (toks, toks[: 3 * B + 5], other, other[:B], [], _tokens(5 * B, 9)):
        expect = idx.match(hash_blocks(prompt, B, root), prompt, root)
        assert idx.match_tokens(prompt, root) == expect
    assert idx.match_tokens(toks, root).block_ids == [20, 21, 22, 23]
    assert idx.match_tokens(other, root).block_ids == [20, 21]
    # num_tokens caps the tokens considered (a prompt keeps its last token to compute).
    assert idx.match_tokens(toks, root, 3 * B).num_tokens == 3 * B
    assert idx.match_tokens(toks, root, 3 * B - 1).num_tokens == 2 * B
    assert idx.match_tokens(toks, root_hash(FP, "x", block_size=B)).block_ids == []
    e = idx.entry(keys[1])
    assert e.parent == keys[0] and list(e.token_ids) == toks[B : 2 * B]


def test_index_match_tokens_collision_guard():
    # A key found in the index whose stored input (parent || tokens) differs is never served:
    # here block 1's key is (wrongly) recorded for other tokens, as a hash collision would.
    idx = PrefixIndex(B)
    root = root_hash(FP, block_size=B)
    toks = _tokens(2 * B, 1)
    keys = hash_blocks(toks, B, root)
    idx.insert(keys[0], 1, root, toks[:B], None)
    idx.insert(keys[1], 2, keys[0], [t + 1 for t in toks[B:]], None)
    assert idx.match_tokens(toks, root).block_ids == [1]
    assert idx.match(keys, toks, root).block_ids == [1]
