"""Eviction policies over a forest of cached prefix blocks: which cached block goes next.

Torch-free and pool-agnostic: a policy sees block ids (any hashable), each with its parent (the
block before it in the prompt, ``None`` for a first block), and answers ``evict()`` with one
victim. The engine's block pool and the trace simulator (``analyze/trace_sim.py``) drive the
same classes, so what the simulator measures is what the pool would do.

One module per policy, over the base of ``policy.py`` (the block forest, references, candidate
heaps, held counts, retention priority within a group; the invariants every policy keeps):

- ``lru.py``: ``lru``, least recently used first;
- ``lru_demote.py``: ``lru-demote``, LRU with quick demotion of blocks never reused;
- ``hit_density.py``: ``hit-density``, LHD's least hit density, learned online;
- ``adaptive.py``: ``adaptive``, set dueling over those three;
- ``registry.py``: the names (``POLICY_NAMES``), ``make_policy``, ``parse_policies``.

The offline optimum, ``belady``, is an analysis tool the engine cannot run (it needs the
future): ``analyze/belady.py``, beside the trace simulator that gives it each block's next use.

The engine's pool (``block_pool.py``) names blocks by key (content, as the trace's hash ids),
holds a reference for each user and one for a pin, ticks once per admitted request and releases
a request's blocks as one use; ``num_reclaimable`` (blocks neither referenced nor above a
referenced one) is what it may allocate by evicting.
"""

from prefixcache.cache.eviction.adaptive import AdaptivePolicy
from prefixcache.cache.eviction.hit_density import HitDensityPolicy
from prefixcache.cache.eviction.lru import LRUPolicy
from prefixcache.cache.eviction.lru_demote import DemotePolicy
from prefixcache.cache.eviction.policy import (
    Block,
    EvictionError,
    EvictionPolicy,
    NoEvictableBlock,
)
from prefixcache.cache.eviction.registry import POLICY_NAMES, make_policy, parse_policies

__all__ = [
    "POLICY_NAMES",
    "AdaptivePolicy",
    "Block",
    "DemotePolicy",
    "EvictionError",
    "EvictionPolicy",
    "HitDensityPolicy",
    "LRUPolicy",
    "NoEvictableBlock",
    "make_policy",
    "parse_policies",
]
