"""The engine boundary the server programs against: one protocol, typed results, typed errors.

``AsyncEngine`` implements :class:`EngineAPI`; the server (``prefixcache/server``) uses nothing
else of the engine, so it never probes for methods with ``getattr`` and never matches error
messages (the errors are the classes of ``prefixcache/api/errors.py``). Tests can hand the app any
object with these methods.

No torch here, and no engine import: plain data and a ``typing.Protocol``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.api.request import (
    CacheExplanation,
    CacheLease,
    RetentionPriority,
    SamplingParams,
    SharedPrefix,
    StreamDelta,
)
from prefixcache.api.segments import SegmentRequest
from prefixcache.config import EngineConfig


@dataclass(frozen=True)
class EngineRequest:
    """One request as it enters the engine (``LLMEngine.add``), the same object from the API to
    the step loop: the async engine queues it for the engine thread as it is.

    ``prompt``: text (tokenized by the engine) or token ids. ``namespace``: the cache namespace
    its blocks are keyed in; ``shared_prefix``: the leading tokens keyed in a shared namespace
    instead (whole blocks of them; generated output is never shared). ``tenant``: who sent it
    (fair admission, quotas, the tiers' shares). ``priority`` orders a tenant's own waiting
    requests. ``explain``: say why it hit or missed (``explain_across_namespaces``, admins only:
    other namespaces may explain a miss). ``segments``: cache_mode "segments". ``leases``:
    prefixes of the prompt to keep from eviction for a while once computed, charged to
    ``tenant``'s pin quota (the grants come in the stream's deltas). ``retention``: how its
    new blocks are kept beyond RAM: None (written through to the persistent tiers, kept until
    they evict them), "in_memory" (never written to them), "24h" (written, expiring there
    after 24 hours). ``retention_priority``: how the blocks it uses in its own namespace rank
    for eviction among its tenant's (``RetentionPriority``; None: as they are)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    namespace: str | None = None
    priority: int = 0
    explain: bool = False
    arrival_time: float | None = None  # time.time() at arrival; None: when added
    tenant: str | None = None
    explain_across_namespaces: bool = False
    segments: SegmentRequest | None = None
    shared_prefix: SharedPrefix | None = None
    leases: tuple[CacheLease, ...] = ()
    retention: str | None = None
    retention_priority: RetentionPriority | None = None


# EngineRequest.retention: the values, and how long "24h" keeps blocks in the tiers.
RETENTIONS = ("in_memory", "24h")
RETENTION_SECONDS = {"24h": 24 * 3600.0}


@dataclass(frozen=True)
class LookupResult:
    num_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True)
class WarmResult:
    num_tokens: int
    num_cached_tokens: int
    pinned_blocks: int


@dataclass(frozen=True)
class EngineStats:
    """Everything the engine counts, read at one moment (the one stats type: the offline
    ``cache_stats()`` dict, ``/v1/cache/stats`` and ``/metrics`` are views of it)."""

    num_running: int
    num_waiting: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    evicted_blocks_total: int
    kv_cache_usage: float  # blocks held by live requests / total (idle cached blocks are free)
    cached_blocks: int  # reusable, unreferenced (evictable unless pinned)
    free_blocks: int
    in_use_blocks: int
    pinned_blocks: int
    total_blocks: int
    block_size: int
    used_bytes: int
    capacity_bytes: int
    enable_prefix_caching: bool
    num_fairness_preemptions_total: int = 0
    num_shared_steps_total: int = 0
    # One tiers.stats.TierStats per persistent tier (disk, redis), in lookup order; () if none.
    tiers: tuple = ()

    @property
    def hit_rate(self) -> float:
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else 0.0


@dataclass(frozen=True)
class TenantStats:
    """One tenant's own view: its traffic, its sequences, its namespaces' blocks and pins."""

    tenant: str | None
    num_running: int
    num_waiting: int
    prompt_tokens_total: int  # prompt tokens looked up in the cache
    prefix_cache_hits_total: int
    generation_tokens_total: int
    pinned_blocks: int  # blocks this tenant holds a pin on (its quota's use)
    namespace_blocks: dict[str, int]  # its namespaces -> blocks indexed there now
    # Its prompt tokens restored from each persistent tier (disk, redis); {} without tiers.
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    # Its own share of the tiers (tiers/shares.py), never another tenant's figures: "queue"
    # (queued_bytes, dropped_writes: its writes dropped at the write queue; queued_restores,
    # dropped_restores: its restores not queued, over the reader's per-tenant bound), and per tier
    # stored_records / stored_bytes (disk: now; redis: as of this server's last write of it,
    # records None). {} without tiers.
    tier_usage: dict[str, dict] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        q = self.prompt_tokens_total
        return self.prefix_cache_hits_total / q if q else 0.0


@dataclass(frozen=True)
class EngineHealth:
    """``ok`` unless the engine thread died, or work waits and no step finished for longer
    than the stall limit (a hung step, a deadlock)."""

    ok: bool
    reason: str | None  # "not_started", "engine_thread_dead", "stalled"; None when ok
    seconds_since_progress: float
    has_work: bool


class EngineAPI(Protocol):
    config: EngineConfig
    slow_consumers_total: int  # streams cancelled because their reader fell behind

    @property
    def tokenizer(self): ...
    @property
    def model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def weights_format(self) -> str: ...
    @property
    def kv_info(self) -> dict: ...

    async def start(self) -> None: ...
    async def shutdown(self, drain: bool = True, timeout: float = 300.0) -> None: ...
    def health(self) -> EngineHealth: ...

    def check_admission(self, tenant: str | None, num_sequences: int) -> None:
        """Raise QueueFullError / TenantQuotaError if ``num_sequences`` more do not fit now."""

    def add(self, request: EngineRequest) -> AsyncIterator[StreamDelta]:
        """Run ``request`` (its prompt as token ids); its deltas, as they come."""

    def abort(self, request_id: str) -> None: ...
    def validate_prompt(self, prompt_token_ids: list[int]) -> None: ...

    async def warm(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        pin: bool = False,
        ttl_seconds: float | None = None,
        *,
        tenant: str | None = None,
        quota: bool = True,
        shared_prefix: SharedPrefix | None = None,
        offload: Callable[..., Awaitable] | None = None,
    ) -> WarmResult:
        """Prefill (and pin, charged to ``tenant``; ``quota=False`` for admins); refused as a
        request would be before any work. ``offload(fn, *args)`` runs its calls that take the
        engine lock (default: a worker thread), never the event loop."""

    async def warm_segments(
        self,
        token_ids: list[int],
        spans: list[tuple[int, int]],
        namespace: str | None,
        *,
        tenant: str | None = None,
        offload: Callable[..., Awaitable] | None = None,
    ) -> int:
        """Store each span as a segment (cache_mode="segments"), as a request of ``tenant``
        (admitted and budgeted like any); returns those stored already. ``offload``: as for
        ``warm``."""

    def set_pin_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants bound by a pin quota; their quotas sum within the pin budget."""

    def lookup(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> LookupResult: ...
    def explain(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        across: bool = False,
        shared_prefix: SharedPrefix | None = None,
    ) -> CacheExplanation: ...
    def invalidate(self, namespace: str | None, all_namespaces: bool | None = None) -> int: ...
    def block_hashes(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> list[bytes]: ...
    def engine_stats(self) -> EngineStats: ...
    def tenant_stats(
        self, tenant: str | None, owns: Callable[[str | None], bool]
    ) -> TenantStats: ...
    def check_integrity(self) -> None: ...
