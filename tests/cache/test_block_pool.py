"""Block pool and prefix index (docs/design.md §4): lifecycle, LRU order, ref counts, pins,
invalidation, integrity checks, and the collision guard of the index."""

from __future__ import annotations

import random
import re
from collections import OrderedDict

import pytest
from _pool import compute_missing
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_pin_budget_exceeded_raises_with_the_callers_own_numbers():
    pool = BlockPool(10, B, max_pinned_blocks=4)
    a = _cache(pool, _tokens(3 * B, 1))
    b = _cache(pool, _tokens(2 * B, 2))
    pool.pin(a, ttl_seconds=10.0, now=0.0, owner="alice")
    with pytest.raises(ValueError) as ei:
        pool.pin(b, ttl_seconds=10.0, now=0.0, owner="bob")
    msg = str(ei.value)
    # The message names what bob asked (2) and holds (0), never what everyone pinned (alice's
    # 3) nor the budget: the server-wide count is another tenant's business (issue #37).
    assert "budget" in msg and re.search(r"\b2 new\b", msg) and re.search(r"\b0 pinned\b", msg), msg
    assert not re.search(r"\b[34]\b", msg), msg
    assert "pin" in msg.lower()
    # Nothing of b was pinned; the pool is intact.
    assert pool.counts().pinned == 3
    assert pool.num_allocatable == 7
    pool.check_integrity([])
    assert pool.pin(b[:1], ttl_seconds=10.0, now=0.0, owner="bob") == 1
    # Re-pinning already pinned blocks costs no budget.
    assert pool.pin(a + b[:1], ttl_seconds=10.0, now=0.0, owner="alice") == 0


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
    pool.policy.remove(pool.index.key_of(t[0]))  # parked as free, its key still indexed
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


# ---- eviction policies in the pool (cache/eviction/) ---------------------------------------------
POLICIES = ["lru", "lru-demote", "hit-density", "adaptive"]


class LegacyLRUPool(BlockPool):
    """The pool's eviction before it took a policy (an OrderedDict of unreferenced cached
    blocks, parked in release order, tail first): the reference the ``lru`` policy must equal."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_allocatable(self) -> int:
        return len(self._free) + len(self._lru)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._lru

    def num_evictable(self, block_ids) -> int:
        return sum(1 for b in block_ids if b in self._lru)

    def acquire(self, block_ids, touch: bool = True) -> None:
        for b in block_ids:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1

    def allocate(self, n: int):
        if n > self.num_allocatable:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                self.index.remove_block(b, evicted=True)
                self.evicted_blocks += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def register(self, block_id, key, parent, token_ids, namespace, parent_block=None, group=None):
        return self.index.insert(key, block_id, parent, token_ids, namespace)

    def release(self, block_ids) -> None:
        for b in reversed(block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self.index.key_of(b) is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None


def _conversation_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share prefixes: a few system prompts, conversations growing turn by turn,
    repeats, lengths on and off block boundaries."""
    systems = [_tokens(k * B, 50 + k) for k in (1, 2, 3)]
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if convs and r < 0.5:
            i = rng.randrange(len(convs))
            convs[i] = convs[i] + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 2 * B))]
            out.append(convs[i])
        elif out and r < 0.6:
            out.append(rng.choice(out))
        else:
            p = rng.choice(systems) + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 3 * B))]
            convs.append(p)
            out.append(p)
    return out


def test_lru_policy_evicts_exactly_what_the_ordered_dict_lru_did():
    """``lru`` through the policy module is the pool's old LRU, block for block: the same
    workload (admissions with hits, chunked prefill, commits that share a block computed twice,
    up to four requests in flight) through both gives the same block tables at every step."""
    from prefixcache.api.request import SamplingParams
    from prefixcache.cache.manager import kv_cache_manager
    from prefixcache.sequence import Sequence

    rng = random.Random(3)
    prompts = _conversation_prompts(rng, 400)
    # whole blocks only: the old pool predates token-exact reuse (a copy's source is a use)
    managers = [kv_cache_manager(BlockPool(40, B), FP, partial_reuse=False),
                kv_cache_manager(LegacyLRUPool(40, B), FP, partial_reuse=False)]
    live: list[list[Sequence]] = [[], []]
    for i, p in enumerate(prompts):
        chunk = rng.choice((7, 16, 1000))
        finish_first = rng.random() < 0.3
        tables = []
        for kv, running in zip(managers, live):
            s = Sequence.of(f"r{i}", list(p), SamplingParams(max_tokens=1), root=kv.root(None))
            if finish_first or len(running) >= 4:
                kv.free(running.pop(0))
            m = kv.match(s)
            while not kv.admit(s, m, min(chunk, s.num_tokens - m.num_tokens)):
                kv.free(running.pop(0))
            while True:
                kv.mark_computed(s, min(s.num_tokens, len(s.kv.block_table) * B))
                kv.commit(s)
                if s.kv.num_computed_tokens == s.num_tokens:
                    break
                while not kv.allocate_slots(s, min(chunk, s.num_tokens - s.kv.num_computed_tokens)):
                    kv.free(running.pop(0))
            running.append(s)
            tables.append([list(q.kv.block_table) for q in running])
        assert tables[0] == tables[1], f"request {i}"
    new, old = (kv.pool for kv in managers)
    assert new.evicted_blocks == old.evicted_blocks > 500
    assert managers[0].hit_tokens == managers[1].hit_tokens > 0
    new.check_integrity([s.kv.block_table for s in live[0]])


POOL_OPS = st.lists(
    st.tuples(st.sampled_from(["compute", "compute", "release", "hit", "pin", "expire",
                               "invalidate", "allocate"]),
              st.integers(0, 10**6)),
    min_size=30,
    max_size=120,
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(ops=POOL_OPS)
def test_pool_invariants_under_random_operations(policy, ops):
    """Every policy in the pool, under hypothesis: ``allocate(n)`` succeeds exactly when
    ``n <= num_allocatable`` and never hands out a block that was in use or pinned; an
    evicted block never leaves a cached child behind (leaves first); ``check_integrity``
    (which checks the policy's own state) holds after every operation."""
    pool = BlockPool(12, B, max_pinned_blocks=4, eviction_policy=policy)
    rng = random.Random(0)
    prompts = [_tokens(k * B, 10 + r) for r in range(3) for k in (1, 2, 3)]
    prompts += [p[: len(p) - B] + _tokens(B, 90 + i) for i, p in enumerate(prompts) if len(p) > B]
    live: list[list[int]] = []
    now = 0.0
    for op, x in ops:
        now += 1.0
        ns = (None, "a")[x % 2]
        p = prompts[x % len(prompts)]
        root = root_hash(FP, ns, block_size=B)
        keys = hash_blocks(p, B, root)
        if op in ("compute", "hit"):
            m = pool.match(keys, p, root)
            if op == "hit" or len(m.block_ids) == len(keys):
                pool.acquire(m.block_ids)
                live.append(list(m.block_ids))
            else:
                done = compute_missing(pool, m.block_ids, keys, p, root, ns, B)
                if done is not None:
                    table, holders = done
                    assert holders == table[len(m.block_ids):]  # each block holds its key
                    live.append(table)
        elif op == "release" and live:
            pool.release(live.pop(x % len(live)))
        elif op == "pin":
            m = pool.match(keys, p, root)
            try:
                pool.pin(m.block_ids, ttl_seconds=rng.choice((2.0, 20.0, None)), now=now)
            except ValueError:
                pass
        elif op == "expire":
            pool.expire_pins(now=now if x % 4 else float("inf"))
        elif op == "invalidate":
            pool.invalidate(ns, all_namespaces=x % 5 == 0)
        elif op == "allocate":
            avail = pool.num_allocatable
            n = x % (avail + 2)
            held = {b for t in live for b in t} | set(pool.pins)
            before = {pool.index.key_of(b) for b in pool.index.all_blocks()}
            got = pool.allocate(n)
            assert (got is None) == (n > avail)  # exactly what it said it could give
            if got is not None:
                assert not set(got) & held, "evicted a block in use or pinned"
                evicted = before - {pool.index.key_of(b) for b in pool.index.all_blocks()}
                parents = {pool.index.entry(k).parent for k in
                           (pool.index.key_of(b) for b in pool.index.all_blocks())}
                assert not evicted & parents, "evicted a block before its cached child"
                pool.release(got)  # unindexed: back to the free list
        pool.check_integrity(live)
    for t in live:
        pool.release(t)
    pool.expire_pins(now=float("inf"))
    pool.check_integrity([])
    assert pool.num_allocatable == pool.num_blocks  # everything comes back


def test_check_integrity_covers_the_policy():
    pool = BlockPool(6, B, eviction_policy="lru-demote")
    t = _compute(pool, _tokens(2 * B, 1))
    pool.check_integrity([t])
    pool.policy.acquire(pool.index.key_of(t[0]))  # a reference the pool does not hold
    with pytest.raises(AssertionError, match="policy refs"):
        pool.check_integrity([t])
    pool = BlockPool(6, B, eviction_policy="hit-density")
    t = _cache(pool, _tokens(2 * B, 1))
    pool.policy._num_held += 1  # the held count drifted
    with pytest.raises(AssertionError, match="held"):
        pool.check_integrity([])


@pytest.mark.parametrize("policy", POLICIES)
def test_pins_and_ttl_under_every_policy(policy):
    """A pinned prompt survives any amount of churn under every policy, and its blocks are
    evictable again once the TTL ends."""
    pool = BlockPool(10, B, max_pinned_blocks=4, eviction_policy=policy)
    sys_prompt = _tokens(2 * B, 1)
    pinned = _cache(pool, sys_prompt)
    pool.pin(pinned, ttl_seconds=60.0, now=1000.0)
    for i in range(40):
        t = _compute(pool, _tokens(random.Random(i).randint(1, 8) * B, 100 + i))
        pool.release(t)
        assert pool.allocate(9) is None
        pool.check_integrity([])
    assert _match(pool, sys_prompt).block_ids == pinned
    assert pool.expire_pins(now=1060.0) == 2
    assert pool.num_allocatable == 10
    assert set(pinned) <= set(pool.allocate(10))


def test_a_pinned_block_holds_its_ancestors():
    """Pinning a block keeps its parent too (the parent is no candidate while it has a cached
    child), and ``num_allocatable`` says so: it counts what eviction can actually reach."""
    pool = BlockPool(4, B)
    t = _cache(pool, _tokens(3 * B, 1))
    pool.pin(t[2:], ttl_seconds=None, now=0.0)
    assert pool.num_allocatable == 1  # the free block; the three cached ones are held
    assert pool.allocate(2) is None
    pool.expire_pins(now=float("inf"))
    assert pool.num_allocatable == 4


def test_engine_config_takes_the_policy_names():
    from prefixcache.cache.eviction import POLICY_NAMES
    from prefixcache.config import EngineConfig

    assert tuple(POLICIES) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert EngineConfig(eviction_policy=name).eviction_policy == name
    with pytest.raises(ValueError, match="eviction_policy"):
        EngineConfig(eviction_policy="belady")  # offline: the simulator's only
