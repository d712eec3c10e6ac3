"""Cache simulations of `prefixcache analyze` against brute-force block-level references."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import numpy as np
import pytest

from prefixcache.analyze import simulate, trie
from prefixcache.cache.hashing import hash_blocks, root_hash

BS = 4
ROOT = root_hash("test", block_size=BS)


# ---- workloads ------------------------------------------------------------------------------
def random_prompts(rng: random.Random, n: int, bases: int = 3, vocab: int = 6) -> list[list[int]]:
    """Prompts that share prefixes in a random tree: a few bases, random extensions and cuts."""
    stems = [[rng.randrange(vocab) for _ in range(rng.randrange(BS, 5 * BS))] for _ in range(bases)]
    prompts = []
    for _ in range(n):
        p = list(rng.choice(stems + prompts[-4:] if prompts else stems))
        p = p[: rng.randrange(0, len(p) + 1)]
        p += [rng.randrange(vocab) for _ in range(rng.randrange(0, 3 * BS))]
        prompts.append(p)
    return prompts


def block_keys(prompt: list[int]) -> list[tuple[int, ...]]:
    """Reference keys: a block is named by every token up to its end (no hashing involved)."""
    return [tuple(prompt[: (i + 1) * BS]) for i in range(len(prompt) // BS)]


def leading(keys, cache) -> int:
    n = 0
    for k in keys:
        if k not in cache:
            break
        n += 1
    return n


# ---- brute-force references (blocks, not edges) ----------------------------------------------
def ref_lru(prompts, capacity: int) -> int:
    cache: OrderedDict = OrderedDict()
    hits = 0
    for p in prompts:
        keys = block_keys(p)
        hits += leading(keys, cache)
        for k in reversed(keys):  # tail first: the head ends up most recent
            cache[k] = True
            cache.move_to_end(k)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def ref_lfu(prompts, capacity: int) -> int:
    freq: dict = {}
    last: dict = {}
    cache: set = set()
    hits = 0
    for r, p in enumerate(prompts):
        keys = block_keys(p)
        hits += leading(keys, cache)
        for k in keys:
            freq[k] = freq.get(k, 0) + 1
            last[k] = r
            cache.add(k)
        while len(cache) > capacity:
            cache.remove(min(cache, key=lambda k: (freq[k], last[k], -len(k))))
    return hits


def ref_belady(prompts, capacity: int) -> int:
    keys_of = [block_keys(p) for p in prompts]
    cache: set = set()
    hits = 0
    for r, keys in enumerate(keys_of):
        hits += leading(keys, cache)

        def next_use(k, r=r):
            for j in range(r + 1, len(keys_of)):
                if k in keys_of[j]:
                    return j
            return None

        pool = [(next_use(k), len(k), k) for k in cache | set(keys)]  # ties: keep the head
        pool = sorted(x for x in pool if x[0] is not None)
        cache = {k for _, _, k in pool[:capacity]}
    return hits


def ref_optimal(prompts, capacity: int) -> int:
    """Best total hits over every possible sequence of cache contents (exhaustive DP)."""
    keys_of = [block_keys(p) for p in prompts]
    states = {frozenset(): 0}
    for keys in keys_of:
        nxt: dict = {}
        for cache, score in states.items():
            gained = score + leading(keys, cache)
            pool = sorted(cache | set(keys))
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    s = frozenset(keep)
                    if nxt.get(s, -1) < gained:
                        nxt[s] = gained
        states = nxt
    return max(states.values())


# ---- the analyzer's pipeline on the same prompts ---------------------------------------------
class Built:
    def __init__(self, prompts: list[list[int]]) -> None:
        t = trie.BlockTrie()
        self.known = 0
        for r, p in enumerate(prompts):
            added = t.add(hash_blocks(p, BS, ROOT), r)
            self.known += added.known_blocks
        parent, depth, _ = t.arrays()
        leaves = np.array([t_leaf for t_leaf in self._leaves(t, prompts)], dtype=np.int64)
        self.n_blocks = len(parent)
        edges = trie.compress(parent, leaves, depth)
        self.edges = edges
        self.path, self.start = trie.request_paths(edges, leaves)
        self.length = edges.length.tolist()
        self.bottom = (edges.top_depth + edges.length - 1).tolist()
        self.next_use = simulate.next_uses(self.path, self.start)
        self.hist = simulate.lru_distance_histogram(self.path, self.start, self.length,
                                                    self.n_blocks)

    @staticmethod
    def _leaves(t: trie.BlockTrie, prompts):
        for r, p in enumerate(prompts):
            yield t.add(hash_blocks(p, BS, ROOT), r).leaf  # all known now: a pure lookup

    def sim(self, policy: str, capacity: int) -> int:
        return simulate.simulate(policy, capacity, self.path, self.start, self.length,
                                 self.bottom, self.next_use)


CASES = [(seed, n) for seed in range(12) for n in (5, 12, 30)]


@pytest.mark.parametrize("seed,n", CASES)
def test_lru_every_size_equals_brute_force(seed, n):
    prompts = random_prompts(random.Random(seed), n)
    b = Built(prompts)
    total_blocks = sum(len(p) // BS for p in prompts)
    capacities = list(range(total_blocks + 2))
    exact = simulate.lru_hits(b.hist, capacities)
    for c, hits in zip(capacities, exact):
        ref = ref_lru(prompts, c)
        assert hits == ref, (c, hits, ref)
        assert b.sim("lru", c) == ref, c


@pytest.mark.parametrize("seed,n", CASES)
def test_lfu_and_belady_match_references_and_bound_lru(seed, n):
    prompts = random_prompts(random.Random(100 + seed), n)
    b = Built(prompts)
    total_blocks = sum(len(p) // BS for p in prompts)
    for c in range(0, total_blocks + 1, max(1, total_blocks // 12)):
        lru, lfu, opt = b.sim("lru", c), b.sim("lfu", c), b.sim("belady", c)
        assert lfu == ref_lfu(prompts, c), c
        assert opt == ref_belady(prompts, c), c
        assert opt >= lru and opt >= lfu, c
        assert opt <= b.known  # nothing beats an unbounded cache


@pytest.mark.parametrize("seed", range(8))
def test_belady_is_optimal_on_tiny_cases(seed):
    rng = random.Random(1000 + seed)
    prompts = [[rng.randrange(2) for _ in range(rng.randrange(BS, 3 * BS + 1))] for _ in range(6)]
    b = Built(prompts)
    for c in (1, 2, 3):
        assert b.sim("belady", c) == ref_optimal(prompts, c), c


def test_unbounded_cache_hits_are_the_ideal():
    prompts = random_prompts(random.Random(7), 40)
    b = Built(prompts)
    big = b.n_blocks + 1
    assert simulate.lru_hits(b.hist, [big])[0] == b.known
    for policy in ("lru", "lfu", "belady"):
        assert b.sim(policy, big) == b.known


def test_edges_are_crossed_whole():
    """Every request's path ends exactly at its leaf and covers its block count."""
    prompts = random_prompts(random.Random(3), 30)
    b = Built(prompts)
    for r, p in enumerate(prompts):
        blocks = sum(b.length[e] for e in b.path[b.start[r]: b.start[r + 1]])
        assert blocks == len(p) // BS


def test_subtree_counts():
    prompts = [[1] * 8, [1] * 4 + [2] * 4, [1] * 4, [3] * 4]
    t = trie.BlockTrie()
    leaves = np.array([t.add(hash_blocks(p, BS, ROOT), r).leaf for r, p in enumerate(prompts)])
    parent, depth, _ = t.arrays()
    counts = trie.subtree_counts(parent, depth, leaves)
    first = leaves[2]  # the shared [1]*4 block
    assert counts[first] == 3
    assert counts[leaves[0]] == 1 and counts[leaves[3]] == 1


def test_chain_reuse_gives_the_keys_of_hashing_from_scratch():
    from prefixcache.analyze.chain_reuse import ChainReuse

    rng = random.Random(11)
    prompts = random_prompts(rng, 200, vocab=4) + random_prompts(rng, 50, vocab=3)
    reuse = ChainReuse(BS, max_keys=64)  # small: eviction happens
    roots = [ROOT, root_hash("test", "other namespace", block_size=BS)]
    for i, p in enumerate(prompts):
        root = roots[i % 2]
        assert reuse.hash(root, np.array(p, dtype=np.int64)) == hash_blocks(p, BS, root)
    assert reuse.reused_blocks > 100  # and it did save work
