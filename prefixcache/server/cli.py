"""``prefixcache serve``: the OpenAI-compatible server on the async engine."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from prefixcache.config import COMPONENTS, add_cli_arguments, config_from_cli, parse_bytes
from prefixcache.server.edge.limits import ServerLimits

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

_LIMIT_HELP = {
    "max_body_bytes": "largest request body (bytes or e.g. 4MiB); 413 above",
    "max_json_depth": "deepest JSON nesting accepted",
    "max_n": "choices per prompt",
    "max_prompts_per_request": "prompts in one /v1/completions request",
    "max_logprobs": "top logprobs per token",
    "max_stop_sequences": "stop strings per request",
    "max_stop_chars": "characters per stop string",
    "max_stop_token_ids": "stop token ids per request",
    "max_messages": "chat messages per request",
    "body_timeout": "seconds for a request body to arrive (408 after)",
    "header_timeout": "seconds for a connection to send a request's headers (closed after)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "send_timeout": "seconds a client may take to accept a streamed chunk (cancelled after)",
    "max_connections": "open connections; more are closed at once",
    "max_refusals_per_second": "refused requests (400/404/413/422/429) a non-admin tenant may have in a "
    "second; past it, 429 for --refusal-penalty seconds",
    "refusal_penalty": "seconds a tenant over --max-refusals-per-second is refused early (and "
    "a client address over --max-unauthenticated-per-second cut off)",
    "max_unauthenticated_per_second": "401s a client address may get in a second; past it, its "
    "connections are closed and refused for --refusal-penalty seconds",
    "max_tools": "tool definitions per /v1/messages request",
    "max_cache_calls_per_second": "calls outside the queue (cache warm/lookup/invalidate/stats, "
    "count_tokens, comparisons) a non-admin tenant may make a second; past it, 429",
    "max_json_containers": "objects and arrays in a request body, counted before parsing; 400 above",
    "metrics_max_age": "seconds a /metrics read is reused for keyless readers (--public-metrics)",
}


def _limit_type(name: str):
    if name == "max_body_bytes":
        return parse_bytes
    default = next(f.default for f in fields(ServerLimits) if f.name == name)
    return float if isinstance(default, float) else int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="OpenAI-compatible server (completions, chat, cache control, metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``prefixcache serve`` (``prefixcache cluster`` takes them all too)."""
    # The engine's flags: each config component's fields (config.py), in its help group
    groups: dict[str, argparse._ArgumentGroup] = {}
    for component in COMPONENTS:
        if component.CLI_GROUP not in groups:
            groups[component.CLI_GROUP] = p.add_argument_group(component.CLI_GROUP)
        add_cli_arguments(groups[component.CLI_GROUP], component)
    s = p.add_argument_group("server")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use in 'model' (default: the model's name)",
    )
    s.add_argument("--host", default=DEFAULT_HOST)
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this inherited listening socket instead of binding --host/--port "
        "(socket activation, supervisors)",
    )
    s.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="host names clients reach the server by, besides localhost, 127.0.0.1 and [::1] "
        "(repeatable): the Host and Origin checks against browsers accept them; giving one "
        "turns the Host check on for a non-loopback --host too (docs/server.md, 'Security')",
    )
    keys = s.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="one key; its holder is the admin")
    keys.add_argument(
        "--api-keys-file",
        default=None,
        help="JSON or YAML file mapping keys to tenants (see docs/server.md)",
    )
    s.add_argument(
        "--admin-key",
        default=None,
        help="an extra key for the admin tenant (invalidate any namespace)",
    )
    s.add_argument(
        "--shared-namespace",
        action="append",
        default=[],
        metavar="NAME",
        help="a cache_salt every tenant shares (repeatable), e.g. 'public'",
    )
    s.add_argument(
        "--metrics-key",
        default=None,
        help="a key (besides admin keys) that reads /metrics as a bearer token; with API keys "
        "configured /metrics needs one of them (an open server's is public)",
    )
    s.add_argument(
        "--allow-open-remote",
        action="store_true",
        help="serve without any API key on a non-loopback --host (refused without this flag: "
        "every caller who reaches the port is the admin)",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without a key even with API keys (vLLM's default): its counts "
        "are every tenant's traffic",
    )
    lim = p.add_argument_group("limits (see docs/server.md)")
    for f in fields(ServerLimits):
        lim.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_limit_type(f.name),
            default=f.default,
            help=_LIMIT_HELP.get(f.name),
        )
    s.add_argument(
        "--log-requests",
        default=None,
        metavar="FILE",
        help="append one record per request (tenant, block hashes, cached tokens; "
        "no text) for `prefixcache analyze`",
    )
    s.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM, wait at most this long for running requests (default: until done)",
    )
    s.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    s.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log one line per HTTP request",
    )


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from prefixcache.server.base.auth import TenantDirectory

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:  # everything a typo can break, before the model loads
        tenants = TenantDirectory.from_options(
            api_key=args.api_key,
            api_keys_file=args.api_keys_file,
            admin_key=args.admin_key,
            shared_namespaces=args.shared_namespace,
        )
        check_open_bind(tenants, args)
        config = config_from_cli(args)
        limits = _limits(args)
        origin = origin_policy(args)
        request_log = _request_log(args.log_requests, args.block_size)
    except (ValueError, TypeError) as e:
        print(f"prefixcache serve: {e}", file=sys.stderr)
        return 2

    from prefixcache.engine.async_engine import AsyncEngine
    from prefixcache.server.app import create_app
    from prefixcache.server.edge.http import protocol_class

    try:
        engine = AsyncEngine(config)
    except ValueError as e:  # what only the engine can check: the model, the disk tier's dir
        print(f"prefixcache serve: {e}", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        served_model_names=args.served_model_name,
        tenants=tenants,
        request_log=request_log,
        on_ready=lambda: print(_banner(engine, tenants, args), flush=True),
        limits=limits,
        metrics_key=args.metrics_key,
        drain_timeout=args.graceful_shutdown_timeout,
        origin=origin,
        public_metrics=args.public_metrics,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.access_log,
            # SIGTERM: stop accepting, let running requests finish (all of them by default);
            # past the timeout uvicorn cancels them, which aborts their engine requests.
            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
            fd=args.fd,
            http=protocol_class(
                limits.max_connections, limits.header_timeout, limits.send_timeout,
                app.state.peer_guard,
            ),
            timeout_keep_alive=limits.keep_alive_timeout,
        )
    )
    server.run()
    return 0 if server.started else 1


def _limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


def check_open_bind(tenants, args: argparse.Namespace) -> None:
    """An open server (no API key) makes every caller the admin: on a non-loopback address only
    with ``--allow-open-remote`` (as the KV events stream needs ``--kv-events-allow-remote``).
    With ``--fd``, --host names the address of the inherited socket."""
    from prefixcache.server.edge.origin import is_loopback

    if tenants.auth_required or is_loopback(args.host) or args.allow_open_remote:
        return
    raise ValueError(
        f"--host {args.host} is not a loopback address and no API key is configured: every "
        "caller reaching it would be the admin. Give --api-key / --api-keys-file, bind "
        "127.0.0.1, or pass --allow-open-remote to serve it open anyway"
    )


def origin_policy(args: argparse.Namespace):
    """The browser checks of a server bound to --host (with --fd, --host names the address)."""
    from prefixcache.server.edge.origin import OriginPolicy

    return OriginPolicy.for_bind(args.host, args.allowed_hosts)


def _request_log(path: str | None, block_size: int):
    if path is None:
        return None
    try:
        from prefixcache.analyze.request_log import RequestLogWriter
    except ModuleNotFoundError as e:
        raise ValueError(f"--log-requests needs prefixcache.analyze.request_log: {e}") from e
    return RequestLogWriter(path, include_text=False, block_size=block_size)


def _banner(engine, tenants, args) -> str:
    kv = engine.kv_info
    size = kv["capacity_bytes"]
    size_text = f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"
    url = f"http://{args.host}:{args.port}"
    if tenants.auth_required:
        names = ", ".join(t.name for t in tenants.tenants)
        auth = f"API keys required (tenants: {names})"
    else:
        auth = "open: no API key configured, every caller is tenant 'default'"
    if tenants.shared_namespaces:
        auth += f"; shared namespaces: {', '.join(sorted(tenants.shared_namespaces))}"
    caching = "on" if engine.config.enable_prefix_caching else "OFF"
    model = (
        f"prefixcache serve: model {engine.model_name} (max_model_len {engine.max_model_len}, "
        f"{engine.config.device}, {engine.config.dtype}, weights {engine.weights_format})"
    )
    cache = (
        f"  KV cache ({kv['kv_cache_dtype']}): {kv['capacity_tokens']} tokens ({kv['num_blocks']} blocks of "
        f"{kv['block_size']}), {kv['bytes_per_token']} bytes/token, {size_text}; "
        f"prefix caching {caching}"
    )
    lines = [model, cache]
    tiers = []
    if engine.config.disk_cache_dir and engine.config.enable_prefix_caching:
        tiers.append(f"disk {engine.config.disk_cache_dir} ({engine.config.disk_cache_size})")
    if engine.config.remote_cache and engine.config.enable_prefix_caching:
        scheme, _, rest = engine.config.remote_cache.partition("://")
        tiers.append(f"redis {scheme}://{rest.split('@', 1)[-1]}")
    if tiers:
        lines.append(f"  KV tiers: {', '.join(tiers)}")
    lines += [f"  auth: {auth}", f"  serving at {url}  (base_url {url}/v1)"]
    return "\n".join(lines)
