"""``prefixcache cluster``: N engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

Takes every ``prefixcache serve`` flag (each replica runs that server's app) plus the cluster's
own. Starts a local Ray instance, or joins one with ``--ray-address``; deploys the replicas and
the ingress; serves until interrupted (Ctrl-C / SIGTERM), then shuts Serve down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from prefixcache.cluster import POLICIES

log = logging.getLogger("prefixcache.cluster")


def register(subparsers) -> None:
    from prefixcache.server.cli import add_serve_arguments

    p = subparsers.add_parser(
        "cluster",
        help="run N engine replicas on Ray Serve behind one endpoint",
        description="Engine replicas on Ray Serve with prefix-affinity routing (docs/cluster.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=2, help="engine replicas")
    c.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one on this machine); default: start one")  # fmt: skip
    c.add_argument("--routing", choices=POLICIES, default="prefix",
                   help="prefix: the replica holding the prompt's blocks; round_robin; pow2")  # fmt: skip
    c.add_argument("--threads-per-replica", type=int, default=None,
                   help="torch threads in each replica (default: this machine's cores / replicas)")  # fmt: skip
    c.add_argument("--imbalance", type=int, default=8,
                   help="prefix routing leaves the preferred replica when its queue is longer "
                   "than the shortest by more than this many requests")  # fmt: skip
    c.add_argument("--max-ongoing-requests", type=int, default=64,
                   help="requests one replica takes at once (Ray Serve queues the rest)")  # fmt: skip
    add_serve_arguments(p)
    p.set_defaults(func=run_cluster)


def _specs(args: argparse.Namespace, secrets_path: str | None):
    """The replicas' and the ingress's specs. They are pickled into Ray, so they carry no key:
    the keys given as flags are in ``secrets_path`` (cluster/secrets.py), read where they run."""
    from prefixcache.cluster.ingress import IngressSpec
    from prefixcache.cluster.replica import ReplicaSpec
    from prefixcache.cluster.secrets import tenant_options as with_secrets
    from prefixcache.config import config_from_cli
    from prefixcache.server.base.auth import TenantDirectory
    from prefixcache.server.cli import _limits, check_open_bind, origin_policy

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.fd is not None:
        raise ValueError("--fd is not supported by cluster (Ray Serve's proxy owns the socket)")
    tenant_options = {"api_keys_file": args.api_keys_file and str(Path(args.api_keys_file).resolve()),
                      "shared_namespaces": list(args.shared_namespace or [])}  # fmt: skip
    # a typo fails here, before Ray starts
    check_open_bind(TenantDirectory.from_options(**with_secrets(tenant_options, secrets_path)), args)
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // args.replicas)
    config = config_from_cli(args)
    limits = _limits(args)
    origin = origin_policy(args)
    replica = ReplicaSpec(
        engine=config, tenant_options=tenant_options, secrets_file=secrets_path,
        served_model_names=args.served_model_name, limits=limits,
        drain_timeout=args.graceful_shutdown_timeout, log_requests=args.log_requests,
        threads=threads, origin=origin, public_metrics=args.public_metrics,
    )  # fmt: skip
    ingress = IngressSpec(model=config.model and str(config.model), tenant_options=tenant_options,
                          secrets_file=secrets_path, limits=limits, routing=args.routing,
                          origin=origin)  # fmt: skip
    return replica, ingress


def deploy(serve, replica_spec, ingress_spec, *, replicas: int, routing: str, imbalance: int,
           max_ongoing_requests: int):  # fmt: skip
    """The Serve application: the ingress bound to the replicas' deployment."""
    from ray.serve.config import RequestRouterConfig

    from prefixcache.cluster.ingress import build_ingress
    from prefixcache.cluster.replica import EngineReplica
    from prefixcache.cluster.router import PrefixAffinityRouter

    threads = replica_spec.threads
    engines = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={
            "num_cpus": threads,
            # OpenMP reads it when torch loads: set before the replica's first import of torch.
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"policy": routing, "imbalance": imbalance},
        ),
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=replica_spec.drain_timeout or 30,
    )
    ingress = serve.deployment(
        build_ingress(serve), name="Ingress", num_replicas=1,
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000,
    )  # fmt: skip
    return ingress.bind(engines.bind(replica_spec), ingress_spec)


def run_cluster(args: argparse.Namespace) -> int:
    from prefixcache.cluster.secrets import SecretsFile

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    given = {"api_key": args.api_key, "admin_key": args.admin_key, "metrics_key": args.metrics_key}
    secrets = SecretsFile(given) if any(given.values()) else None
    try:
        return _run(args, None if secrets is None else str(secrets.path))
    finally:
        if secrets is not None:
            secrets.remove()


def _reload(serve) -> None:
    """SIGHUP: the ingress re-reads the keys file and has every replica do the same."""
    try:
        out = serve.get_app_handle("prefixcache").reload.remote().result(timeout_s=120)
    except Exception as e:  # noqa: BLE001 - the cluster keeps serving with the old keys
        log.error("SIGHUP: reload failed, the old keys stay in force where not reloaded: %s", type(e).__name__)
        return
    failed = [r for r in out["replicas"] if "error" in r]
    log.warning("SIGHUP: keys reloaded on the ingress (%s) and %d of %d replicas%s", out["ingress"],
                len(out["replicas"]) - len(failed), len(out["replicas"]),
                f"; failed: {failed}" if failed else "")  # fmt: skip


def _run(args: argparse.Namespace, secrets_path: str | None) -> int:
    try:
        replica_spec, ingress_spec = _specs(args, secrets_path)
    except (ValueError, TypeError) as e:
        print(f"prefixcache cluster: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    t0 = time.monotonic()
    ray.init(address=args.ray_address, namespace="prefixcache", include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=args.log_level == "debug")  # fmt: skip
    serve.start(http_options={"host": args.host, "port": args.port}, detached=False)
    app = deploy(serve, replica_spec, ingress_spec, replicas=args.replicas, routing=args.routing,
                 imbalance=args.imbalance, max_ongoing_requests=args.max_ongoing_requests)  # fmt: skip
    try:
        serve.run(app, name="prefixcache", route_prefix="/", blocking=False)
    except Exception as e:  # noqa: BLE001 - a replica that cannot start (bad model, taken port)
        print(f"prefixcache cluster: deployment failed: {e}", file=sys.stderr)
        serve.shutdown()
        ray.shutdown()
        return 1
    url = f"http://{args.host}:{args.port}"
    print(
        f"prefixcache cluster: {args.replicas} replicas x {replica_spec.threads} threads, routing "
        f"{args.routing}, ready in {time.monotonic() - t0:.1f} s\n  serving at {url}  (base_url {url}/v1)",
        flush=True,
    )
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.api_keys_file:  # as `serve`: SIGHUP re-reads the keys file, everywhere
        signal.signal(signal.SIGHUP, lambda *_: (reload.set(), stop.set()))
    while True:
        stop.wait()
        if not reload.is_set():
            break
        stop.clear()
        reload.clear()
        _reload(serve)
    print("prefixcache cluster: shutting down", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
