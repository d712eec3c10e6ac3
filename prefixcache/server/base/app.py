"""The app factory every API shares: ``build_app(engine, surfaces, ...)``.

It builds the shared state (:class:`~.serving.Serving`), the edge (request ids, the browser
guard, the peer guard, the error handlers), the service routes (observability/routes.py: health,
version, metrics, integrity) and the dashboard, and then each API as its package hands it over:
a :class:`Surface` (its routes, the renderer it keeps per server, its error dialect). It imports
no API: server/app.py passes them (tests/structure/test_server_layout.py).

``engine`` implements :class:`~prefixcache.api.engine.EngineAPI` (an ``AsyncEngine``), built but
not started; the app's lifespan starts its step loop and, at shutdown, drains it (uvicorn first
stops accepting connections and lets running requests finish, so SIGTERM drains). With a keys
file, SIGHUP reloads it (lifespan installs the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI

import prefixcache
from prefixcache.api.engine import EngineAPI
from prefixcache.server.base.auth import TenantDirectory
from prefixcache.server.base.serving import Serving
from prefixcache.server.edge.errors import ErrorDialect, RequestIdMiddleware, install_error_handlers
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.origin import BrowserGuard, OriginPolicy
from prefixcache.server.edge.refusals import PeerGuard
from prefixcache.server.observability import dashboard, routes
from prefixcache.server.observability.metrics import ServerMetrics
from prefixcache.server.observability.request_log import BackgroundRequestLog

log = logging.getLogger("prefixcache.server")


@dataclass(frozen=True)
class Surface:
    """One API the server speaks, as its package hands it to the base: its routes; the
    renderer it keeps per server (a class built from the tokenizer, reached by its routes with
    ``Serving.renderer``); the dialect its errors are answered in on its paths (none: OpenAI's).
    """

    name: str
    routers: tuple[APIRouter, ...]
    renderer: Callable[[object], object] | None = None
    errors: ErrorDialect | None = None


def build_app(
    engine: EngineAPI,
    surfaces: Sequence[Surface],
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
    """``surfaces``: the APIs (their routes are matched in this order); ``request_log``: a
    ``RequestLogWriter`` (written from a background thread here); ``metrics_key``: when set,
    ``/metrics`` needs it (or an admin key) as a bearer token; ``public_metrics``: with API
    keys, ``/metrics`` without any key (else it needs the metrics key or an admin key: its
    counts are every tenant's traffic; an open server's is public);
    ``drain_timeout``: how long shutdown waits for running requests (None: 300 s);
    ``origin``: the Host/Origin/Content-Type checks (edge/origin.py; None: those of a server
    bound to loopback)."""
    names = served_model_names or [engine.model_name]
    tenants = tenants or TenantDirectory()
    background_log = (
        BackgroundRequestLog(request_log, engine.block_hashes) if request_log is not None else None
    )
    metrics = ServerMetrics(engine, names[0], background_log)
    renderers = [api.renderer for api in surfaces if api.renderer is not None]
    serving = Serving(
        engine, names, tenants, metrics, background_log, limits or ServerLimits(), renderers
    )
    dialects = tuple(api.errors for api in surfaces if api.errors is not None)
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
    # Client addresses that keep failing authentication (edge/refusals.py); the connection
    # guard of edge/http.py protocol_class closes and refuses their connections.
    lim = serving.limits
    app.state.peer_guard = PeerGuard(lim.max_unauthenticated_per_second, lim.refusal_penalty)
    # Inside the request-id middleware (added last: outermost), so a refusal carries its id.
    app.add_middleware(BrowserGuard, policy=origin or OriginPolicy(), dialects=dialects)
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app, dialects)
    for api in surfaces:
        for router in api.routers:
            app.include_router(router)
    app.include_router(dashboard.router)
    app.include_router(routes.service_routes(serving, metrics_key, public_metrics))
    return app


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
