"""Retention priorities (TensorRT-LLM's 0-100): eviction takes the lowest-ranked candidate of
the policy's own victim's group, so a group's ranks decide which of *its* blocks go, never whose
(cache/eviction/policy.py, docs/design.md §4 "Retention priority").

First the policies alone (every online one, as the trace simulator drives them), then the block
pool (groups, deadlines on an injected clock, invariants under random operations), then the
cache manager with two tenants under eviction pressure: one ranking everything at 100 evicts
exactly the blocks it would have evicted without ranking anything, and the other tenant loses
exactly as many blocks as before when the first one ranks half its blocks 0.
"""

from __future__ import annotations

import random

import pytest
from _pool import compute_missing
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.request import (
    DEFAULT_RETENTION_PRIORITY,
    RetentionPriority,
    SamplingParams,
    SharedPrefix,
)
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.eviction import POLICY_NAMES, make_policy
from prefixcache.cache.hashing import hash_blocks, root_hash
from prefixcache.cache.manager import KVCacheManager, shared_group
from prefixcache.sequence import Sequence

B = 4
FP = "retention-test"


# ---- the policies alone -------------------------------------------------------------------------


def _chains(policy, group, n_chains: int, depth: int, start: int) -> list[list[int]]:
    """``n_chains`` independent prompts of ``depth`` blocks each, inserted and released."""
    out = []
    for c in range(n_chains):
        path = [start + c * depth + d for d in range(depth)]
        policy.tick()
        for i, b in enumerate(path):
            policy.insert(b, path[i - 1] if i else None, held=True, group=group)
        policy.release_all(path[::-1], tail=True)
        out.append(path)
    return out


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_group_loses_its_lowest_ranked_blocks_first(name):
    p = make_policy(name, 64)
    chains = _chains(p, "a", 6, 2, 0)
    low = {b for path in chains[3:] for b in path}  # the newest three prompts ranked 0
    for b in low:
        p.set_priority(b, 0)
    p.check_integrity()
    evicted = [p.evict() for _ in range(len(low))]
    assert set(evicted) == low  # all of them before any older, default-ranked block
    p.check_integrity()
    for path in chains[:3]:
        for b in path:
            p.set_priority(b, 100)
    p.set_priority(chains[0][1], 7)
    assert p.evict() == chains[0][1]
    p.check_integrity()


def test_among_equal_ranks_the_policy_decides():
    """LRU order within one rank: the oldest release first, tail before head."""
    p = make_policy("lru", 64)
    chains = _chains(p, "a", 4, 2, 0)
    for b in (0, 1, 4, 5):  # prompts 0 and 2 ranked up
        p.set_priority(b, 90)
    assert [p.evict() for _ in range(8)] == [3, 2, 7, 6, 1, 0, 5, 4]
    assert chains


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ranks_never_decide_whose_block_goes(name):
    """Two groups: the evicted group at each step is the policy's choice, so ranking every
    block of group a at 100 evicts exactly what nothing ranked would, and ranking some of a's
    blocks low takes them first but never one block more of b's."""

    def run(rank):
        p = make_policy(name, 40)
        rng = random.Random(5)
        gone, nxt, group_of = [], 0, {}
        for step in range(60):
            group = "a" if rng.random() < 0.5 else "b"
            path = list(range(nxt, nxt + rng.randint(1, 3)))
            nxt += len(path)
            p.tick()
            for i, b in enumerate(path):
                p.insert(b, path[i - 1] if i else None, held=True, group=group)
                group_of[b] = group
                if group == "a" and rank(b) is not None:
                    p.set_priority(b, rank(b))
            p.release_all(path[::-1], tail=True)
            while len(p) > 30:
                v = p.evict()
                gone.append((group_of[v], v))
            if step % 10 == 0:
                p.check_integrity()
        return gone

    plain = run(lambda b: None)
    all_top = run(lambda b: 100)
    assert {g for g, _ in plain} == {"a", "b"}
    assert all_top == plain  # ranking everything at 100 changes nothing at all
    if name in ("lru", "lru-demote"):  # deterministic: comparable eviction by eviction
        mixed = run(lambda b: 0 if b % 2 else 100)
        assert mixed != plain  # a's ranks changed which of a's blocks went...
        assert _never_more(mixed, plain, "b")  # ...and b never lost more than without them
        if name == "lru":  # b lost the very same blocks, in the same order, only later
            b_mixed = [b for g, b in mixed if g == "b"]
            assert b_mixed == [b for g, b in plain if g == "b"][: len(b_mixed)]


def _never_more(run, baseline, group) -> bool:
    """After every eviction, ``group`` has lost at most as many blocks in ``run`` as in
    ``baseline``. Ranking its own blocks makes a group's old high-ranked block stay at the
    policy's front, so that group keeps paying (its lower ranks go first) and the other group
    pays later, never more."""
    mine = theirs = 0
    for (g1, _), (g2, _) in zip(run, baseline):
        mine += g1 == group
        theirs += g2 == group
        if mine > theirs:
            return False
    return True


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_group_evicted_is_the_policys_own_victims(name, monkeypatch):
    """Whatever the ranks, each victim belongs to the group of the block the policy alone
    would have evicted at that moment."""
    p = make_policy(name, 48)
    members = p.members if name == "adaptive" else [p]
    seen = []
    for m in members:
        real = m._choose_in_group

        def spy(victim, m=m, real=real):
            out = real(victim)
            seen.append((m.group(victim), m.group(out)))
            return out

        monkeypatch.setattr(m, "_choose_in_group", spy)
    rng = random.Random(1)
    nxt = 0
    for _ in range(80):
        group = rng.choice("abc")
        path = list(range(nxt, nxt + rng.randint(1, 3)))
        nxt += len(path)
        p.tick()
        for i, b in enumerate(path):
            p.insert(b, path[i - 1] if i else None, held=True, group=group)
            p.set_priority(b, rng.choice((0, 35, 60, 100)))
        p.release_all(path[::-1], tail=True)
        while len(p) > 36:
            p.evict()
    p.check_integrity()
    assert seen and all(a == b for a, b in seen)


# ---- the block pool -------------------------------------------------------------------------------


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _cache(pool: BlockPool, tokens: list[int], ns, group) -> list[int]:
    root = root_hash(FP, ns, block_size=B)
    keys = hash_blocks(tokens, B, root)
    table = pool.allocate(len(keys))
    for i, (b, k) in enumerate(zip(table, keys)):
        pool.register(b, k, keys[i - 1] if i else root, tokens[i * B : (i + 1) * B], ns,
                      parent_block=table[i - 1] if i else None, group=group)  # fmt: skip
    pool.release(table)
    return table


def test_pool_ranks_only_the_groups_own_blocks_until_the_deadline():
    pool = BlockPool(16, B)
    mine = _cache(pool, _tokens(3 * B, 1), "alice", "alice")
    theirs = _cache(pool, _tokens(3 * B, 2), "bob", "bob")
    assert pool.set_retention(mine + theirs, 90, until=100.0, group="alice") == 3
    assert [pool.priority_of(b) for b in mine] == [90] * 3
    assert [pool.priority_of(b) for b in theirs] == [DEFAULT_RETENTION_PRIORITY] * 3
    pool.check_integrity()
    assert pool.expire_pins(now=99.0) == 0 and pool.priority_of(mine[0]) == 90
    pool.set_retention(mine[:1], 10, until=None, group="alice")  # the last call wins
    pool.expire_pins(now=100.0)
    assert [pool.priority_of(b) for b in mine] == [10] + [DEFAULT_RETENTION_PRIORITY] * 2
    pool.check_integrity()


def test_pool_a_ranked_block_evicted_or_invalidated_forgets_its_deadline():
    pool = BlockPool(4, B)
    a = _cache(pool, _tokens(2 * B, 1), "alice", "alice")
    pool.set_retention(a, 100, until=50.0, group="alice")
    b = _cache(pool, _tokens(2 * B, 2), "alice", "alice")
    pool.set_retention(b, 0, until=50.0, group="alice")
    assert pool.allocate(2) == [b[1], b[0]]  # the low-ranked prompt goes, though newer
    pool.check_integrity()
    pool.invalidate("alice")
    pool.check_integrity()
    assert not list(pool.rank_deadlines)
    pool.expire_pins(now=60.0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["cache", "hit", "release", "rank", "expire",
                                               "allocate", "invalidate", "pin"]),
                              st.integers(0, 10**6)), max_size=80))
def test_pool_invariants_with_ranks_under_random_operations(policy, ops):
    pool = BlockPool(12, B, max_pinned_blocks=3, eviction_policy=policy)
    prompts = [_tokens(k * B, 10 + r) for r in range(3) for k in (1, 2, 3)]
    live: list[list[int]] = []
    now = 0.0
    for op, x in ops:
        now += 1.0
        ns = ("a", "b")[x % 2]
        p = prompts[x % len(prompts)]
        root = root_hash(FP, ns, block_size=B)
        keys = hash_blocks(p, B, root)
        m = pool.match(keys, p, root)
        if op == "cache" and len(m.block_ids) < len(keys):
            done = compute_missing(pool, m.block_ids, keys, p, root, ns, B, group=ns)
            if done is not None:
                live.append(done[0])
        elif op == "hit":
            pool.acquire(m.block_ids)
            live.append(list(m.block_ids))
        elif op == "release" and live:
            pool.release(live.pop(x % len(live)))
        elif op == "rank":
            until = None if x % 3 == 0 else now + x % 7
            pool.set_retention(m.block_ids, x % 101, until, group=ns)
        elif op == "expire":
            pool.expire_pins(now=now)
        elif op == "pin":
            try:
                pool.pin(m.block_ids, 3.0, now=now)
            except ValueError:
                pass
        elif op == "allocate":
            avail = pool.num_allocatable
            n = x % (avail + 2)
            got = pool.allocate(n)
            assert (got is None) == (n > avail)
            if got is not None:
                pool.release(got)
        elif op == "invalidate":
            pool.invalidate(ns)
        pool.check_integrity(live)
    for t in live:
        pool.release(t)
    pool.expire_pins(now=float("inf"))
    pool.check_integrity([])
    assert pool.num_allocatable == pool.num_blocks


# ---- the cache manager: requests of two tenants -------------------------------------------------------


def _run_two_tenants(policy: str, rank_alice) -> list[tuple[str, int]]:
    """Alice and Bob send conversations into a pool far too small for them; ``rank_alice(i)``:
    the RetentionPriority of Alice's i-th request (or None). Returns each eviction's (namespace,
    position of the block in its prompt)."""
    pool = BlockPool(24, B, eviction_policy=policy)
    kv = KVCacheManager(pool, FP, clock=lambda: 0.0)
    rng = random.Random(7)
    convs = {t: [_tokens(2 * B, hash(t) % 1000 + i) for i in range(3)] for t in ("alice", "bob")}
    evicted: list[tuple[str, int]] = []
    real_evict = pool.policy.evict

    def spy():
        key = real_evict()
        e = pool.index.entry(key)
        evicted.append((e.namespace, kv_depth[key]))
        return key

    kv_depth: dict = {}
    pool.policy.evict = spy
    n = {"alice": 0, "bob": 0}
    for step in range(40):
        tenant = "alice" if rng.random() < 0.5 else "bob"
        c = rng.randrange(3)
        convs[tenant][c] = convs[tenant][c] + _tokens(B + rng.randrange(2 * B), step)
        prompt = convs[tenant][c]
        rank = rank_alice(n["alice"]) if tenant == "alice" else None
        seq = Sequence.of(f"r{step}", prompt, SamplingParams(), kv.root(tenant), namespace=tenant,
                          tenant=tenant, retention_priority=rank)  # fmt: skip
        n[tenant] += 1
        m = kv.match(seq)
        assert kv.admit(seq, m, seq.num_tokens - m.num_tokens)
        kv.mark_computed(seq, seq.num_tokens)
        kv.commit(seq)
        for i, k in enumerate(seq.kv.block_keys):
            kv_depth[k] = i
        if seq.request.retention_priority is not None:
            own = [pool.priority_of(b) for b in seq.kv.block_table[: seq.kv.num_registered_blocks]]
            assert own == [seq.request.retention_priority.priority] * len(own)
        kv.free(seq)
        pool.check_integrity([])
    return evicted


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_tenant_ranking_everything_100_evicts_nobody_elses_blocks(policy):
    plain = _run_two_tenants(policy, lambda i: None)
    top = _run_two_tenants(policy, lambda i: RetentionPriority(100))
    assert len(plain) > 20  # eviction pressure: both tenants lost blocks
    assert {ns for ns, _ in plain} == {"alice", "bob"}
    assert top == plain


@pytest.mark.parametrize("policy", ["lru", "lru-demote"])
def test_a_tenants_low_ranks_cost_only_its_own_blocks(policy):
    """Alice ranks every other request 0 and the rest 100: her low-ranked blocks go first, and
    Bob never loses more blocks than when nobody ranks anything."""
    plain = _run_two_tenants(policy, lambda i: None)
    mixed = _run_two_tenants(policy, lambda i: RetentionPriority(0 if i % 2 else 100))
    assert mixed != plain  # Alice's ranks changed which of her blocks went
    assert _never_more(mixed, plain, "bob")


def test_a_shared_prefix_is_no_tenants_to_rank():
    pool = BlockPool(16, B)
    kv = KVCacheManager(pool, FP, clock=lambda: 0.0)
    prompt = _tokens(4 * B, 3)
    shared = SharedPrefix("public", 2 * B)
    scope = kv.scope("alice", shared, len(prompt))
    seq = Sequence.of("r", prompt, SamplingParams(), kv.first_root(scope), namespace="alice",
                      shared_namespace=scope.shared_namespace, num_shared_blocks=scope.shared_blocks,
                      tenant="alice", retention_priority=RetentionPriority(90))  # fmt: skip
    kv.admit(seq, kv.match(seq), seq.num_tokens)
    kv.mark_computed(seq, seq.num_tokens)
    kv.commit(seq)
    table = seq.kv.block_table
    assert [pool.policy.group(pool.index.key_of(b)) for b in table] == [
        shared_group("public")] * 2 + ["alice"] * 2
    assert [pool.priority_of(b) for b in table] == [DEFAULT_RETENTION_PRIORITY] * 2 + [90] * 2
    kv.free(seq)
    pool.check_integrity([])


@pytest.mark.parametrize("bad", [-1, 101, 3.5, True, "10", None])
def test_a_bad_priority_is_refused(bad):
    with pytest.raises(InvalidRequestError) as e:
        RetentionPriority(bad)
    assert e.value.param == "retention_priority"
    for secs in (0, -1.0, float("inf"), float("nan"), "5"):
        with pytest.raises(InvalidRequestError) as e:
            RetentionPriority(50, secs)
        assert e.value.param == "retention_priority_seconds"
