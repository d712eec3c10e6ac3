"""The FastAPI app: service routes here, the API in completions.py and cache_routes.py.

``create_app(engine, ...)`` takes an engine implementing :class:`~prefixcache.api.engine.EngineAPI`
(an ``AsyncEngine``) that is built but not started; the app's lifespan starts its step loop and,
at shutdown, drains it (uvicorn first stops accepting connections and lets running requests
finish, so SIGTERM drains). With a keys file, SIGHUP reloads it (lifespan installs the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import prefixcache
from prefixcache.api.engine import EngineAPI
from prefixcache.server import cache_routes, completions, messages
from prefixcache.server.auth import TenantDirectory
from prefixcache.server.edge.errors import APIError, RequestIdMiddleware, install_error_handlers
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.origin import BrowserGuard, OriginPolicy
from prefixcache.server.edge.refusals import PeerGuard
from prefixcache.server.observability import dashboard
from prefixcache.server.observability.metrics import CONTENT_TYPE, ServerMetrics
from prefixcache.server.observability.request_log import BackgroundRequestLog
from prefixcache.server.observability.snapshot import Snapshot
from prefixcache.server.serving import Serving

log = logging.getLogger("prefixcache.server")


def create_app(
    engine: EngineAPI,
    *,
    served_model_names: list[str] | None = None,
    tenants: TenantDirectory | None = None,
    request_log=None,
    on_ready: Callable[[], None] | None = None,
    limits: ServerLimits | None = None,
    metrics_key: str | None = None,
    drain_timeout: float | None = None,
    origin: OriginPolicy | None = None,
    public_metrics: bool = False,
) -> FastAPI:
    """``request_log``: a ``RequestLogWriter`` (written from a background thread here);
    ``metrics_key``: when set, ``/metrics`` needs it (or an admin key) as a bearer token;
    ``public_metrics``: with API keys, ``/metrics`` without any key (else it needs the metrics
    key or an admin key: its counts are every tenant's traffic; an open server's is public);
    ``drain_timeout``: how long shutdown waits for running requests (None: 300 s);
    ``origin``: the Host/Origin/Content-Type checks (origin.py; None: those of a server bound
    to loopback)."""
    names = served_model_names or [engine.model_name]
    tenants = tenants or TenantDirectory()
    background_log = (
        BackgroundRequestLog(request_log, engine.block_hashes) if request_log is not None else None
    )
    metrics = ServerMetrics(engine, names[0], background_log)
    serving = Serving(engine, names, tenants, metrics, background_log, limits or ServerLimits())
    _set_pin_tenants(engine, tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        app.state.ready = True
        hup = _install_reload(tenants, engine)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            app.state.ready = False
            if hup:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await engine.shutdown(drain=True, timeout=300.0 if drain_timeout is None else drain_timeout)
            if background_log is not None:
                await asyncio.to_thread(background_log.close)
            serving.close()

    app = FastAPI(title="prefixcache", version=prefixcache.__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.ready = False
    # Client addresses that keep failing authentication (refusals.py); the connection guard
    # of http.protocol_class closes and refuses their connections.
    lim = serving.limits
    app.state.peer_guard = PeerGuard(lim.max_unauthenticated_per_second, lim.refusal_penalty)
    # Inside the request-id middleware (added last: outermost), so a refusal carries its id.
    app.add_middleware(BrowserGuard, policy=origin or OriginPolicy())
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(messages.router)
    app.include_router(cache_routes.router)
    app.include_router(dashboard.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not request.app.state.ready:
            return JSONResponse({"status": "unavailable", "reason": "starting"}, status_code=503)
        h = engine.health()
        if not h.ok:
            body = {"status": "unavailable", "reason": h.reason,
                    "seconds_since_progress": round(h.seconds_since_progress, 3)}  # fmt: skip
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": prefixcache.__version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        serving.tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(engine, n) for n in serving.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        serving.tenants.authenticate(request.headers.get("authorization"))
        serving.check_model(model_id)
        return _model_card(engine, model_id)

    @app.get("/metrics")
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

    @app.get("/v1/debug/integrity")
    async def integrity(request: Request) -> dict:
        """Admin only: the engine's own consistency check (pool counts, ref counts)."""
        tenant = serving.tenants.authenticate(request.headers.get("authorization"))
        if not tenant.admin:
            raise APIError(403, "the debug endpoints need an admin key")
        return await integrity_snapshot.get()

    return app


def _model_card(engine: EngineAPI, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "prefixcache",
        "root": engine.model_name,
        "max_model_len": engine.max_model_len,
    }


def _set_pin_tenants(engine: EngineAPI, tenants: TenantDirectory) -> None:
    """Every non-admin tenant of the keys gets its share of the pin budget (quotas that sum
    within it: tenants renewing their pins never starve another's)."""
    engine.set_pin_tenants(t.name for t in tenants.tenants if not t.admin)


def _install_reload(tenants: TenantDirectory, engine: EngineAPI) -> bool:
    """SIGHUP reloads the keys file (only the main thread's loop can take signals)."""
    if not tenants.reloadable or threading.current_thread() is not threading.main_thread():
        return False

    def reload() -> None:
        try:
            n = tenants.reload()
        except (ValueError, TypeError) as e:
            log.error("SIGHUP: keys file not reloaded, the old keys stay in force: %s", e)
        else:
            # Off the loop: it takes the engine lock, which a running step holds.
            asyncio.get_running_loop().run_in_executor(None, _set_pin_tenants, engine, tenants)
            log.warning("SIGHUP: keys file reloaded (%d keys)", n)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def _integrity(engine: EngineAPI) -> dict:
    try:
        engine.check_integrity()
    except AssertionError as e:
        return {"ok": False, "error": str(e), "engine": asdict(engine.engine_stats())}
    return {"ok": True, "engine": asdict(engine.engine_stats())}
