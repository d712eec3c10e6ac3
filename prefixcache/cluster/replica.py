"""One engine replica: an AsyncEngine and the app of ``prefixcache serve``, as a Ray Serve
deployment class (``deploy.py`` wraps it with ``serve.deployment``).

The replica owns no HTTP server: the ingress forwards each request's method, path, headers and
body, and ``forward`` runs it through the app in-process (asgi_bridge.py), streaming the
response back. So a cluster answers exactly as one server would (errors, limits, tenants).

Threads: a replica sets torch's intra-op threads to ``spec.threads`` before the model loads
(the CLI divides the machine's cores among the replicas on it, so N replicas never run more
OpenMP threads than cores: oversubscribed OpenMP threads spin-wait on descheduled siblings).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field

from prefixcache.config import EngineConfig
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.origin import OriginPolicy

log = logging.getLogger("prefixcache.cluster")


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs, picklable (it travels to the replica's process)."""

    engine: EngineConfig
    # TenantDirectory.from_options kwargs without the keys, which are in secrets_file (the spec
    # is pickled into Ray: cluster/secrets.py)
    tenant_options: dict = field(default_factory=dict)
    secrets_file: str | None = None
    served_model_names: list[str] | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    drain_timeout: float | None = None
    log_requests: str | None = None  # each replica writes PATH.<rank>
    threads: int = 1
    origin: OriginPolicy | None = None  # the cluster's --host/--allowed-hosts (Host forwarded)
    public_metrics: bool = False  # --public-metrics


def _rank() -> tuple[int, int]:
    """(global rank, rank on this node) of the calling replica; (0, 0) outside Serve."""
    from ray import serve

    try:
        r = serve.get_replica_context().rank
    except Exception:  # noqa: BLE001 - not in a replica (unit use)
        return 0, 0
    if isinstance(r, int):
        return r, r
    return int(getattr(r, "rank", 0)), int(getattr(r, "local_rank", getattr(r, "rank", 0)))


class EngineReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from prefixcache.cluster.secrets import read_secrets, tenant_options
        from prefixcache.engine.async_engine import AsyncEngine
        from prefixcache.events.publisher import offset_endpoint
        from prefixcache.server.app import create_app
        from prefixcache.server.base.auth import TenantDirectory

        torch.set_num_threads(spec.threads)
        self.rank, local_rank = _rank()
        config = spec.engine
        if config.kv_events_endpoint is not None:  # one endpoint per replica on a machine
            replay = config.kv_events_replay_endpoint
            config = dataclasses.replace(
                config,
                kv_events_endpoint=offset_endpoint(config.kv_events_endpoint, local_rank),
                kv_events_replay_endpoint=None if replay is None else offset_endpoint(replay, local_rank),
                kv_events_rank=self.rank,
            )
        request_log = None
        if spec.log_requests is not None:
            from prefixcache.analyze.request_log import RequestLogWriter

            request_log = RequestLogWriter(f"{spec.log_requests}.{self.rank}", include_text=False,
                                           block_size=config.block_size)  # fmt: skip
        self.tenants = TenantDirectory.from_options(**tenant_options(spec.tenant_options, spec.secrets_file))
        self.engine = AsyncEngine(config)
        self.app = create_app(
            self.engine,
            served_model_names=spec.served_model_names,
            tenants=self.tenants,
            request_log=request_log,
            limits=spec.limits,
            metrics_key=read_secrets(spec.secrets_file).get("metrics_key"),
            drain_timeout=spec.drain_timeout,
            origin=spec.origin,
            public_metrics=spec.public_metrics,
        )
        self._lifespan = None
        self._start_lock = None
        self.threads = spec.threads
        self.kv_events_endpoint = config.kv_events_endpoint
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001
            self.replica_id = f"local-{os.getpid()}"

    async def _started(self) -> None:
        """The app's lifespan (engine thread started) is entered once, on the first call."""
        import asyncio

        if self._lifespan is not None:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan

    async def forward(self, method: str, path: str, query: str, headers: list, body: bytes,
                      route: list | None = None, target: str | None = None,
                      route_ticket: str | None = None, route_owner: str | None = None):  # fmt: skip
        """Messages of the response (asgi_bridge.stream_asgi). ``route``, ``target``,
        ``route_ticket`` and ``route_owner`` are read by the router, not here."""
        from prefixcache.cluster.asgi_bridge import http_scope, stream_asgi

        await self._started()
        scope = http_scope(method, path, query, headers, client="prefixcache-ingress")
        async for message in stream_asgi(self.app, scope, body):
            yield message

    async def info(self, target: str | None = None) -> dict:
        """Who this replica is: for the ingress's key computation and the cluster's stats."""
        await self._started()
        kv = self.engine.kv_info
        return {
            "replica_id": self.replica_id,
            "rank": self.rank,
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "threads": self.threads,
            "fingerprint": self.engine.engine.fingerprint,
            "tokenizer_fingerprint": self.engine.tokenizer.fingerprint(),
            "block_size": kv["block_size"],
            "num_blocks": kv["num_blocks"],
            "max_model_len": self.engine.max_model_len,
            "model": self.engine.model_name,
            "kv_events_endpoint": self.kv_events_endpoint,
            "running": self.engine.engine_stats().num_running,
        }

    async def reload(self, target: str | None = None) -> dict:
        """Re-read the keys file (SIGHUP on the cluster, through the ingress), as ``serve``'s
        SIGHUP does: all or nothing, the old keys stay in force on an error."""
        import asyncio

        from prefixcache.server.base.app import _set_pin_tenants

        try:
            n = self.tenants.reload()
        except (ValueError, TypeError) as e:
            return {"rank": self.rank, "error": str(e)}
        await asyncio.to_thread(_set_pin_tenants, self.engine, self.tenants)  # takes the engine lock
        return {"rank": self.rank, "keys": n}

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes Serve replace the replica."""
        if self._lifespan is None:
            return
        h = self.engine.health()
        if not h.ok:
            raise RuntimeError(f"engine unhealthy: {h.reason}")

    async def __del__(self) -> None:
        if self._lifespan is not None:  # drain running requests (Serve's graceful shutdown)
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)
