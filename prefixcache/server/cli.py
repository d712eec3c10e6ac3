"""``prefixcache serve``: the OpenAI-compatible server on the async engine."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from prefixcache.config import EVICTION_POLICIES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, parse_bytes
from prefixcache.server.limits import ServerLimits

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
    m = p.add_argument_group("model and engine")
    m.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)"
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use in 'model' (default: the model's name)",
    )
    m.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes",
    )
    m.add_argument(
        "--partial-block-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse a cached block's leading tokens when a prompt diverges inside it, so a "
        "hit is the whole common prefix, not its floor to a block (docs/design.md §4)",
    )
    m.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache size, e.g. 2GiB or 512MiB (default: the engine's)",
    )
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--max-model-len", type=int, default=None)
    m.add_argument("--max-num-seqs", type=int, default=128)
    m.add_argument("--max-num-batched-tokens", type=int, default=2048)
    m.add_argument(
        "--busy-step-ms",
        type=float,
        default=200.0,
        metavar="MS",
        help="while two or more requests have work, steps carry only the tokens that fit in "
        "about this long, so a burst's prompts get first tokens one after another and decodes "
        "never wait behind a full chunk (0: off)",
    )
    m.add_argument(
        "--shared-step-ms",
        type=float,
        default=150.0,
        metavar="MS",
        help="while several tenants are active, steps carry only the tokens that fit in about "
        "this long, so a short request never waits behind a long chunk (0: off)",
    )
    m.add_argument(
        "--shared-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a tenant counts as active this long after its last request",
    )
    m.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs; lpm: longest cached prefix first; sjf: fewest uncached prompt "
                   "tokens first (both with a starvation guard)")
    m.add_argument(
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        default="lru",
        help="which cached KV block goes when the pool is full (docs/engine.md \"Eviction\")",
    )
    m.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="more waiting requests than this are refused with 429",
    )
    m.add_argument(
        "--max-waiting-per-tenant",
        type=int,
        default=None,
        help="waiting sequences one tenant may hold; more get 429 (default: half of "
        "--max-waiting-requests)",
    )
    m.add_argument(
        "--pin-budget-fraction",
        type=float,
        default=0.25,
        help="share of the KV pool pinned prompts may hold",
    )
    m.add_argument(
        "--pin-quota-fraction",
        type=float,
        default=0.5,
        help="share of the pin budget one non-admin tenant may hold",
    )
    m.add_argument(
        "--max-pin-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="longest pin; a pin without ttl_seconds gets this one",
    )
    m.add_argument(
        "--max-pending-deltas",
        type=int,
        default=1024,
        help="a stream whose reader leaves more deltas unread is cancelled",
    )
    m.add_argument(
        "--health-stall-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="/health is 503 when work waits and no step finished for this long",
    )
    m.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    m.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="weight-only quantization of the linear layers; auto: int4 for a 4-bit GGUF on "
        "CPU (the file's own weights), else none",
    )
    m.add_argument(
        "--activations",
        default="auto",
        choices=("auto", "int16", "mixed", "int8", "float32"),
        help="arithmetic of the linear layers, all but float32 exact (outputs bit-for-bit "
        "independent of cache, batch and chunking); int16: 16-bit activations, float32-like "
        "quality; mixed: 8 or 16 bits per group, 1.4x faster (auto's choice for 4-bit groups on "
        "CPU, int16 for 8-bit ones); int8: faster, below the quality floor; float32: the float "
        "reference",
    )
    m.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how K/V are stored in the cache; auto: int16 on the exact integer path (CPU: half "
        "of float32's bytes, attention on the integer units), else the model's dtype. int8/fp8_e4m3 "
        "hold ~3.8x the tokens of float32 but cost more quality than the floor at long contexts",
    )
    m.add_argument(
        "--weights-cache-dir",
        default="auto",
        help="where converted weights are kept between starts ('auto': the user cache "
        "directory; 'none': off)",
    )
    t = p.add_argument_group("persistent KV tiers (docs/engine.md, 'Cache tiers')")
    t.add_argument(
        "--disk-cache-dir",
        default=None,
        metavar="DIR",
        help="keep KV blocks on disk under DIR ('auto': kv/ in the user cache directory): a "
        "restart finds them. Off by default",
    )
    t.add_argument(
        "--disk-cache-size",
        default="10GiB",
        metavar="SIZE",
        help="most bytes the disk tier holds (LRU), e.g. 10GiB",
    )
    t.add_argument(
        "--segment-cache-memory",
        default="512MiB",
        metavar="SIZE",
        help="RAM for documents' KV kept as segments, used only by requests with "
        "cache_mode \"segments\" (docs/segments.md)",
    )
    t.add_argument(
        "--max-segments-per-request",
        type=int,
        default=64,
        metavar="N",
        help="most document messages one cache_mode \"segments\" request (chat or warm) may "
        "have; more is a 400 segment_limit_exceeded",
    )
    t.add_argument(
        "--max-segment-record",
        default="64MiB",
        metavar="SIZE",
        help="most bytes of one document's KV computed alone (its segment record, ~46 KB/token "
        "for the default model); a document that would make a larger one is a 400 "
        "segment_limit_exceeded",
    )
    t.add_argument(
        "--remote-cache",
        default=None,
        metavar="URL",
        help="share KV blocks with other replicas through Redis/Valkey: "
        "redis://[:password@]host:port/db (rediss:// for TLS)",
    )
    t.add_argument(
        "--remote-cache-max-record",
        default="64MiB",
        metavar="SIZE",
        help="records larger than this are not sent to Redis (one huge SET would outlast the "
        "socket timeout)",
    )
    t.add_argument(
        "--remote-cache-size",
        default="auto",
        metavar="SIZE",
        help="bytes of records this deployment keeps in Redis, shared fairly between tenants "
        "(auto: half the server's maxmemory; none: no bound of ours)",
    )
    t.add_argument(
        "--tier-secret-file",
        default=None,
        metavar="FILE",
        help="32+ random bytes that authenticate and name every disk/Redis record "
        "(head -c 32 /dev/urandom > FILE); replicas sharing a Redis must share it. Default: "
        "one generated once, kept 0600 next to the disk tier",
    )
    t.add_argument(
        "--tier-compression",
        default="none",
        choices=("none", "lz4", "zstd"),
        help="compress stored blocks where it pays (float32 KV hardly compresses)",
    )
    ev = p.add_argument_group("KV events for external routers (docs/cluster.md, 'KV events')")
    ev.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint to bind, e.g. tcp://127.0.0.1:5557: BlockStored/BlockRemoved/"
        "AllBlocksCleared in vLLM's msgpack format (off by default). Every tenant's cache "
        "traffic: loopback or ipc:// unless CURVE or --kv-events-allow-remote",
    )
    ev.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint answering replay requests, e.g. tcp://127.0.0.1:5558",
    )
    ev.add_argument("--kv-events-topic", default="", help="topic frame of every event message")
    ev.add_argument(
        "--kv-events-curve-secret-file",
        default=None,
        metavar="FILE",
        help="CURVE server secret key (z85; `prefixcache events keygen FILE`): both sockets "
        "encrypt, and only subscribers given FILE.pub connect. Allows a non-loopback bind",
    )
    ev.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="allow a non-loopback bind without CURVE: anyone reaching the port reads the stream",
    )
    ev.add_argument(
        "--kv-events-token-ids",
        action="store_true",
        help="send each BlockStored's token ids (the tenants' prompts); empty by default",
    )
    m.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    m.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("server")
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

    from prefixcache.server.auth import TenantDirectory

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:  # everything a typo can break, before the model loads
        tenants = TenantDirectory.from_options(
            api_key=args.api_key,
            api_keys_file=args.api_keys_file,
            admin_key=args.admin_key,
            shared_namespaces=args.shared_namespace,
        )
        check_open_bind(tenants, args)
        config = _engine_config(args)
        limits = _limits(args)
        origin = origin_policy(args)
        request_log = _request_log(args.log_requests, args.block_size)
    except (ValueError, TypeError) as e:
        print(f"prefixcache serve: {e}", file=sys.stderr)
        return 2

    from prefixcache.engine.async_engine import AsyncEngine
    from prefixcache.server.app import create_app
    from prefixcache.server.http import protocol_class

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


def _engine_config(args: argparse.Namespace):
    from prefixcache.config import EngineConfig

    return EngineConfig(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        partial_block_reuse=args.partial_block_reuse,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        shared_step_ms=args.shared_step_ms,
        busy_step_ms=args.busy_step_ms,
        shared_window_s=args.shared_window,
        scheduling_policy=args.scheduling_policy,
        eviction_policy=args.eviction_policy,
        dtype=args.dtype,
        quantization=args.quantization,
        activations=args.activations,
        kv_cache_dtype=args.kv_cache_dtype,
        weights_cache_dir=None if args.weights_cache_dir == "none" else args.weights_cache_dir,
        device=args.device,
        seed=args.seed,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        pin_budget_fraction=args.pin_budget_fraction,
        pin_quota_fraction=args.pin_quota_fraction,
        max_pin_ttl_seconds=args.max_pin_ttl,
        max_pending_deltas=args.max_pending_deltas,
        health_stall_seconds=args.health_stall_timeout,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_size=args.disk_cache_size,
        segment_cache_memory=args.segment_cache_memory,
        max_segments_per_request=args.max_segments_per_request,
        max_segment_record=args.max_segment_record,
        remote_cache=args.remote_cache,
        tier_compression=args.tier_compression,
        tier_secret_file=args.tier_secret_file,
        remote_cache_max_record=args.remote_cache_max_record,
        remote_cache_size=args.remote_cache_size,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_curve_secret_file=args.kv_events_curve_secret_file,
        kv_events_allow_remote=args.kv_events_allow_remote,
        kv_events_token_ids=args.kv_events_token_ids,
    )


def _limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})


def check_open_bind(tenants, args: argparse.Namespace) -> None:
    """An open server (no API key) makes every caller the admin: on a non-loopback address only
    with ``--allow-open-remote`` (as the KV events stream needs ``--kv-events-allow-remote``).
    With ``--fd``, --host names the address of the inherited socket."""
    from prefixcache.server.origin import is_loopback

    if tenants.auth_required or is_loopback(args.host) or args.allow_open_remote:
        return
    raise ValueError(
        f"--host {args.host} is not a loopback address and no API key is configured: every "
        "caller reaching it would be the admin. Give --api-key / --api-keys-file, bind "
        "127.0.0.1, or pass --allow-open-remote to serve it open anyway"
    )


def origin_policy(args: argparse.Namespace):
    """The browser checks of a server bound to --host (with --fd, --host names the address)."""
    from prefixcache.server.origin import OriginPolicy

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
