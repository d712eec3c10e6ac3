"""The engine's figures: ``EngineStats`` (server, metrics), ``cache_stats()`` (the offline API's
dict, docs/engine.md) and a tenant's own ``TenantStats``. Read-only views of an ``LLMEngine``'s
parts (pool, scheduler, tiers, segment store); the engine's methods of the same names call these.
The argument is named ``self`` on purpose: these are the engine's methods, kept in their own
module because engine.py is the step loop.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.engine_api import EngineStats, TenantStats
from prefixcache.engine_tiers import tier_dict


def cache_stats(self) -> dict:
    """The offline API's view of ``stats()`` (the keys documented in docs/engine.md)."""
    st = engine_stats(self)
    return {
        "query_tokens": st.prefix_cache_queries_total,
        "hit_tokens": st.prefix_cache_hits_total,
        "hit_rate": st.hit_rate,
        "cached_blocks": st.cached_blocks,
        "free_blocks": st.free_blocks,
        "in_use_blocks": st.in_use_blocks,
        "pinned_blocks": st.pinned_blocks,
        "total_blocks": st.total_blocks,
        "block_size": st.block_size,
        "used_bytes": st.used_bytes,
        "capacity_bytes": st.capacity_bytes,
        "evicted_blocks": st.evicted_blocks_total,
        "enable_prefix_caching": st.enable_prefix_caching,
        "kv_cache_dtype": self.layout.kv_format.name,
        "bytes_per_token": self.layout.bytes_per_token,
        "capacity_tokens": self.layout.capacity_tokens,
        "tiers": {t.name: tier_dict(t) for t in st.tiers},
        "segments": self.segments.stats(),
    }


def engine_stats(self) -> EngineStats:
    c = self.pool.counts()
    bs = self.config.block_size
    return EngineStats(
        num_running=len(self.scheduler.running),
        num_waiting=len(self.scheduler.waiting),
        num_preemptions_total=self.scheduler.counters.num_preemptions,
        prompt_tokens_total=self.kv.query_tokens,
        generation_tokens_total=self.generation_tokens_total,
        prefix_cache_queries_total=self.kv.query_tokens,
        prefix_cache_hits_total=self.kv.hit_tokens,
        evicted_blocks_total=self.pool.evicted_blocks,
        kv_cache_usage=c.in_use / c.total,
        cached_blocks=c.cached,
        free_blocks=c.free,
        in_use_blocks=c.in_use,
        pinned_blocks=c.pinned,
        total_blocks=c.total,
        block_size=bs,
        used_bytes=(c.cached + c.in_use) * bs * self.layout.bytes_per_token,
        capacity_bytes=self.layout.capacity_bytes,
        enable_prefix_caching=self.kv.enable_caching,
        num_fairness_preemptions_total=self.scheduler.counters.fairness_preemptions,
        num_shared_steps_total=self.scheduler.counters.shared_steps,
        tiers=tuple(self.tiers.stats()),
    )


def tenant_stats(self, tenant: str | None, owns: Callable[[str | None], bool]) -> TenantStats:
    """``tenant``'s own numbers; ``owns(namespace)`` says which namespaces are its."""
    query, hit = self.kv.by_tenant.get(tenant, (0, 0))
    index = self.pool.index
    return TenantStats(
        tenant=tenant,
        num_running=sum(1 for s in self.scheduler.running if s.tenant == tenant),
        num_waiting=sum(1 for s in self.scheduler.waiting if s.tenant == tenant),
        prompt_tokens_total=query,
        prefix_cache_hits_total=hit,
        generation_tokens_total=self._generated_by_tenant[tenant],
        pinned_blocks=self.pool.pinned_by(tenant),
        namespace_blocks={
            ns: index.num_blocks_in_namespace(ns)
            for ns in index.namespaces()
            if ns is not None and owns(ns)
        },
        tier_hit_tokens=self.tiers.tenant_tokens(tenant),
        tier_usage=self.tiers.tenant_usage(tenant),
    )
