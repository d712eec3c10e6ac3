"""Cache control: ``/v1/cache/warm``, ``/lookup``, ``/invalidate``, ``/stats``.

Authenticated like the completions routes, and scoped the same way: a prompt is warmed or looked
up in the caller's namespace (its tenant, plus ``cache_salt``), which the server derives. With a
shared salt, the part declared shared goes to the shared namespace: an admin's whole prompt (a
public prefix), anyone else's chat's leading system messages; /lookup answers for the body what
/warm with the same body would store.
Invalidating another tenant's namespace, or all of them, takes an admin key. Prompts are
validated like a completion's (vocabulary, at most the context length) before they are hashed.
``/stats`` shows an admin everything and anyone else only their own tenant's numbers.
Warm, lookup, invalidate and stats call the engine on the cache routes' own threads, at most a
few at once per tenant and a rate per second charged before a body is read (base/cache_gate.py: 429
above), never on the default executor that tokenizes, nor on the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from prefixcache.api.request import SharedPrefix
from prefixcache.server.base.auth import CacheScope, Tenant
from prefixcache.server.base.protocol import parse_body
from prefixcache.server.base.serving import Serving, accept, authenticate
from prefixcache.server.cache.protocol import (
    CacheInvalidateRequest,
    CacheLookupRequest,
    CacheWarmRequest,
    _CacheQuery,
)
from prefixcache.server.edge.errors import (
    APIError,
    from_engine_error,
    internal_error,
    request_id_of,
)
from prefixcache.server.observability.stats import as_dict, stats_for
from prefixcache.server.openai.prompt import chat_prompt

router = APIRouter(prefix="/v1/cache")


@router.post("/warm")
async def warm(request: Request) -> dict:
    """Prefill a prompt into the cache (no tokens generated); optionally pin it for a TTL.

    A call of the tenant's cache-call rate (charged before the body is read), admitted to the
    queue before the prompt is tokenized, and admitted once to the cache routes' threads, on
    which its lookup and pin wait for the engine lock (base/cache_gate.py): a renewal of a pin the
    tenant already holds costs no pin quota, so it is these that bound how often it can ask."""
    s, tenant, req, scope = await accept(request, CacheWarmRequest, charge=True)
    if req.ttl_seconds is not None and not req.pin:
        raise APIError(400, "ttl_seconds applies to pinned prompts: set pin: true", param="pin")
    s.check_admission(tenant, 1)
    with s.cache_gate.admitted(tenant.name, rated=False) as ticket:
        if req.cache_mode == "segments":
            return await _warm_segments(request, s, tenant, req, scope.namespace, ticket.call)
        ids, shared = await _prompt(s, req, tenant, scope)
        try:
            result = await s.engine.warm(
                ids, namespace=scope.namespace, pin=req.pin, ttl_seconds=req.ttl_seconds,
                tenant=tenant.name, quota=not tenant.admin, shared_prefix=shared,
                offload=ticket.call,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - typed errors map to 4xx, the rest is a logged 500
            rid = request_id_of(request.scope)
            raise (from_engine_error(e, rid) or internal_error(rid, e)) from None
    return {**as_dict(result), **_where(s, scope, shared)}


def _where(s: Serving, scope: CacheScope, shared) -> dict:
    """Where the prompt is cached: its namespace, and with a shared salt the shared namespace
    and how many leading tokens (whole blocks) go there."""
    out = {"namespace": scope.namespace}
    if scope.shared is not None:
        out.update(shared_namespace=scope.shared, shared_tokens=s.shared_tokens(shared))
    return out


async def _prompt(
    s: Serving, req: _CacheQuery, tenant: Tenant, scope: CacheScope
) -> tuple[list[int], SharedPrefix | None]:
    """The prompt of /v1/cache/warm and /lookup, validated like a completion's, and the
    prefix it declares shared: with a shared salt, an admin's whole prompt (a public
    prefix), else a chat's leading system messages, as a chat completion declares them;
    nothing of another tenant's raw prompt."""
    req.check_one_input()
    shared = scope.shared is not None
    if req.messages is not None:
        chat = await chat_prompt(
            s, req.messages, req.add_generation_prompt, system_prefix=shared and not tenant.admin
        )
        ids, declared = chat.ids, chat.system_tokens
    else:
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(s.text_ids, req.prompt, "prompt")
        else:
            ids = s.prompt_ids(list(req.prompt), "prompt")  # O(1) length check before the scan
        declared = 0
    if shared and tenant.admin:
        declared = len(ids)
    return ids, scope.prefix(declared)


async def _warm_segments(
    request: Request, s: Serving, tenant: Tenant, req: CacheWarmRequest, namespace, offload
) -> dict:
    """Each document message stored as a segment (docs/segments.md); nothing else prefilled.
    A request of the tenant's: 429 over its share of the queue, 400 over the segment limits."""
    if req.messages is None or req.prompt is not None:
        raise APIError(400, 'cache_mode "segments" warms document messages: give messages',
                       param="messages")  # fmt: skip
    if req.pin:
        raise APIError(400, "segments cannot be pinned", param="pin", code="unsupported")
    chat = await chat_prompt(s, req.messages, req.add_generation_prompt, segments=True)
    ids, spans = chat.ids, chat.spans
    if not spans:
        raise APIError(400, "no document message to warm as a segment", param="messages")
    try:
        stored = await s.engine.warm_segments(ids, list(spans), namespace, tenant=tenant.name,
                                              offload=offload)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - typed errors map to 4xx, the rest is a logged 500
        rid = request_id_of(request.scope)
        raise (from_engine_error(e, rid) or internal_error(rid, e)) from None
    return {
        "segments": len(spans),
        "segment_tokens": [b - a for a, b in spans],
        "already_cached_segments": stored,
        "namespace": namespace,
    }


@router.post("/lookup")
async def lookup(request: Request) -> dict:
    """How many tokens of a prompt would hit the cache now. Changes nothing."""
    s, tenant, req, scope = await accept(request, CacheLookupRequest, charge=True)
    ids, shared = await _prompt(s, req, tenant, scope)
    # Engine queries take its lock, which a running step holds: wait for it off the event loop,
    # on the cache routes' own threads (base/cache_gate.py), within the tenant's cap.
    result = await s.cache_gate.run(tenant.name, s.engine.lookup, ids, scope.namespace, shared,
                                    rated=False)  # fmt: skip  (charged by accept)
    return {**as_dict(result), **_where(s, scope, shared)}


@router.post("/invalidate")
async def invalidate(request: Request) -> dict:
    """Drop the cached blocks of a namespace; blocks running requests hold go when released."""
    s: Serving = request.app.state.serving
    tenant = authenticate(request)
    if not tenant.admin:
        s.cache_gate.take(tenant.name)  # its rate, before the body is read
    req = await parse_body(request, CacheInvalidateRequest, s.limits)
    if req.all:
        if req.namespace is not None or req.cache_salt is not None:
            raise APIError(400, "'all' excludes 'namespace' and 'cache_salt'", param="all")
        if not tenant.admin:
            raise APIError(403, "invalidating every namespace needs an admin key", param="all")
        return {
            "namespace": None,
            "dropped_blocks": await _invalidate(request, s, tenant, None),
        }
    if req.namespace is not None and req.cache_salt is not None:
        raise APIError(400, "give 'namespace' or 'cache_salt', not both", param="namespace")
    if req.namespace is not None:
        namespace = req.namespace
        if not s.tenants.owns(tenant, namespace):
            raise APIError(
                403,
                "invalidating another tenant's namespace needs an admin key",
                param="namespace",
            )
    else:
        namespace = s.tenants.namespace(tenant, req.cache_salt)
        if namespace in s.tenants.shared_namespaces and not tenant.admin:
            raise APIError(
                403, "invalidating a shared namespace needs an admin key", param="cache_salt"
            )
    dropped = await _invalidate(request, s, tenant, namespace)
    return {"namespace": namespace, "dropped_blocks": dropped}


async def _invalidate(request: Request, s: Serving, tenant: Tenant, namespace: str | None) -> int:
    """RAM blocks dropped; the namespace goes from the disk and Redis tiers too (503 when a
    tier cannot be reached: retry, the RAM part is done)."""
    try:
        return await s.cache_gate.run(tenant.name, s.engine.invalidate, namespace,
                                      rated=False)  # fmt: skip  (charged on arrival)
    except Exception as e:  # noqa: BLE001 - typed errors map to 4xx/503, the rest is a 500
        rid = request_id_of(request.scope)
        raise (from_engine_error(e, rid) or internal_error(rid, e)) from None


@router.get("/stats")
async def stats(request: Request) -> dict:
    """Admin: the engine's cache statistics, live request counts and KV geometry. Anyone else:
    their own tenant's numbers and namespaces only (the pool is shared, its counts are not)."""
    s: Serving = request.app.state.serving
    tenant = authenticate(request)
    return await stats_for(s, tenant)
