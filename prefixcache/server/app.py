"""The FastAPI app: service routes here, the API in completions.py and cache_routes.py.

``create_app(engine, ...)`` takes an :class:`~prefixcache.engine.AsyncEngine` that is built but
not started; the app's lifespan starts its step loop and, at shutdown, drains it (uvicorn first
stops accepting connections and lets running requests finish, so SIGTERM drains).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, is_dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import prefixcache
from prefixcache.server import cache_routes, completions
from prefixcache.server.auth import TenantDirectory
from prefixcache.server.errors import APIError, install_error_handlers
from prefixcache.server.metrics import CONTENT_TYPE, ServerMetrics
from prefixcache.server.serving import Serving


def create_app(
    engine,
    *,
    served_model_names: list[str] | None = None,
    tenants: TenantDirectory | None = None,
    request_log=None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    names = served_model_names or [engine.model_name]
    serving = Serving(
        engine, names, tenants or TenantDirectory(), ServerMetrics(engine, names[0]), request_log
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        app.state.ready = True
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            app.state.ready = False
            await engine.shutdown(drain=True)
            if request_log is not None and hasattr(request_log, "close"):
                request_log.close()

    app = FastAPI(title="prefixcache", version=prefixcache.__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.ready = False
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(cache_routes.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not request.app.state.ready:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": prefixcache.__version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        serving.tenants.authenticate(request.headers.get("authorization"))
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "prefixcache",
                "root": engine.model_name,
                "max_model_len": engine.max_model_len,
            }
            for name in serving.model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        serving.tenants.authenticate(request.headers.get("authorization"))
        serving.check_model(model_id)
        return {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": "prefixcache",
            "root": engine.model_name,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        # The engine's counters are read under its lock, which a running step holds.
        body = await asyncio.to_thread(serving.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/debug/integrity")
    async def integrity(request: Request) -> dict:
        """Admin only: the engine's own consistency check (pool counts, ref counts)."""
        tenant = serving.tenants.authenticate(request.headers.get("authorization"))
        if not tenant.admin:
            raise APIError(403, "the debug endpoints need an admin key")
        check = getattr(engine, "check_integrity", None)
        if check is None:
            raise APIError(404, "this engine has no integrity check", code="not_found")
        return await asyncio.to_thread(_integrity, engine, check)

    return app


def _integrity(engine, check) -> dict:
    try:
        result = check()
    except AssertionError as e:
        return {"ok": False, "error": str(e), "engine": _as_dict(engine.engine_stats())}
    out = {"ok": True, "engine": _as_dict(engine.engine_stats())}
    if isinstance(result, dict):
        out["details"] = result
    return out


def _as_dict(x) -> dict:
    return asdict(x) if is_dataclass(x) else dict(x)
