"""Cost of the cache core per request: lookup, and admit + commit + free with eviction.

Torch-free: drives ``KVCacheManager`` over a ``BlockPool`` the way the scheduler does (match,
admit with allocation, mark computed, commit, free), no model. The workload is a forest of
shared prefixes (``--groups`` system prompts, conversations growing turn by turn) in a pool of
``--blocks`` blocks that holds a fraction of it, so most admissions evict. ``--inflight``
sequences are held at once (they hold their blocks, as running requests do).

Prints, per ``--eviction-policy`` (where the pool takes one), the median over ``--repeat`` runs
of microseconds per request and per block touched, for ``lookup`` (the server's pre-check,
``KVCacheManager.lookup``) and for the whole admit-to-free cycle.

Usage (before/after on one host: run the old tree with PYTHONPATH pointing at it):
  .venv/bin/python benchmarks/pool_bench.py [--eviction-policy lru,lru-demote,hit-density]
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import time

from prefixcache.api.request import SamplingParams
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import kv_cache_manager
from prefixcache.sequence import Sequence

B = 16
FP = "pool-bench"


def workload(n: int, groups: int, seed: int) -> list[list[int]]:
    """``n`` prompts: a group's system prompt (256-1,024 tokens), then a conversation that
    grows by 64-256 tokens a turn (60% of requests continue one, the rest start one)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.randrange(256, 1025))]
               for _ in range(groups)]
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.6:
            i = rng.randrange(len(convs))
            p = convs[i] + [rng.randrange(1, 30000) for _ in range(rng.randrange(64, 257))]
            convs[i] = p
        else:
            p = rng.choice(systems) + [rng.randrange(1, 30000) for _ in range(rng.randrange(64, 257))]
            convs.append(p)
            if len(convs) > 64:
                convs.pop(0)
        out.append(p)
    return out


def make_pool(blocks: int, policy: str | None) -> BlockPool:
    if policy is None or "eviction_policy" not in inspect.signature(BlockPool).parameters:
        return BlockPool(blocks, B)
    return BlockPool(blocks, B, eviction_policy=policy)


def run_once(prompts: list[list[int]], blocks: int, policy: str | None, inflight: int) -> dict:
    pool = make_pool(blocks, policy)
    kv = kv_cache_manager(pool, FP)
    root = kv.root(None)
    sp = SamplingParams(max_tokens=1, temperature=0)
    touched = sum(len(p) // B for p in prompts)
    live: list[Sequence] = []
    t_lookup = 0.0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        t1 = time.perf_counter()
        kv.lookup(p, None)  # the server's pre-check, on the pool as it is now
        t_lookup += time.perf_counter() - t1
        s = Sequence.of(f"r{i}", p, sp, root=root)
        m = kv.match(s)
        while not kv.admit(s, m, s.num_tokens - m.num_tokens):
            kv.free(live.pop(0))  # out of blocks: the oldest finishes first
        kv.mark_computed(s, s.num_tokens)
        kv.commit(s)
        live.append(s)
        if len(live) > inflight:
            kv.free(live.pop(0))
    for s in live:
        kv.free(s)
    t_cycle = time.perf_counter() - t0 - t_lookup
    n = len(prompts)
    return {
        "lookup_us_per_request": 1e6 * t_lookup / n,
        "cycle_us_per_request": 1e6 * t_cycle / n,
        "cycle_us_per_block": 1e6 * t_cycle / touched,
        "hit_rate": kv.hit_tokens / kv.query_tokens,
        "evicted_blocks": pool.evicted_blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2048, help="pool size in blocks of 16 tokens")
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eviction-policy", default="lru",
                    help="comma-separated; ignored by a pool that takes none (the old one)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    prompts = workload(args.requests, args.groups, args.seed)
    takes = "eviction_policy" in inspect.signature(BlockPool).parameters
    policies = args.eviction_policy.split(",") if takes else ["(built-in lru)"]
    out = {}
    for pol in policies:
        runs = [run_once(prompts, args.blocks, pol if takes else None, args.inflight)
                for _ in range(args.repeat)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out[pol] = row
        print(f"{pol:>16}: lookup {row['lookup_us_per_request']:7.1f} us/request, "
              f"cycle {row['cycle_us_per_request']:7.1f} us/request "
              f"({row['cycle_us_per_block']:.2f} us/block), hit rate {row['hit_rate']:.3f}, "
              f"evicted {row['evicted_blocks']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
