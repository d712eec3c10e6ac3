"""The live cache dashboard: ``GET /dashboard`` (a static page) and its data,
``GET /v1/cache/dashboard``.

The page (``static/dashboard.html``, ``.js``, ``.css``: shipped in the package, no build step,
nothing from another origin) is served without auth: it holds no data. It asks for an API key
once, keeps it in the tab (``sessionStorage``), and polls the data route with it; on an open
server (no keys: ``GET /dashboard/auth`` says so, also without auth) it asks for none. The data route
is authenticated like every API route and scoped like ``/v1/cache/stats``, whose body it carries
unchanged (``stats``, from the same function): an admin sees the whole server, anyone else only
their own tenant, its namespaces and its requests. ``summary`` puts the figures the page shows
under one set of names for both views; ``activity`` comes from :class:`~.activity.Activity`,
already scoped per tenant. Tiers, when the engine reports them in the stats, are shown from
``stats`` by the page as they come.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from prefixcache.server.base.auth import Tenant
from prefixcache.server.base.serving import Serving
from prefixcache.server.edge.errors import APIError
from prefixcache.server.observability.stats import stats_for

router = APIRouter()

_STATIC = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The page handles an API key: nothing runs or loads from anywhere but this server, and no
# other site may frame it.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _static(name: str) -> Response:
    body = resources.files("prefixcache.server.observability").joinpath("static", name).read_bytes()
    return Response(body, media_type=_STATIC[name], headers=_HEADERS)


@router.get("/dashboard")
async def page() -> Response:
    return _static("dashboard.html")


@router.get("/dashboard/auth")
async def auth(request: Request) -> Response:
    """Whether the data route needs a key: the page connects to an open server by itself. Says
    nothing a 401 from any route would not."""
    s: Serving = request.app.state.serving
    body = json.dumps({"auth_required": s.tenants.auth_required}).encode()
    return Response(body, media_type="application/json", headers=_HEADERS)


@router.get("/dashboard/{name}")
async def asset(name: str) -> Response:
    if name not in _STATIC:
        raise APIError(404, f"no such dashboard file: {name[:64]!r}")
    return _static(name)


@router.get("/v1/cache/dashboard")
async def data(request: Request) -> dict:
    """Everything the page shows, for the caller: the whole server for an admin, else its own
    tenant only (its traffic, its namespaces' blocks, its pins, its requests)."""
    s: Serving = request.app.state.serving
    tenant = s.tenants.authenticate(request.headers.get("authorization"))
    now, stats, blocks = await _engine_view(s, tenant)
    if tenant.admin:

        def visible(name: str) -> bool:
            return True
    else:

        def visible(name: str) -> bool:
            return name == tenant.name

    activity = s.activity.view(tenant.name, visible)

    def owned(ns: str) -> bool:
        return s.tenants.owns(tenant, ns)

    return {
        "time": now,
        "tenant": tenant.name,
        "admin": tenant.admin,
        "summary": summary(stats, tenant),
        "namespaces": namespaces(blocks, activity.pop("namespaces"), owned),
        "activity": activity,
        "stats": stats,
    }


# Engine figures are read under the engine's lock, which a running step holds, in a worker
# thread. However many tabs poll, each tenant's figures are read at most once per _FRESH_S and
# shared by the polls in between, so dashboards cannot fill the worker threads (which also
# tokenize requests) with waits on that lock. Keyed by tenant and admin flag: one scope each.
_FRESH_S = 0.5
_clock = time.monotonic
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Serving -> {key: (t, task)}


async def _engine_view(s: Serving, tenant: Tenant) -> tuple[float, dict, dict[str, int]]:
    views = _views.setdefault(s, {})
    key = (tenant.name, tenant.admin)
    fresh = views.get(key)
    if fresh is None or fresh[0] < _clock():
        fresh = views[key] = (_clock() + _FRESH_S, asyncio.ensure_future(_read(s, tenant)))
    return await asyncio.shield(fresh[1])  # a poll that goes away leaves the read to the others


async def _read(s: Serving, tenant: Tenant) -> tuple[float, dict, dict[str, int]]:
    stats = await stats_for(s, tenant)
    if not tenant.admin:
        return time.time(), stats, stats["namespace_blocks"]
    every = await s.cache_gate.run(
        tenant.name, s.engine.tenant_stats, None, lambda ns: ns is not None, rated=False
    )  # an admin's
    return time.time(), stats, every.namespace_blocks


def summary(stats: dict, tenant: Tenant) -> dict:
    """The page's figures under one set of names. For a non-admin the pool figures are its
    own: ``cached_blocks`` are the blocks indexed in its namespaces, ``kv_usage`` their share
    of the pool; the pool's free, in-use and evicted counts are the server's and stay None."""
    if tenant.admin:
        e = stats["engine"]
        return {
            "scope": "server",
            "hit_rate": stats["hit_rate"],
            "query_tokens": stats["query_tokens"],
            "tokens_saved": stats["hit_tokens"],
            "generation_tokens": e["generation_tokens_total"],
            "requests_running": e["num_running"],
            "requests_waiting": e["num_waiting"],
            "kv_usage": e["kv_cache_usage"],
            "cached_blocks": stats["cached_blocks"],
            "pinned_blocks": stats["pinned_blocks"],
            "in_use_blocks": stats["in_use_blocks"],
            "free_blocks": stats["free_blocks"],
            "total_blocks": stats["total_blocks"],
            "evicted_blocks": stats["evicted_blocks"],
        }
    total = stats["kv"]["num_blocks"]
    own = sum(stats["namespace_blocks"].values())
    return {
        "scope": "tenant",
        "hit_rate": stats["hit_rate"],
        "query_tokens": stats["prompt_tokens_total"],
        "tokens_saved": stats["prefix_cache_hits_total"],
        "generation_tokens": stats["generation_tokens_total"],
        "requests_running": stats["num_running"],
        "requests_waiting": stats["num_waiting"],
        "kv_usage": own / total if total else 0.0,
        "cached_blocks": own,
        "pinned_blocks": stats["pinned_blocks"],
        "in_use_blocks": None,
        "free_blocks": None,
        "total_blocks": total,
        "evicted_blocks": None,
    }


def namespaces(blocks: dict[str, int], usage: dict[str, dict], owned) -> list[dict]:
    """One row per namespace the viewer may see: the blocks cached there now, and the viewer's
    requests. A shared namespace's blocks are every tenant's: a non-admin gets None there."""
    rows = []
    for ns in sorted(set(blocks) | set(usage)):
        n = blocks.get(ns, 0 if owned(ns) else None)
        rows.append({"namespace": ns, "blocks": n, **(usage.get(ns) or {})})
    return rows
