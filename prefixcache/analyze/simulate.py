"""Hit rate vs cache size: LRU (every size at once), LFU and Belady's optimal (one size a run).

The cache model, the same for every policy (and the brute-force references in the tests):

- the cache holds at most C full blocks; a request hits on the leading blocks of its prompt
  found in the cache when it arrives (the longest cached prefix), then all its blocks are
  inserted and the cache is cut back to C by the policy;
- among blocks that tie under the policy, the deeper block (the tail of a prompt) goes first,
  as in the engine (docs/design.md §4). Every policy below then keeps the cache prefix-closed (a
  block's parent is more recent, more frequent and needed no later than the block), so "the
  blocks of the request that are cached" and "its leading cached run" are the same count.

LRU is a stack algorithm, so one pass gives every size: a request's blocks are pushed tail
first, and a block hits at size C iff fewer than C distinct blocks were touched since its last
use (its *stack distance*). Distances of all blocks of a path segment last touched by the same
request differ by their depth, so a Fenwick tree over request indices (holding, for each
request, how many blocks it was the last to touch) gives them segment by segment:

    dist(block at depth d, last touched by q) = W(q) + (d - a)
    W(q) = blocks whose last touch lies strictly between q and now;  a = segment's top depth

LFU (frequency since first seen, ties by recency) and Belady (evict the block needed furthest
in the future; blocks never needed again are not kept) have no such structure and are
simulated per size, over the edges of the compressed trie (``trie.compress``), where a victim
edge loses blocks from its tail.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

INF = 1 << 62


class Fenwick:
    """Prefix sums over ``n`` slots with point updates, O(log n) each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        tree, n = self.tree, self.n
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of slots ``[0, i)``."""
        tree = self.tree
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


def lru_distance_histogram(
    path: Sequence[int],
    start: Sequence[int],
    length: Sequence[int],
    n_blocks: int,
) -> np.ndarray:
    """``hist[d]`` = block accesses with LRU stack distance ``d`` (first uses are left out).

    The hits of an LRU cache of C blocks are ``hist[:C].sum()``.
    """
    n_req = len(start) - 1
    diff = np.zeros(n_blocks + 2, dtype=np.int64)
    last = {}  # edge -> last request that touched it
    fen = Fenwick(max(n_req, 1))
    for r in range(n_req):
        s, t = start[r], start[r + 1]
        if s == t:
            continue
        # Segments of the path (root first) with the same last toucher q; q never grows.
        segments = []
        i = s
        while i < t:
            q = last.get(path[i], -1)
            if q < 0:
                break
            blocks = 0
            while i < t and last.get(path[i], -1) == q:
                blocks += length[path[i]]
                i += 1
            segments.append((q, blocks))
        new_blocks = 0
        for j in range(i, t):
            new_blocks += length[path[j]]
        before_r = fen.prefix(r)
        for q, blocks in segments:
            w = before_r - fen.prefix(q + 1)
            diff[w] += 1
            diff[w + blocks] -= 1
        for q, blocks in segments:
            fen.add(q, -blocks)
        fen.add(r, sum(b for _, b in segments) + new_blocks)
        for j in range(s, t):
            last[path[j]] = r
    return np.cumsum(diff)[: n_blocks + 1]


def lru_hits(hist: np.ndarray, capacities: Sequence[int]) -> list[int]:
    """Block hits of LRU at each capacity (in blocks), from the distance histogram."""
    cum = np.concatenate(([0], np.cumsum(hist)))
    return [int(cum[min(max(c, 0), len(hist))]) for c in capacities]


def policy_keys(
    policy: str,
    path: Sequence[int],
    start: Sequence[int],
    bottom_depth: Sequence[int],
    next_use: Sequence[int] | None = None,
) -> list[int | None]:
    """Eviction key of each path position (the touch of an edge by a request); smallest goes.

    None of the three policies' keys depends on the cache size (LFU counts every use, cached or
    not), so they are computed once for all sizes, packed into one int each:

        lru     (request, -depth)            least recent; ties: deeper first
        lfu     (uses so far, request, -depth)
        belady  (-next use, -depth)          needed furthest away first; None: never again
    """
    if policy not in ("lru", "lfu", "belady"):
        raise ValueError(f"unknown policy {policy!r}")
    if policy == "belady" and next_use is None:
        raise ValueError("belady needs next_use")
    d = max(bottom_depth, default=0) + 1
    n_req = len(start)
    keys: list[int | None] = [0] * len(path)
    freq: dict[int, int] = {}
    for r in range(n_req - 1):
        for i in range(start[r], start[r + 1]):
            e = path[i]
            depth = bottom_depth[e]
            if policy == "lru":
                keys[i] = r * d + (d - 1 - depth)
            elif policy == "lfu":
                f = freq[e] = freq.get(e, 0) + 1
                keys[i] = (f * n_req + r) * d + (d - 1 - depth)
            else:
                nu = next_use[i]
                keys[i] = None if nu >= INF else -(nu * d + depth)
    return keys


def simulate(
    policy: str,
    capacity: int,
    path: Sequence[int],
    start: Sequence[int],
    length: Sequence[int],
    bottom_depth: Sequence[int],
    next_use: Sequence[int] | None = None,
    keys: Sequence[int | None] | None = None,
) -> int:
    """Block hits of ``policy`` ("lru", "lfu" or "belady") with a cache of ``capacity`` blocks.

    ``next_use[i]`` (Belady only, from :func:`next_uses`) is the next request touching
    ``path[i]`` after the request at hand, ``INF`` if none. ``keys`` (from :func:`policy_keys`)
    may be given to share them between sizes.
    """
    if keys is None:
        keys = policy_keys(policy, path, start, bottom_depth, next_use)
    n_edges = len(length)
    cached = [0] * n_edges
    current = [0] * n_edges  # the key of the edge's last touch; older heap entries are stale
    heap: list[int] = []  # key * n_edges + edge: one int compares fastest
    push, pop = heapq.heappush, heapq.heappop
    total = 0
    hits = 0
    for r in range(len(start) - 1):
        s, t = start[r], start[r + 1]
        for i in range(s, t):
            e = path[i]
            c = cached[e]
            hits += c
            if c < length[e]:
                break
        for i in range(s, t):
            e = path[i]
            k = keys[i]
            if k is None:  # Belady: never needed again, and neither are its descendants
                for j in range(i, t):
                    total -= cached[path[j]]
                    cached[path[j]] = 0
                break
            total += length[e] - cached[e]
            cached[e] = length[e]
            current[e] = k
            push(heap, k * n_edges + e)
        while total > capacity:
            k, e = divmod(heap[0], n_edges)
            if current[e] != k or cached[e] == 0:
                pop(heap)
                continue
            x = min(cached[e], total - capacity)
            cached[e] -= x
            total -= x
            if cached[e] == 0:
                pop(heap)
    return hits


def next_uses(path: Sequence[int], start: Sequence[int]) -> list[int]:
    """For each path position, the next request touching the same edge (``INF`` if none)."""
    nxt = [INF] * len(path)
    seen: dict[int, int] = {}
    for r in range(len(start) - 2, -1, -1):
        for i in range(start[r], start[r + 1]):
            e = path[i]
            nxt[i] = seen.get(e, INF)
            seen[e] = r
    return nxt


# Fork-shared inputs of the per-size simulations (see ``run_simulations``).
_SHARED: dict = {}


def _simulate_task(task: tuple[str, int]) -> int:
    policy, capacity = task
    shared = _SHARED
    return simulate(policy, capacity, shared["path"], shared["start"], shared["length"],
                    shared["bottom_depth"], keys=shared["keys"][policy])


def run_simulations(
    tasks: list[tuple[str, int]],
    path: list[int],
    start: list[int],
    length: list[int],
    bottom_depth: list[int],
    next_use: list[int],
    jobs: int = 1,
) -> list[int]:
    """Hits of each ``(policy, capacity)``; with ``jobs > 1`` in forked worker processes."""
    keys = {p: policy_keys(p, path, start, bottom_depth, next_use) for p in {t[0] for t in tasks}}
    _SHARED.update(path=path, start=start, length=length, bottom_depth=bottom_depth, keys=keys)
    try:
        if jobs <= 1 or len(tasks) <= 1:
            return [_simulate_task(t) for t in tasks]
        import multiprocessing as mp

        # Longest first, so the last busy worker is not the slow one.
        order = sorted(range(len(tasks)), key=lambda k: -tasks[k][1])
        with mp.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
            done = pool.map(_simulate_task, [tasks[k] for k in order], chunksize=1)
        out = [0] * len(tasks)
        for k, v in zip(order, done):
            out[k] = v
        return out
    finally:
        _SHARED.clear()
