"""Frozen configuration dataclasses, validated at construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    kv_cache_memory: str | int | None = None  # None: a share of available memory, capped
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Token-exact hits (docs/design.md §4): when a prompt diverges inside a cached block, its
    # leading tokens' K/V are copied instead of computed, so a hit is the whole common prefix.
    partial_block_reuse: bool = True
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128  # vLLM's CPU default for its server: throughput needs wide decode steps
    max_num_batched_tokens: int = 2048
    # While two or more tenants are active (running, waiting, or a request within the last
    # shared_window_s seconds), a step carries only the tokens that fit in about
    # shared_step_ms at the pace of recent steps, so another tenant's short request waits one or
    # two short steps rather than a full chunk (engine/fairness.py 4.); 0 turns the bound off.
    # The victim's wait is about half a step plus its own: 150 ms kept every attack of
    # benchmarks/tenant_isolation.py within 3x on Zen 4 (250 ms: up to 3.5x) at 0-4% of the
    # attacker's throughput (docs/benchmarks-journal.md "Tenant isolation").
    shared_step_ms: float = 150.0
    shared_window_s: float = 60.0
    # While two or more sequences have work (a burst of prompts, prompts beside decodes), a step
    # carries only the tokens that fit in about busy_step_ms at the pace of recent steps (at
    # least BUSY_STEP_FLOOR tokens): the burst's prompts then get their first tokens one after
    # another instead of all when the whole burst is done, and decodes are not held behind a
    # full chunk. A sequence alone gets full steps; 0 turns the bound off. The pace is that of
    # prefill-dominated steps only (scheduler.prefill_pace). Measured on Zen 4
    # (docs/benchmarks-journal.md): 200 ms beat 100 on throughput and TTFT at concurrency 8.
    busy_step_ms: float = 200.0
    scheduling_policy: str = "fcfs"
    # Which cached block the pool evicts (docs/design.md §4 "Eviction policy"): lru (least
    # recently released first), lru-demote or hit-density; the trace simulator runs the same code.
    eviction_policy: str = "lru"
    dtype: str = "auto"  # auto: float32 (CPU and CUDA: the cold == warm contract)
    quantization: str = "auto"
    activations: str = "auto"  # ACTIVATIONS
    # How K/V are stored (kv/formats.py): auto = the model's dtype; bfloat16, int8, fp8_e4m3.
    kv_cache_dtype: str = "auto"
    # Converted weights and tokenizer are kept here between starts (keyed by the model file's
    # digest and the cache format version); None turns the cache off.
    weights_cache_dir: str | Path | None = "auto"
    # Persistent KV tiers behind the RAM pool (tiers/, docs/engine.md "Cache tiers"): a local
    # disk directory ("auto": kv/ under the user cache directory; None: off) of at most
    # disk_cache_size bytes, and a Redis shared by replicas (redis://[:password@]host:port/db).
    disk_cache_dir: str | Path | None = None
    disk_cache_size: str | int = "10GiB"
    remote_cache: str | None = None
    tier_compression: str = "none"  # none | lz4 | zstd; used per block only where it pays
    # The tiers' deployment secret (tiers/secret.py): a file of 32+ random bytes that keys every
    # record's MAC and name. None: one generated once, kept 0600 next to the disk tier
    # (replicas sharing a Redis must share one file, or they share nothing).
    tier_secret_file: str | Path | None = None
    remote_cache_max_record: str | int = "64MiB"  # larger records are not sent to Redis
    # Bytes of records this deployment keeps in Redis, shared fairly between tenants
    # (tiers/shares.py): "auto" = half the server's maxmemory, "none" = no bound of ours.
    remote_cache_size: str | int = "auto"
    # KV events in vLLM's format (events/): a ZMQ PUB endpoint to bind (None: off), an optional
    # replay endpoint, the topic, and the rank written into each batch (a cluster replica's).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_rank: int | None = None
    # Who may read them (events/access.py): off loopback only with a CURVE server secret key
    # file or allow_remote (plaintext); token ids (the prompts) are sent only when asked for.
    kv_events_curve_secret_file: str | Path | None = None
    kv_events_allow_remote: bool = False
    kv_events_token_ids: bool = False
    # Segment store (segments/, docs/segments.md): RAM for documents' KV computed alone, used
    # only by requests that ask for cache_mode="segments". Kept as float32: ~46 KB/token for
    # the default model, so 512 MiB hold ~11k document tokens.
    segment_cache_memory: str | int = "512MiB"
    # What one segments request may ask for (SegmentLimitError, a 400, above): documents, and
    # the size of one document's KV computed alone (its record: 46 KB/token for the default
    # model, so 64 MiB is ~1,450 tokens; as large as a Redis record may be by default). A
    # document recomputed whole (segment_recompute_tokens >= its length) makes no record.
    max_segments_per_request: int = 64
    max_segment_record: str | int = "64MiB"
    device: str = "cpu"
    seed: int = 0
    max_waiting_requests: int = 256
    # A tenant's share of the waiting queue (sequences; None: half of max_waiting_requests), so
    # one tenant's flood is refused (429) before it fills the queue for everyone.
    max_waiting_per_tenant: int | None = None
    pin_budget_fraction: float = 0.25  # share of the pool pinned blocks may hold
    # Share of the pin budget one (non-admin) tenant may hold pinned.
    pin_quota_fraction: float = 0.5
    # Longest pin; a pin without a TTL gets this one (pins never last forever).
    max_pin_ttl_seconds: float = 3600.0
    # A stream whose reader leaves more deltas than this unread is cancelled (its blocks freed).
    max_pending_deltas: int = 1024
    # /health says 503 when work waits and no step finished for this long.
    health_stall_seconds: float = 60.0
    # lpm and sjf starvation guard: a waiting request older than this many steps goes first.
    lpm_max_wait_steps: int = 64
    # Above this many waiting requests lpm and sjf fall back to fcfs (SGLang does the same: sorting a
    # long queue by prefix match costs more than it saves).
    lpm_max_queue: int = 128

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        parse_bytes(self.segment_cache_memory)
        parse_bytes(self.max_segment_record)
        if self.max_segments_per_request < 1:
            raise ValueError(
                f"max_segments_per_request must be >= 1, got {self.max_segments_per_request}"
            )
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
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
        if self.tier_compression not in TIER_COMPRESSIONS:
            raise ValueError(
                f"tier_compression must be one of {TIER_COMPRESSIONS}, "
                f"got {self.tier_compression!r}"
            )
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
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not (0 <= self.pin_budget_fraction <= 1):
            raise ValueError(f"pin_budget_fraction must be in [0, 1], got {self.pin_budget_fraction}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_waiting_per_tenant is not None and self.max_waiting_per_tenant < 1:
            raise ValueError(
                f"max_waiting_per_tenant must be >= 1, got {self.max_waiting_per_tenant}"
            )
        if not (0 <= self.pin_quota_fraction <= 1):
            raise ValueError(f"pin_quota_fraction must be in [0, 1], got {self.pin_quota_fraction}")
        if not (self.max_pin_ttl_seconds > 0 and math.isfinite(self.max_pin_ttl_seconds)):
            raise ValueError(
                f"max_pin_ttl_seconds must be a positive number, got {self.max_pin_ttl_seconds}"
            )
        if self.max_pending_deltas < 1:
            raise ValueError(f"max_pending_deltas must be >= 1, got {self.max_pending_deltas}")
        if not self.health_stall_seconds > 0:
            raise ValueError(
                f"health_stall_seconds must be > 0, got {self.health_stall_seconds}"
            )

    @property
    def tenant_waiting_limit(self) -> int:
        if self.max_waiting_per_tenant is not None:
            return self.max_waiting_per_tenant
        return max(1, self.max_waiting_requests // 2)
