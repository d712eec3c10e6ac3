"""The cluster's HTTP front: a Ray Serve deployment with a FastAPI app (``build_ingress``).

- Generation and cache-query routes are forwarded to one replica, chosen by the router on the
  request's block keys (route_keys.py). A request whose replica dies before anything was sent
  back is retried on another (at most ``RETRIES`` times); once bytes went out, a stream ends
  with an OpenAI-style error event and a plain response is cut (the client sees the failure).
- ``/v1/cache/stats``, ``/v1/cache/invalidate``, ``/metrics``, ``/health`` and
  ``/v1/debug/integrity`` go to every replica (with the caller's own headers, so each replica
  applies the same auth and tenant scoping) and the answers are merged (aggregate.py);
  ``/v1/cluster`` (admin) lists the replicas and the router's decisions.
- The replicas authenticate and scope every request, with the same keys, so a cluster answers
  as one server. The ingress checks two things itself, before it reads a body (issue #37): a
  request to an API route (``/v1/...``) with a body must carry a known key (else the 401 the
  replica would give, unread), and a non-admin tenant over its refusal limit is answered 429
  ``too_many_refusals`` (server/edge/refusals.py): the ingress counts the refusals its replicas
  answer (400, 404, 413, 422, 429), so a tenant the replicas would refuse early is refused
  here before its body is read, parsed, rendered and tokenized for routing.
"""


import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.origin import OriginPolicy

log = logging.getLogger("prefixcache.cluster")

RETRIES = 2  # re-sends of a request whose replica died before answering
FANOUT_TIMEOUT = 30.0
FANOUT_ROUTES = {
    ("GET", "/v1/cache/stats"), ("POST", "/v1/cache/invalidate"), ("GET", "/metrics"),
    ("GET", "/health"), ("GET", "/v1/debug/integrity"),
}  # fmt: skip
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host"}


@dataclass(frozen=True)
class IngressSpec:
    model: str | None
    tenant_options: dict = field(default_factory=dict)  # without keys: see ReplicaSpec
    secrets_file: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    routing: str = "prefix"
    origin: OriginPolicy = field(default_factory=OriginPolicy)  # for /v1/cluster, its own route


def _error(status: int, message: str, code: str) -> JSONResponse:
    from prefixcache.server.edge.errors import error_body

    return JSONResponse(error_body(status, message, code=code), status_code=status)


def _replica_failed(e: BaseException) -> bool:
    from ray import exceptions as rex

    return isinstance(e, (rex.RayActorError, rex.ActorUnavailableError, rex.ActorDiedError))


def build_ingress(serve):
    """The ingress deployment class (built here so its FastAPI app is bound at class creation)."""
    app = FastAPI(title="prefixcache cluster")

    @serve.ingress(app)
    class Ingress:
        def __init__(self, replicas, spec: IngressSpec) -> None:
            from prefixcache.cluster.secrets import tenant_options
            from prefixcache.server.base.auth import TenantDirectory

            self.replicas = replicas
            self.spec = spec
            self.tenants = TenantDirectory.from_options(**tenant_options(spec.tenant_options, spec.secrets_file))
            self.keys = None  # RouteKeys, once a replica told us the fingerprint
            self.infos: dict[str, dict] = {}
            self.retries = 0
            self._keys_lock = asyncio.Lock()
            from prefixcache.server.edge.refusals import RefusalLimiter

            lim = spec.limits
            self.refusals = RefusalLimiter(lim.max_refusals_per_second, lim.refusal_penalty)

        # -- helpers ----------------------------------------------------------------------------
        def _router(self):
            from prefixcache.cluster.router import live_routers

            routers = live_routers()
            return routers[-1] if routers else None

        async def _route_keys(self):
            if self.keys is not None:
                return self.keys
            async with self._keys_lock:
                if self.keys is None:
                    from prefixcache.cluster.route_keys import RouteKeys
                    from prefixcache.tokenizer.tokenizer import load_tokenizer

                    info = await self.replicas.info.remote()
                    tok = await asyncio.to_thread(load_tokenizer, self.spec.model)
                    if tok.fingerprint() != info["tokenizer_fingerprint"]:
                        log.warning("the ingress's tokenizer differs from the replicas': routing by load")
                        tok = None
                    router = self._router()
                    if router is not None:
                        router.capacity_blocks = info["num_blocks"]
                    self.keys = RouteKeys(tok, self.tenants, info["fingerprint"], info["block_size"],
                                          max_tokens=info["max_model_len"],
                                          limits=self.spec.limits) if tok else False  # fmt: skip
            return self.keys

        async def _targets(self) -> list[str]:
            router = self._router()
            if router is None or not router.replica_ids():
                await self.replicas.info.remote()  # creates the router, waits for a replica
                router = self._router()
            return router.replica_ids()

        async def _info(self, rid: str) -> dict:
            if rid not in self.infos:
                self.infos[rid] = await self.replicas.info.remote(target=rid)
            return self.infos[rid]

        async def _call_one(self, rid: str, method, path, query, headers, body) -> tuple[int, dict, bytes]:
            gen = self.replicas.options(stream=True).forward.remote(method, path, query, headers, body, target=rid)
            status, hdrs, parts = 500, {}, []
            async for m in gen:
                if isinstance(m, dict):
                    status, hdrs = m["status"], dict(m["headers"])
                    parts.append(m["body"])
                else:
                    parts.append(m)
            return status, hdrs, b"".join(parts)

        async def _fanout(self, method, path, query, headers, body):
            """Each replica in turn, never concurrently: Ray Serve gives every call made while
            handling one request that request's internal id, and its router matches pending
            calls by that id, so concurrent calls from one request can be given each other's
            replica (measured: a stuck routing loop). A replica takes ~20 ms to answer these."""
            out = []
            for rid in await self._targets():
                try:
                    info = await asyncio.wait_for(self._info(rid), FANOUT_TIMEOUT)
                    result = await asyncio.wait_for(
                        self._call_one(rid, method, path, query, headers, body), FANOUT_TIMEOUT
                    )
                except Exception as e:  # noqa: BLE001 - a dead or stuck replica: counted as failed
                    info, result = {"replica_id": rid}, e
                out.append((info, result))
            return out

        async def reload(self) -> dict:
            """SIGHUP on the cluster (cli.py): this ingress's keys (``/v1/cluster`` and the route
            keys' namespaces), then every replica's, one at a time (see _fanout)."""
            try:
                mine = f"{self.tenants.reload()} keys" if self.tenants.reloadable else "no keys file"
            except (ValueError, TypeError) as e:
                mine = f"not reloaded: {e}"
            replicas = []
            for rid in await self._targets():
                try:
                    replicas.append(await asyncio.wait_for(self.replicas.reload.remote(target=rid), FANOUT_TIMEOUT))
                except Exception as e:  # noqa: BLE001 - a dead replica: its replacement reads the file
                    replicas.append({"replica_id": rid, "error": type(e).__name__})
            return {"ingress": mine, "replicas": replicas}

        # -- routes -----------------------------------------------------------------------------
        @app.get("/v1/cluster")
        async def cluster(self, request: Request):
            from prefixcache.server.edge.errors import APIError

            refusal = self.spec.origin.check(request.method, dict(request.headers.items()))
            if refusal is not None:  # DNS rebinding (server/edge/origin.py); the rest: the replicas
                return refusal.response()
            try:
                tenant = self.tenants.authenticate(request.headers.get("authorization"))
            except APIError as e:
                return e.response()
            if not tenant.admin:
                return _error(403, "the cluster's replica list needs an admin key", "forbidden")
            infos = []
            for rid in await self._targets():  # one at a time, see _fanout
                self.infos.pop(rid, None)  # fresh: running requests change
                try:
                    infos.append(await asyncio.wait_for(self._info(rid), FANOUT_TIMEOUT))
                except Exception as e:  # noqa: BLE001
                    infos.append({"replica_id": rid, "error": type(e).__name__})
            router = self._router()
            return {
                "routing": self.spec.routing,
                "replicas": infos,
                "router_decisions": dict(router.decisions) if router else {},
                "retries": self.retries,
            }

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
        async def proxy(self, request: Request, path: str):
            from prefixcache.server.anthropic.errors import DIALECT as ANTHROPIC_ERRORS
            from prefixcache.server.edge.body import read_body
            from prefixcache.server.edge.errors import APIError

            path = "/" + path
            method = request.method
            has_body = method in ("POST", "PUT", "PATCH")
            try:
                tenant = self._caller(path, request.headers) if has_body else None
                body = await read_body(request, self.spec.limits) if has_body else b""
            except APIError as e:
                return e.response_for(path, (ANTHROPIC_ERRORS,))
            # Host goes along (unlike the other hop headers): the replica's app checks it
            # against the cluster's allowed hosts (server/edge/origin.py), as one server would.
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS - {"host"}]
            query = request.url.query
            if (method, path) in FANOUT_ROUTES:
                return await self._merged(method, path, query, headers, body)
            keys = await self._route_keys()
            route = await asyncio.to_thread(keys.keys, path, _credential(request.headers), body) if keys else []
            # The router records the route's keys for its replica once that replica served the
            # request (settled here), in the tenant's share of the replica's map (router.py).
            ticket = uuid.uuid4().hex if route else None
            owner = tenant.name if tenant is not None else None
            response = None
            try:
                response = await self._forward(method, path, query, headers, body, route, ticket, owner)
            finally:
                router = self._router() if ticket else None
                if router is not None:
                    router.settle(ticket, response is not None and 200 <= response.status_code < 300)
            if tenant is not None and not tenant.admin:
                self.refusals.record(tenant.name, response.status_code)
            return response

        def _caller(self, path: str, headers):
            """The tenant of a request to an API route with a body, checked before the body is
            read: 401 for an unknown key (with keys configured), 429 for a tenant over its
            refusal limit. None where the replicas decide alone (no keys, other routes)."""
            from prefixcache.server.base.auth import credential

            if not (path.startswith("/v1/") and self.tenants.auth_required):
                return None
            tenant = self.tenants.authenticate(credential(headers))
            if not tenant.admin:
                self.refusals.check(tenant.name)
            return tenant

        async def _forward(self, method, path, query, headers, body, route, ticket=None, owner=None):
            for attempt in range(RETRIES + 1):
                gen = self.replicas.options(stream=True).forward.remote(
                    method, path, query, headers, body, route=route, route_ticket=ticket, route_owner=owner
                )
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    return _error(502, "the replica returned no response", "replica_failed")
                except Exception as e:
                    if _replica_failed(e) and attempt < RETRIES:
                        self.retries += 1
                        log.warning("replica failed before answering (%s); retrying", type(e).__name__)
                        continue
                    if _replica_failed(e):
                        return _error(503, "the replica serving this request failed; retry", "replica_failed")
                    raise
                break
            hdrs = [(k, v) for k, v in first["headers"] if k.lower() not in _HOP_HEADERS]
            if not first["more"]:
                return Response(first["body"], status_code=first["status"], headers=dict(hdrs))
            sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in hdrs)

            async def rest():
                done = False
                try:
                    yield first["body"]
                    async for chunk in gen:
                        yield chunk
                    done = True
                except Exception as e:
                    if not _replica_failed(e):
                        raise
                    log.warning("replica failed mid-stream: %s", type(e).__name__)
                    if sse:
                        err = {"error": {"message": "the replica serving this request failed mid-stream",
                                         "type": "server_error", "code": "replica_failed"}}  # fmt: skip
                        yield f"data: {json.dumps(err)}\n\n".encode()
                    done = True
                finally:
                    if not done:
                        gen.cancel()  # the client left: the replica sees a disconnect and aborts

            media = {k.lower(): v for k, v in hdrs}.get("content-type")
            return StreamingResponse(rest(), status_code=first["status"], headers=dict(hdrs), media_type=media)

        async def _merged(self, method, path, query, headers, body):
            from prefixcache.cluster.aggregate import merge_metrics, merge_stats, merge_values

            results = await self._fanout(method, path, query, headers, body)
            ok = [(i, r) for i, r in results if not isinstance(r, BaseException)]
            failed = len(results) - len(ok)
            if path == "/health":
                bad = [r[2].decode(errors="replace") for _, r in ok if r[0] != 200]
                if failed or bad or not ok:
                    return JSONResponse({"status": "unavailable", "replicas": len(results),
                                         "failed": failed, "reasons": bad}, status_code=503)  # fmt: skip
                return JSONResponse({"status": "ok", "replicas": len(ok)})
            if not ok:
                return _error(503, "no replica answered", "replica_failed")
            for _, (status, hdrs, raw) in ok:  # a refusal (401, 403, 400) is the same everywhere
                if status != 200:
                    return Response(raw, status_code=status, media_type=hdrs.get("content-type"))
            if path == "/metrics":
                text = merge_metrics([(str(i["rank"]), r[2].decode()) for i, r in ok])
                return Response(text + self._own_metrics(len(ok)), media_type=ok[0][1][1].get("content-type"))
            bodies = [(i, json.loads(r[2])) for i, r in ok]
            if path == "/v1/cache/stats":
                out = merge_stats(bodies)
                out["replicas_failed"] = failed
                if not self._is_admin(headers):  # tenants see replicas by rank, not pids / hosts
                    for r in out["replicas"]:
                        for k in ("replica_id", "pid", "node"):
                            r.pop(k, None)
                return JSONResponse(out)
            if path == "/v1/cache/invalidate":
                out = merge_values("", [b for _, b in bodies])  # counts summed, the rest kept
                out["replicas"] = len(bodies)
                out["replicas_failed"] = failed
                return JSONResponse(out, status_code=200 if not failed else 503)
            return JSONResponse({"replicas": [{"replica": i["rank"], **b} for i, b in bodies]})

        def _is_admin(self, headers) -> bool:
            from prefixcache.server.edge.errors import APIError

            auth = next((v for k, v in headers if k.lower() == "authorization"), None)
            try:
                return self.tenants.authenticate(auth).admin
            except APIError:
                return False

        def _own_metrics(self, alive: int) -> str:
            router = self._router()
            lines = [
                "# HELP prefixcache:cluster_replicas Replicas that answered this scrape.",
                "# TYPE prefixcache:cluster_replicas gauge",
                f"prefixcache:cluster_replicas {alive}",
                "# HELP prefixcache:cluster_retries_total Requests re-sent after their replica died.",
                "# TYPE prefixcache:cluster_retries_total counter",
                f"prefixcache:cluster_retries_total {self.retries}",
                "# HELP prefixcache:router_decisions_total Routing decisions of the prefix router.",
                "# TYPE prefixcache:router_decisions_total counter",
            ]
            for k, v in sorted((router.decisions if router else {}).items()):
                lines.append(f'prefixcache:router_decisions_total{{decision="{k}"}} {v}')
            return "\n".join(lines) + "\n"

    return Ingress


def _credential(headers) -> str | None:
    """The request's key as an ``Authorization`` value (``x-api-key`` too, as the replicas
    take it); None when the two headers disagree: then it is routed by load, and the replica
    answers the 401."""
    from prefixcache.server.base.auth import credential
    from prefixcache.server.edge.errors import APIError

    try:
        return credential(headers)
    except APIError:
        return None
