"""Replaying a Mooncake trace through a finite prefix cache, offline: hit rate per policy.

The cache model (the issue's, and the one ``analyze/simulate.py`` uses for request logs):

- the RAM cache holds at most C blocks (hash ids); a request hits on its leading run of cached
  blocks, worth ``min(k * 512, input_length)`` tokens; then all its blocks are cached and the
  policy evicts down to C (leaves first, never a block a request holds: here nothing is held
  between requests, the engine's in-flight blocks are not modelled);
- the policy is ``cache/eviction/``'s, the very classes the engine's pool is to use; Belady's
  optimum (``analyze/belady.py``) is the same forest with every block's next use known (a
  child is never needed before its parent, so leaves-first costs the optimum nothing);
- with a disk tier of ``D`` blocks behind RAM (two levels): write-through, as the engine's disk
  tier (docs/design.md §6b): every block computed is written, and the disk is an LRU over
  writes and restores (the engine's disk shares, one owner). A block missing from RAM but on
  disk is a *disk hit*: served at the tier's restore cost instead of recomputed. The hit run
  continues over blocks in RAM or on disk; the disk's LRU is not governed by the RAM policy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prefixcache.analyze.belady import BeladyPolicy
from prefixcache.bench.mooncake import TraceRequest
from prefixcache.cache.eviction import EvictionPolicy, make_policy

NEVER = 1 << 62


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int  # RAM blocks
    disk_capacity: int  # disk blocks (0: none)
    total_tokens: int
    ram_hit_tokens: int
    disk_hit_tokens: int

    @property
    def ram_hit_rate(self) -> float:
        return self.ram_hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """RAM + disk."""
        t = self.total_tokens
        return (self.ram_hit_tokens + self.disk_hit_tokens) / t if t else 0.0


def next_uses(requests: list[TraceRequest]) -> list[list[int]]:
    """``nxt[r][i]``: the next request after ``r`` using block ``i`` of request ``r``."""
    seen: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].hash_ids
        out[r] = [seen.get(h, NEVER) for h in ids]
        for h in ids:
            seen[h] = r
    return out


def simulate_trace(requests: list[TraceRequest], policy: str, capacity: int,
                   disk_capacity: int = 0, nxt: list[list[int]] | None = None) -> SimResult:
    """Hit tokens of ``policy`` (``POLICY_NAMES`` or "belady") with ``capacity`` RAM blocks."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    cache: EvictionPolicy
    if policy == "belady":
        cache = BeladyPolicy(capacity)
        if nxt is None:
            nxt = next_uses(requests)
    else:
        cache = make_policy(policy, capacity)
    disk: OrderedDict[int, None] = OrderedDict()
    total = ram_hits = disk_hits = 0
    for r, req in enumerate(requests):
        path = req.hash_ids
        if nxt is not None:
            for h, w in zip(path, nxt[r]):
                cache.set_next_use(h, w)  # type: ignore[attr-defined]
        k_ram = 0
        while k_ram < len(path) and path[k_ram] in cache:
            k_ram += 1
        k_all = k_ram
        if disk_capacity:
            while k_all < len(path) and path[k_all] in disk:
                disk.move_to_end(path[k_all])  # a restore reads it
                k_all += 1
        hit_ram = req.hit_tokens(k_ram)
        total += req.input_length
        ram_hits += hit_ram
        disk_hits += req.hit_tokens(k_all) - hit_ram
        # Blocks past the RAM run are (re)inserted; the access touches the run and inserts the
        # rest. Blocks after a gap that are still cached (a later block of the path found in RAM
        # after a miss) cannot occur: the cache is prefix-closed.
        cache.access(path)
        if disk_capacity:
            for h in path[k_all:]:  # computed: written through
                disk[h] = None
                disk.move_to_end(h)
            while len(disk) > disk_capacity:
                disk.popitem(last=False)
        while len(cache) > capacity:
            cache.evict()
    return SimResult(policy, capacity, disk_capacity, total, ram_hits, disk_hits)


def capacity_for(fraction: float, working_set: int) -> int:
    """RAM blocks for a fraction of the working set (distinct hash ids), at least 1."""
    return max(1, int(fraction * working_set))


def size_label(fraction: float) -> str:
    pct = fraction * 100
    return f"{pct:g}%"
