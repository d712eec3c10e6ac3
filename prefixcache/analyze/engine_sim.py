"""A Mooncake trace through the engine's own cache core: what a live replay should measure.

The trace model (``trace_sim.py``) is the issue's: a request hits its leading run of cached hash
ids, a partial last block included, then all its blocks are cached and the policy evicts down
to C. The engine differs in three ways, and this simulation has them all because it *is* the
engine's cache code (``cache/block_pool.py`` and ``cache/manager.py``, torch-free), driven the
way the scheduler drives it for one request at a time:

- **a partial tail is never cached**: only full blocks are hashed and shared; a prompt's last
  partial block is hit only token-exactly, when a cached full block starts with its tokens (the
  same hash id, full in another request), by copying them (token-exact reuse, on by default as
  in the engine; the figures of docs/benchmarks-journal.md "Real traces: eviction" predate it);
- **a hit is at most len - 1 tokens**: a fully cached prompt still computes its last token (its
  logits are needed), so it recomputes its last block (and then shares the cached copy);
- **in-flight blocks**: a request holds its hits and its new blocks while it runs; eviction
  happens when its blocks are allocated (chunk by chunk, ``max_num_batched_tokens``), never
  takes one of them, and the pool's capacity includes its private partial block.

The fourth difference, **generated blocks** (the engine caches the blocks its answers fill),
is removed by the replay's conditions instead: one output token (its KV is never computed), one
request at a time (``bench serve --max-concurrency 1 --extra-body '{"max_tokens": 1}'``). Under
those conditions a live server's hit rate is this simulation's (docs/benchmarks-journal.md "Real
traces: eviction" compares the three).

Token ids: each hash id stands for ``block_tokens`` ids drawn from a generator seeded by the id
(a partial block is the first ones), the lengths scaled as ``bench serve --dataset-name
mooncake-trace`` scales them (``TraceRequest.scaled_block_lengths``), so equal ids are equal
tokens and the block structure is the replay's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prefixcache.api.request import SamplingParams
from prefixcache.bench.mooncake import TraceRequest
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import kv_cache_manager
from prefixcache.sequence import Sequence


@dataclass(frozen=True)
class EngineSimResult:
    policy: str
    num_blocks: int
    block_tokens: int
    query_tokens: int  # the replay's prompt tokens (scaled)
    hit_tokens: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def trace_prompts(requests: list[TraceRequest], block_tokens: int,
                  vocab: int = 1 << 30) -> list[list[int]]:
    """Each request's synthetic token ids in ``[1, vocab)`` (see the module docstring)."""
    blocks: dict[int, list[int]] = {}
    out = []
    for r in requests:
        ids: list[int] = []
        for h, m in zip(r.hash_ids, r.scaled_block_lengths(block_tokens)):
            toks = blocks.get(h)
            if toks is None:
                rng = random.Random(h)
                toks = blocks[h] = [rng.randrange(1, vocab) for _ in range(block_tokens)]
            ids.extend(toks[:m])
        out.append(ids)
    return out


def simulate_engine(requests: list[TraceRequest], policy: str, num_blocks: int,
                    block_tokens: int = 16, max_num_batched_tokens: int = 2048,
                    prompts: list[list[int]] | None = None,
                    partial_reuse: bool = True) -> EngineSimResult:
    """Replay ``requests`` one at a time through a pool of ``num_blocks`` blocks of
    ``block_tokens`` tokens with eviction ``policy``; the hit rate is the engine's own count
    (``KVCacheManager.hit_tokens``: tokens served from cache at admission)."""
    if prompts is None:
        prompts = trace_prompts(requests, block_tokens)
    pool = BlockPool(num_blocks, block_tokens, eviction_policy=policy)
    kv = kv_cache_manager(pool, "mooncake-replay", partial_reuse=partial_reuse)
    root = kv.root(None)
    params = SamplingParams(max_tokens=1, temperature=0)
    budget = max_num_batched_tokens
    for i, ids in enumerate(prompts):
        s = Sequence.of(f"trace-{i}", ids, params, root=root)
        m = kv.match(s)
        if not kv.admit(s, m, min(s.num_tokens - m.num_tokens, budget)):
            raise ValueError(f"request {i} ({s.num_tokens} tokens) does not fit a pool of "
                             f"{num_blocks} blocks of {block_tokens}")
        kv.copy_partial_blocks(lambda copies: None)  # a partial hit's copy (no KV here)
        while True:  # one prefill step per chunk: compute, register, grow
            kv.mark_computed(s, min(s.num_tokens, s.kv.num_computed_tokens + budget,
                                    len(s.kv.block_table) * block_tokens))
            kv.commit(s)
            left = s.num_tokens - s.kv.num_computed_tokens
            if left == 0:
                break
            if not kv.allocate_slots(s, min(left, budget)):
                raise ValueError(f"request {i} ({s.num_tokens} tokens) does not fit a pool of "
                                 f"{num_blocks} blocks of {block_tokens}")
        kv.free(s)
    return EngineSimResult(policy, num_blocks, block_tokens, kv.query_tokens, kv.hit_tokens,
                           pool.evicted_blocks)
