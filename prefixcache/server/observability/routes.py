"""The service routes every server has, whatever APIs it speaks: ``/health``, ``/version``,
``/metrics`` (Prometheus) and ``/v1/debug/integrity`` (admin only)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import prefixcache
from prefixcache.api.engine import EngineAPI
from prefixcache.server.base.serving import Serving
from prefixcache.server.edge.errors import APIError
from prefixcache.server.observability.metrics import CONTENT_TYPE
from prefixcache.server.observability.snapshot import Snapshot


def service_routes(serving: Serving, metrics_key: str | None, public_metrics: bool) -> APIRouter:
    """``metrics_key``, ``public_metrics``: who may read ``/metrics`` (base/app.py)."""
    router = APIRouter()
    engine = serving.engine

    @router.get("/health")
    async def health(request: Request) -> Response:
        if not request.app.state.ready:
            return JSONResponse({"status": "unavailable", "reason": "starting"}, status_code=503)
        h = engine.health()
        if not h.ok:
            body = {"status": "unavailable", "reason": h.reason,
                    "seconds_since_progress": round(h.seconds_since_progress, 3)}  # fmt: skip
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def version() -> dict:
        return {"version": prefixcache.__version__}

    @router.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        # Operators (an admin key, the metrics key, anyone on an open server) read fresh
        # counters; keyless readers under --public-metrics get one read a --metrics-max-age.
        trusted = not serving.tenants.auth_required
        credential = request.headers.get("authorization")
        needed = metrics_key is not None or (serving.tenants.auth_required and not public_metrics)
        if needed or (credential and not trusted):
            try:
                serving.tenants.authenticate_metrics(credential, metrics_key)
                trusted = True
            except APIError:
                if needed:
                    raise
        # The engine's counters are read under its lock, which a running step holds: by one
        # reader at a time on its own thread (snapshot.py), never the default executor.
        body = await serving.metrics_snapshot.get(fresh=trusted)
        return Response(body, media_type=CONTENT_TYPE)

    integrity_snapshot = Snapshot(lambda: _integrity(engine), serving.snapshot_reader, 0.0)

    @router.get("/v1/debug/integrity")
    async def integrity(request: Request) -> dict:
        """Admin only: the engine's own consistency check (pool counts, ref counts)."""
        tenant = serving.tenants.authenticate(request.headers.get("authorization"))
        if not tenant.admin:
            raise APIError(403, "the debug endpoints need an admin key")
        return await integrity_snapshot.get()

    return router


def _integrity(engine: EngineAPI) -> dict:
    try:
        engine.check_integrity()
    except AssertionError as e:
        return {"ok": False, "error": str(e), "engine": asdict(engine.engine_stats())}
    return {"ok": True, "engine": asdict(engine.engine_stats())}
