"""``lru``: least recently used first (what vLLM, SGLang and the engine do)."""

from __future__ import annotations

from prefixcache.cache.eviction.policy import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used first; among blocks touched together the deeper one."""

    name = "lru"
