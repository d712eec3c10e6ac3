"""Frozen configuration dataclasses, validated at construction: one per component (weights,
cache, scheduler, admission, tiers, segments, events), and EngineConfig, which is all of them.
Each field carries its flag's help text (``option``): ``prefixcache serve``'s flags are generated
from these fields (server/cli.py), so an option is one field in this file."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}  # fmt: skip

SCHEDULING_POLICIES = ("fcfs", "lpm", "sjf")
# The block pool's eviction policies (cache/eviction.py, whose POLICY_NAMES these are).
EVICTION_POLICIES = ("lru", "lru-demote", "hit-density", "adaptive")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight-only quantization of the decoder's linear layers (docs/engine.md, "Kernels and
# quantization"). auto: on CPU the file's own 4- or 8-bit groups (GGUF Q4_0/Q4_1/Q8_0) as stored;
# with the exact path (ACTIVATIONS) a float checkpoint's layers quantized at load to 8-bit
# groups; none: dense weights in the compute dtype (the float32 reference).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# The arithmetic of the decoder's linear layers (docs/engine.md, "Exact integer arithmetic").
# int16: 4- or 8-bit weight groups times 16-bit integer activations, exact int32 sums: every token's
# K/V and logits bit-for-bit the same alone or batched, chunked or whole, cold or warm, on any
# thread count and ISA path; float32-like quality (KL 4e-8 vs float32). mixed: the same
# exactness with 8 or 16 bits per group of a row (16 where the group's magnitude stands out),
# 1.4x int16's speed on 4-bit groups at KL 4.3e-4 (bf16: 9.7e-4). int8: one pass, faster still,
# KL 1.8e-3 (over the 1e-3 floor: opt-in). float32: float32 activations (the reference,
# agreement only). auto: on CPU with float32 compute and the kernels built, unless quantization
# is none, mixed for 4-bit groups and int16 for 8-bit groups (a GGUF's groups as stored, a
# float checkpoint's quantized to 8 bits); else float32.
ACTIVATIONS = ("auto", "int16", "mixed", "int8", "float32")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int16", "int8", "fp8_e4m3")  # kv/formats.py
TIER_COMPRESSIONS = ("none", "lz4", "zstd")  # tiers/codec.py
REMOTE_CACHE_SCHEMES = ("redis", "rediss")


def check_remote_cache_url(url: str) -> None:
    """``redis://[:password@]host:port/db`` or ``rediss://...``; raises ValueError saying what
    is wrong (a typo is a startup error, never a server that silently caches nothing)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"remote cache URL {_hide_password(url)!r} is invalid: {e}") from None
    if u.scheme not in REMOTE_CACHE_SCHEMES:
        raise ValueError(
            f"remote cache URL {_hide_password(url)!r} must start with redis:// or rediss://"
        )
    if not u.hostname:
        raise ValueError(f"remote cache URL {_hide_password(url)!r} names no host")
    if port is None:
        raise ValueError(f"remote cache URL {_hide_password(url)!r} names no port (e.g. :6379)")
    db = u.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"remote cache URL {_hide_password(url)!r}: database must be a number")
    if u.query or u.fragment:
        raise ValueError(f"remote cache URL {_hide_password(url)!r}: no query or fragment allowed")


def _hide_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return scheme + sep + ("***@" + rest.split("@", 1)[1] if "@" in rest else rest)


def parse_bytes(value: str | float) -> int:
    """'2GiB' -> 2147483648; plain numbers are bytes. Raises ValueError naming the value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. '2GiB', '512MiB' or bytes")
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


def option(default, help: str | None = None, *, cli: bool = True, **flag):
    """A config field and, unless ``cli=False``, its ``prefixcache serve`` flag: ``help`` is the
    flag's help text, ``flag`` what the flag does not derive from the field (``flag`` when it is
    not ``--field-name``, ``metavar``, ``choices``, ``type`` where the default is None or the
    command line's words need converting, ``action="store_true"``). server/cli.py generates
    the flags from these (cli_options), so an option is one field here and nowhere else."""
    return field(default=default, metadata={"help": help, "cli": flag if cli else None})


def _none_word(value: str) -> str | None:
    """The command line's 'none' for a field whose None turns a feature off."""
    return None if value.lower() == "none" else value


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


class _Component:
    """The end of the components' ``__post_init__`` chain: EngineConfig is all of them, and each
    checks its own fields, then hands on (super()), so each component is valid alone too."""

    def __post_init__(self) -> None:
        pass


@dataclass(frozen=True)
class WeightsConfig(_Component):
    """Which model runs, and in what arithmetic (model/)."""

    CLI_GROUP: ClassVar[str] = "model and engine"

    # None: the default model (SmolLM2-135M-Instruct GGUF)
    model: str | Path | None = option(None, "GGUF file or HF directory (default: SmolLM2-135M)")
    # auto: float32 (CPU and CUDA: the cold == warm contract)
    dtype: str = option("auto", choices=DTYPES)
    quantization: str = option(
        "auto", "weight-only quantization of the linear layers; auto: int4 for a 4-bit GGUF on "
        "CPU (the file's own weights), else none", choices=QUANTIZATIONS,
    )  # fmt: skip
    activations: str = option(
        "auto", "arithmetic of the linear layers, all but float32 exact (outputs bit-for-bit "
        "independent of cache, batch and chunking); int16: 16-bit activations, float32-like "
        "quality; mixed: 8 or 16 bits per group, 1.4x faster (auto's choice for 4-bit groups on "
        "CPU, int16 for 8-bit ones); int8: faster, below the quality floor; float32: the float "
        "reference", choices=ACTIVATIONS,
    )  # fmt: skip
    # Converted weights and tokenizer are kept here between starts (keyed by the model file's
    # digest and the cache format version); None turns the cache off.
    weights_cache_dir: str | Path | None = option(
        "auto", "where converted weights are kept between starts ('auto': the user cache "
        "directory; 'none': off)", type=_none_word,
    )  # fmt: skip
    device: str = option("cpu", "cpu or cuda[:N]")
    seed: int = option(0)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("activations", self.activations, ACTIVATIONS)
        _one_of("quantization", self.quantization, QUANTIZATIONS)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        super().__post_init__()


@dataclass(frozen=True)
class CacheConfig(_Component):
    """The RAM KV cache: its size and layout, what it reuses, what it evicts, what tenants may
    pin in it (cache/, kv/)."""

    CLI_GROUP: ClassVar[str] = "model and engine"

    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    # Token-exact hits (docs/design.md §4): when a prompt diverges inside a cached block, its
    # leading tokens' K/V are copied instead of computed, so a hit is the whole common prefix.
    partial_block_reuse: bool = option(
        True, "reuse a cached block's leading tokens when a prompt diverges inside it, so a "
        "hit is the whole common prefix, not its floor to a block (docs/design.md §4)",
    )  # fmt: skip
    # None: a share of available memory, capped
    kv_cache_memory: str | int | None = option(
        None, "KV cache size, e.g. 2GiB or 512MiB (default: the engine's)"
    )
    block_size: int = option(16)
    # How K/V are stored (kv/formats.py): auto = the model's dtype; bfloat16, int8, fp8_e4m3.
    kv_cache_dtype: str = option(
        "auto", "how K/V are stored in the cache; auto: int16 on the exact integer path (CPU: "
        "half of float32's bytes, attention on the integer units), else the model's dtype. "
        "int8/fp8_e4m3 hold ~3.8x the tokens of float32 but cost more quality than the floor "
        "at long contexts", choices=KV_CACHE_DTYPES,
    )  # fmt: skip
    # Which cached block the pool evicts (docs/design.md §4 "Eviction policy"): lru (least
    # recently released first), lru-demote or hit-density; the trace simulator runs the same code.
    eviction_policy: str = option(
        "lru", "which cached KV block goes when the pool is full (docs/engine.md \"Eviction\")",
        choices=EVICTION_POLICIES,
    )  # fmt: skip
    pin_budget_fraction: float = option(0.25, "share of the KV pool pinned prompts may hold")
    # Share of the pin budget one (non-admin) tenant may hold pinned.
    pin_quota_fraction: float = option(
        0.5, "share of the pin budget one non-admin tenant may hold"
    )
    # Longest pin; a pin without a TTL gets this one (pins never last forever).
    max_pin_ttl_seconds: float = option(
        3600.0, "longest pin; a pin without ttl_seconds gets this one", flag="--max-pin-ttl",
        metavar="SECONDS",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if not (0 <= self.pin_budget_fraction <= 1):
            raise ValueError(f"pin_budget_fraction must be in [0, 1], got {self.pin_budget_fraction}")
        if not (0 <= self.pin_quota_fraction <= 1):
            raise ValueError(f"pin_quota_fraction must be in [0, 1], got {self.pin_quota_fraction}")
        if not (self.max_pin_ttl_seconds > 0 and math.isfinite(self.max_pin_ttl_seconds)):
            raise ValueError(
                f"max_pin_ttl_seconds must be a positive number, got {self.max_pin_ttl_seconds}"
            )
        super().__post_init__()


@dataclass(frozen=True)
class SchedulerConfig(_Component):
    """What one step carries and in which order requests run (engine/scheduler.py,
    engine/fairness.py)."""

    CLI_GROUP: ClassVar[str] = "model and engine"

    max_model_len: int | None = option(None, type=int)  # None: the model's context length
    # vLLM's CPU default for its server: throughput needs wide decode steps
    max_num_seqs: int = option(128)
    max_num_batched_tokens: int = option(2048)
    # While two or more sequences have work (a burst of prompts, prompts beside decodes), a step
    # carries only the tokens that fit in about busy_step_ms at the pace of recent steps (at
    # least BUSY_STEP_FLOOR tokens): the burst's prompts then get their first tokens one after
    # another instead of all when the whole burst is done, and decodes are not held behind a
    # full chunk. A sequence alone gets full steps; 0 turns the bound off. The pace is that of
    # prefill-dominated steps only (scheduler.prefill_pace). Measured on Zen 4
    # (docs/benchmarks-journal.md): 200 ms beat 100 on throughput and TTFT at concurrency 8.
    busy_step_ms: float = option(
        200.0, "while two or more requests have work, steps carry only the tokens that fit in "
        "about this long, so a burst's prompts get first tokens one after another and decodes "
        "never wait behind a full chunk (0: off)", metavar="MS",
    )  # fmt: skip
    # While two or more tenants are active (running, waiting, or a request within the last
    # shared_window_s seconds), a step carries only the tokens that fit in about
    # shared_step_ms at the pace of recent steps, so another tenant's short request waits one or
    # two short steps rather than a full chunk (engine/fairness.py 4.); 0 turns the bound off.
    # The victim's wait is about half a step plus its own: 150 ms kept every attack of
    # benchmarks/tenant_isolation.py within 3x on Zen 4 (250 ms: up to 3.5x) at 0-4% of the
    # attacker's throughput (docs/benchmarks-journal.md "Tenant isolation").
    shared_step_ms: float = option(
        150.0, "while several tenants are active, steps carry only the tokens that fit in about "
        "this long, so a short request never waits behind a long chunk (0: off)", metavar="MS",
    )  # fmt: skip
    shared_window_s: float = option(
        60.0, "a tenant counts as active this long after its last request",
        flag="--shared-window", metavar="SECONDS",
    )  # fmt: skip
    scheduling_policy: str = option(
        "fcfs", "fcfs; lpm: longest cached prefix first; sjf: fewest uncached prompt tokens "
        "first (both with a starvation guard)", choices=SCHEDULING_POLICIES,
    )  # fmt: skip
    # lpm and sjf starvation guard: a waiting request older than this many steps goes first.
    lpm_max_wait_steps: int = option(64, cli=False)
    # Above this many waiting requests lpm and sjf fall back to fcfs (SGLang does the same:
    # sorting a long queue by prefix match costs more than it saves).
    lpm_max_queue: int = option(128, cli=False)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.busy_step_ms < 0:
            raise ValueError(f"busy_step_ms must be >= 0, got {self.busy_step_ms}")
        if self.shared_step_ms < 0 or self.shared_window_s < 0:
            raise ValueError(
                "shared_step_ms and shared_window_s must be >= 0, got "
                f"{self.shared_step_ms} and {self.shared_window_s}"
            )
        _one_of("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        super().__post_init__()


@dataclass(frozen=True)
class AdmissionConfig(_Component):
    """What the engine accepts before it refuses (429), and when it gives up on a reader or
    calls itself stalled (engine/, server/health)."""

    CLI_GROUP: ClassVar[str] = "model and engine"

    max_waiting_requests: int = option(
        256, "more waiting requests than this are refused with 429"
    )
    # A tenant's share of the waiting queue (sequences; None: half of max_waiting_requests), so
    # one tenant's flood is refused (429) before it fills the queue for everyone.
    max_waiting_per_tenant: int | None = option(
        None, "waiting sequences one tenant may hold; more get 429 (default: half of "
        "--max-waiting-requests)", type=int,
    )  # fmt: skip
    # A stream whose reader leaves more deltas than this unread is cancelled (its blocks freed).
    max_pending_deltas: int = option(
        1024, "a stream whose reader leaves more deltas unread is cancelled"
    )
    # /health says 503 when work waits and no step finished for this long.
    health_stall_seconds: float = option(
        60.0, "/health is 503 when work waits and no step finished for this long",
        flag="--health-stall-timeout", metavar="SECONDS",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_waiting_per_tenant is not None and self.max_waiting_per_tenant < 1:
            raise ValueError(
                f"max_waiting_per_tenant must be >= 1, got {self.max_waiting_per_tenant}"
            )
        if self.max_pending_deltas < 1:
            raise ValueError(f"max_pending_deltas must be >= 1, got {self.max_pending_deltas}")
        if not self.health_stall_seconds > 0:
            raise ValueError(
                f"health_stall_seconds must be > 0, got {self.health_stall_seconds}"
            )
        super().__post_init__()

    @property
    def tenant_waiting_limit(self) -> int:
        if self.max_waiting_per_tenant is not None:
            return self.max_waiting_per_tenant
        return max(1, self.max_waiting_requests // 2)


@dataclass(frozen=True)
class TiersConfig(_Component):
    """Persistent KV tiers behind the RAM pool (tiers/, docs/engine.md "Cache tiers"): a local
    disk directory of at most disk_cache_size bytes, and a Redis shared by replicas."""

    CLI_GROUP: ClassVar[str] = "persistent KV tiers (docs/engine.md, 'Cache tiers')"

    # "auto": kv/ under the user cache directory; None: off
    disk_cache_dir: str | Path | None = option(
        None, "keep KV blocks on disk under DIR ('auto': kv/ in the user cache directory): a "
        "restart finds them. Off by default", metavar="DIR",
    )  # fmt: skip
    disk_cache_size: str | int = option(
        "10GiB", "most bytes the disk tier holds (LRU), e.g. 10GiB", metavar="SIZE"
    )
    # redis://[:password@]host:port/db
    remote_cache: str | None = option(
        None, "share KV blocks with other replicas through Redis/Valkey: "
        "redis://[:password@]host:port/db (rediss:// for TLS)", metavar="URL",
    )  # fmt: skip
    remote_cache_max_record: str | int = option(
        "64MiB", "records larger than this are not sent to Redis (one huge SET would outlast "
        "the socket timeout)", metavar="SIZE",
    )  # fmt: skip
    # Bytes of records this deployment keeps in Redis, shared fairly between tenants
    # (tiers/shares.py): "auto" = half the server's maxmemory, "none" = no bound of ours.
    remote_cache_size: str | int = option(
        "auto", "bytes of records this deployment keeps in Redis, shared fairly between "
        "tenants (auto: half the server's maxmemory; none: no bound of ours)", metavar="SIZE",
    )  # fmt: skip
    # The tiers' deployment secret (tiers/secret.py): a file of 32+ random bytes that keys every
    # record's MAC and name. None: one generated once, kept 0600 next to the disk tier
    # (replicas sharing a Redis must share one file, or they share nothing).
    tier_secret_file: str | Path | None = option(
        None, "32+ random bytes that authenticate and name every disk/Redis record "
        "(head -c 32 /dev/urandom > FILE); replicas sharing a Redis must share it. Default: "
        "one generated once, kept 0600 next to the disk tier", metavar="FILE",
    )  # fmt: skip
    # none | lz4 | zstd; used per block only where it pays
    tier_compression: str = option(
        "none", "compress stored blocks where it pays (float32 KV hardly compresses)",
        choices=TIER_COMPRESSIONS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.disk_cache_dir is not None:
            if str(self.disk_cache_dir).strip() == "":
                raise ValueError("disk_cache_dir must be a directory, 'auto' or None")
            parse_bytes(self.disk_cache_size)
        if self.remote_cache is not None:
            check_remote_cache_url(self.remote_cache)
            parse_bytes(self.remote_cache_max_record)
            if str(self.remote_cache_size).lower() not in ("auto", "none"):
                parse_bytes(self.remote_cache_size)
        if self.tier_secret_file is not None and str(self.tier_secret_file).strip() == "":
            raise ValueError("tier_secret_file must be a file or None")
        _one_of("tier_compression", self.tier_compression, TIER_COMPRESSIONS)
        super().__post_init__()


@dataclass(frozen=True)
class SegmentsConfig(_Component):
    """The segment store (segments/, docs/segments.md): RAM for documents' KV computed alone,
    used only by requests that ask for cache_mode="segments", and what one may ask for."""

    CLI_GROUP: ClassVar[str] = "persistent KV tiers (docs/engine.md, 'Cache tiers')"

    # Kept as float32: ~46 KB/token for the default model, so 512 MiB hold ~11k document tokens.
    segment_cache_memory: str | int = option(
        "512MiB", "RAM for documents' KV kept as segments, used only by requests with "
        "cache_mode \"segments\" (docs/segments.md)", metavar="SIZE",
    )  # fmt: skip
    # What one segments request may ask for (SegmentLimitError, a 400, above): documents, and
    # the size of one document's KV computed alone (its record: 46 KB/token for the default
    # model, so 64 MiB is ~1,450 tokens; as large as a Redis record may be by default). A
    # document recomputed whole (segment_recompute_tokens >= its length) makes no record.
    max_segments_per_request: int = option(
        64, "most document messages one cache_mode \"segments\" request (chat or warm) may "
        "have; more is a 400 segment_limit_exceeded", metavar="N",
    )  # fmt: skip
    max_segment_record: str | int = option(
        "64MiB", "most bytes of one document's KV computed alone (its segment record, ~46 "
        "KB/token for the default model); a document that would make a larger one is a 400 "
        "segment_limit_exceeded", metavar="SIZE",
    )  # fmt: skip

    def __post_init__(self) -> None:
        parse_bytes(self.segment_cache_memory)
        parse_bytes(self.max_segment_record)
        if self.max_segments_per_request < 1:
            raise ValueError(
                f"max_segments_per_request must be >= 1, got {self.max_segments_per_request}"
            )
        super().__post_init__()


@dataclass(frozen=True)
class EventsConfig(_Component):
    """KV events in vLLM's format (events/): a ZMQ PUB endpoint to bind (None: off), an
    optional replay endpoint, the topic, the rank written into each batch (a cluster
    replica's), and who may read them (events/access.py): off loopback only with a CURVE
    server secret key file or allow_remote (plaintext); token ids (the prompts) are sent only
    when asked for."""

    CLI_GROUP: ClassVar[str] = "KV events for external routers (docs/cluster.md, 'KV events')"

    kv_events_endpoint: str | None = option(
        None, "ZMQ PUB endpoint to bind, e.g. tcp://127.0.0.1:5557: BlockStored/BlockRemoved/"
        "AllBlocksCleared in vLLM's msgpack format (off by default). Every tenant's cache "
        "traffic: loopback or ipc:// unless CURVE or --kv-events-allow-remote",
    )  # fmt: skip
    kv_events_replay_endpoint: str | None = option(
        None, "ZMQ ROUTER endpoint answering replay requests, e.g. tcp://127.0.0.1:5558"
    )
    kv_events_topic: str = option("", "topic frame of every event message")
    kv_events_curve_secret_file: str | Path | None = option(
        None, "CURVE server secret key (z85; `prefixcache events keygen FILE`): both sockets "
        "encrypt, and only subscribers given FILE.pub connect. Allows a non-loopback bind",
        metavar="FILE",
    )  # fmt: skip
    kv_events_allow_remote: bool = option(
        False, "allow a non-loopback bind without CURVE: anyone reaching the port reads the "
        "stream", action="store_true",
    )  # fmt: skip
    kv_events_token_ids: bool = option(
        False, "send each BlockStored's token ids (the tenants' prompts); empty by default",
        action="store_true",
    )  # fmt: skip
    kv_events_rank: int | None = option(None, cli=False)  # set by a cluster replica

    def __post_init__(self) -> None:
        if self.kv_events_endpoint is not None or self.kv_events_replay_endpoint is not None:
            # events/access.py imports nothing of ours: the one import of config
            from prefixcache.events.access import check_bind, check_endpoint, load_server_secret

            if self.kv_events_endpoint is None:
                raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
            curve = self.kv_events_curve_secret_file is not None
            if curve:  # a bad or unreadable key file fails here, before the model loads
                load_server_secret(self.kv_events_curve_secret_file)
            for ep in (self.kv_events_endpoint, self.kv_events_replay_endpoint):
                if ep is not None:
                    check_endpoint(ep)
                    check_bind(ep, curve=curve, allow_remote=self.kv_events_allow_remote)
        elif self.kv_events_curve_secret_file is not None:
            raise ValueError("kv_events_curve_secret_file needs kv_events_endpoint")
        super().__post_init__()


# The bases in reverse: a dataclass's fields run from its last base's to its first's, so
# EngineConfig's fields (and its positional order) start with the model.
COMPONENTS = (WeightsConfig, CacheConfig, SchedulerConfig, AdmissionConfig, TiersConfig,
              SegmentsConfig, EventsConfig)  # fmt: skip


@dataclass(frozen=True)
class EngineConfig(EventsConfig, SegmentsConfig, TiersConfig, AdmissionConfig, SchedulerConfig,
                   CacheConfig, WeightsConfig):  # fmt: skip
    """Every component's fields, each defined (with its default, check and flag) once in its
    component. A piece that needs one component takes that component's type; EngineConfig is
    every one of them."""


def cli_options(component: type) -> list:
    """The fields of ``component`` that are command-line flags, in declaration order (a
    component has no dataclass base: its fields are its own)."""
    return [f for f in fields(component) if f.metadata["cli"] is not None]


def add_cli_arguments(group, component: type, only: Collection[str] | None = None) -> None:
    """Add ``component``'s flags (those in ``only``, if given) to an argparse parser or group:
    the flag, default, help, choices and metavar all come from the field, and each flag's
    value lands on the field's name (``config_from_cli``)."""
    import argparse

    for f in cli_options(component):
        if only is not None and f.name not in only:
            continue
        spec = dict(f.metadata["cli"])
        flag = spec.pop("flag", "--" + f.name.replace("_", "-"))
        kw = {"dest": f.name, "default": f.default}
        if f.metadata["help"] is not None:
            kw["help"] = f.metadata["help"]
        if isinstance(f.default, bool) and "action" not in spec:
            kw["action"] = argparse.BooleanOptionalAction
        elif type(f.default) in (int, float):
            kw["type"] = type(f.default)
        group.add_argument(flag, **kw, **spec)


def config_from_cli(args) -> EngineConfig:
    """The EngineConfig of parsed flags: every field whose flag the parser had; the others
    keep their defaults."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)
                  if f.metadata["cli"] is not None and hasattr(args, f.name)})  # fmt: skip
