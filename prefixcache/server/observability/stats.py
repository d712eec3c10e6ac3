"""What ``/v1/cache/stats`` shows a caller, and the dashboard's data with it: an admin the
engine's cache statistics, live request counts and KV geometry; anyone else its own tenant's
numbers and namespaces only (the pool is shared, its counts are not). Read on the cache
routes' threads (base/cache_gate.py), within the caller's cap.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass

from prefixcache.server.base.auth import Tenant
from prefixcache.server.base.serving import Serving


def as_dict(x) -> dict:
    if is_dataclass(x):
        return asdict(x)
    if hasattr(x, "_asdict"):
        return x._asdict()
    return dict(x)


async def stats_for(s: Serving, tenant: Tenant) -> dict:
    """The body of ``/v1/cache/stats`` for ``tenant`` (the dashboard's data shows the same)."""
    if tenant.admin:
        out = await s.cache_gate.run(tenant.name, _stats, s.engine, rated=False)  # an admin
        out["prompt_cache_keys"] = s.cache_keys.of(tenant.name)  # its own keys only
        return out
    own = await s.cache_gate.run(
        tenant.name, s.engine.tenant_stats, tenant.name,
        lambda ns: ns is not None and s.tenants.owns(tenant, ns), rated=True,
    )  # fmt: skip  (no body to read first: charged here)
    out = as_dict(own)
    out["hit_rate"] = own.hit_rate
    out["kv"] = dict(s.engine.kv_info)
    out["prompt_cache_keys"] = s.cache_keys.of(tenant.name)
    return out


def _stats(engine) -> dict:
    st = engine.engine_stats()
    out = dict(engine.cache_stats())
    out["engine"] = as_dict(st)
    out["kv"] = dict(engine.kv_info)
    return out
