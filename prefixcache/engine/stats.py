"""The engine's figures, read at one moment from the parts that count them: ``EngineStats``
(server, metrics), the offline API's ``cache_stats()`` dict (docs/engine.md) and a tenant's own
``TenantStats``. Pure functions of their arguments; ``Generated`` is the one counter the step
loop keeps itself (tokens sampled, per tenant).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from prefixcache.api.engine import EngineStats, TenantStats
from prefixcache.cache.connector import ConnectorSet
from prefixcache.cache.manager import KVCacheManager
from prefixcache.engine.scheduler import Scheduler
from prefixcache.kv.pool import KVLayout


@dataclass
class Generated:
    """Tokens sampled, in all and per tenant (the step loop's ``add``)."""

    total: int = 0
    by_tenant: Counter = field(default_factory=Counter)

    def add(self, tenant: str | None) -> None:
        self.total += 1
        self.by_tenant[tenant] += 1


def engine_stats(kv: KVCacheManager, scheduler: Scheduler, layout: KVLayout, generated: Generated,
                 connectors: ConnectorSet) -> EngineStats:  # fmt: skip
    c = kv.counts()
    bs = layout.block_size
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preemptions_total=scheduler.counters.num_preemptions,
        prompt_tokens_total=kv.query_tokens,
        generation_tokens_total=generated.total,
        prefix_cache_queries_total=kv.query_tokens,
        prefix_cache_hits_total=kv.hit_tokens,
        evicted_blocks_total=kv.evicted_blocks,
        kv_cache_usage=c.in_use / c.total,
        cached_blocks=c.cached,
        free_blocks=c.free,
        in_use_blocks=c.in_use,
        pinned_blocks=c.pinned,
        total_blocks=c.total,
        block_size=bs,
        used_bytes=(c.cached + c.in_use) * bs * layout.block_bytes_per_token
        + (0 if kv.window is None else kv.window.num_used * bs * layout.window_bytes_per_token),
        capacity_bytes=layout.capacity_bytes,
        enable_prefix_caching=kv.enable_caching,
        num_fairness_preemptions_total=scheduler.counters.fairness_preemptions,
        num_shared_steps_total=scheduler.counters.shared_steps,
        tiers=tuple(connectors.stats().get("tiers", ())),
    )


def cache_stats(st: EngineStats, layout: KVLayout, connectors: ConnectorSet) -> dict:
    """The offline API's view of ``st`` (the keys documented in docs/engine.md)."""
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
        "kv_cache_dtype": layout.kv_format.name,
        "bytes_per_token": layout.bytes_per_token,
        "capacity_tokens": layout.capacity_tokens,
        "tiers": {t.name: tier_dict(t) for t in st.tiers},
        "segments": connectors.stats().get("segments", {}),
    }


def tier_dict(t) -> dict:
    """A TierStats as the plain dict of ``cache_stats()["tiers"][name]``."""
    d = asdict(t)
    d["restore_tokens_per_second"] = t.restore_tokens_per_second
    return d


def tenant_stats(tenant: str | None, owns: Callable[[str | None], bool], kv: KVCacheManager,
                 scheduler: Scheduler, generated: Generated,
                 connectors: ConnectorSet) -> TenantStats:  # fmt: skip
    """``tenant``'s own numbers; ``owns(namespace)`` says which namespaces are its."""
    query, hit = kv.by_tenant.get(tenant, (0, 0))
    tiers = connectors.tenant_stats(tenant).get("tiers", {})
    return TenantStats(
        tenant=tenant,
        num_running=sum(1 for s in scheduler.running if s.tenant == tenant),
        num_waiting=sum(1 for s in scheduler.waiting if s.tenant == tenant),
        prompt_tokens_total=query,
        prefix_cache_hits_total=hit,
        generation_tokens_total=generated.by_tenant[tenant],
        pinned_blocks=kv.pinned_by(tenant),
        namespace_blocks={
            ns: kv.blocks_in_namespace(ns)
            for ns in kv.namespaces()
            if ns is not None and owns(ns)
        },
        tier_hit_tokens=tiers.get("hit_tokens", {}),
        tier_usage=tiers.get("usage", {}),
    )
