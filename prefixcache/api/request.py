"""Request, SamplingParams, RequestOutput: plain data, shaped like vLLM's so users know them.

Imports nothing of ours but the typed errors (prefixcache/api/errors.py)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from prefixcache.api.errors import InvalidRequestError

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by 1e-40 gives
# inf, and softmax of inf is NaN. The greedy token is the limit of sampling as T -> 0 anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# Seeds are 64-bit integers, as in OpenAI's API and vLLM (torch accepts [-2**63, 2**64)).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Every value is checked here, once, so nothing past the edge
    (sampler, output processor) can meet a NaN, an infinity or a wrong type: a bad value is an
    ``InvalidRequestError`` (a ``ValueError``) whose ``param`` names the field."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE_EPS) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each generated token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept lists (and a single string for stop) from callers; store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k is None:
            object.__setattr__(self, "top_k", -1)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (off) or an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be strings")
        if any(not s for s in self.stop):
            raise bad("stop", "strings must be non-empty")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integers >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


@dataclass(frozen=True)
class SharedPrefix:
    """The leading ``num_tokens`` tokens of a request may be cached in ``namespace``, a
    namespace shared with others; the rest of the request stays in its own namespace.

    The one way to mark a prefix as shared (the server declares a chat's leading system
    messages with it, an admin's warm a whole prompt; hosted-API cache breakpoints set it
    too). Only whole blocks are shared: ``num_tokens`` is rounded down to a multiple of the
    block size, and the request's later blocks (its suffix, its generated output) are keyed in
    its own namespace with the chain going on from the shared prefix's last key, salted with
    that namespace (docs/design.md §3, "Shared prefixes"). So another request can hit the
    shared part only, and what a request learns about the cache (hits, ``diverged_at``) never
    reaches past the shared part into blocks it does not own."""

    namespace: str | None
    num_tokens: int

    def __post_init__(self) -> None:
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise InvalidRequestError("shared prefix namespace must be a string", param="shared_prefix")
        if not _is_int(self.num_tokens) or self.num_tokens < 0:
            raise InvalidRequestError(
                f"shared prefix num_tokens must be an integer >= 0, got {self.num_tokens!r}",
                param="shared_prefix",
            )


@dataclass(frozen=True)
class CacheLease:
    """Keep the whole blocks of the request's leading ``num_tokens`` prompt tokens from
    eviction for ``ttl_seconds`` once its prompt is computed: a pin with a TTL charged to the
    request's tenant (its pin quota), granted as a ``LeaseGrant``. The server makes one of each
    cache breakpoint (Anthropic's ``cache_control``); a later request with the same lease
    renews it (the deadline moves, no quota is spent again)."""

    num_tokens: int
    ttl_seconds: float

    def __post_init__(self) -> None:
        if not _is_int(self.num_tokens) or self.num_tokens < 0:
            raise InvalidRequestError(
                f"lease num_tokens must be an integer >= 0, got {self.num_tokens!r}", param="leases"
            )
        if not _is_real(self.ttl_seconds) or self.ttl_seconds <= 0:
            raise InvalidRequestError(
                f"lease ttl_seconds must be a finite number > 0, got {self.ttl_seconds!r}",
                param="leases",
            )


# LeaseGrant.status: what a lease got. "clipped": held, for less than asked (the server's
# longest pin); "rejected": not held, ``reason`` says why.
LEASE_ACCEPTED, LEASE_CLIPPED, LEASE_REJECTED = "accepted", "clipped", "rejected"


@dataclass(frozen=True)
class LeaseGrant:
    """What one ``CacheLease`` got: ``num_tokens`` prompt tokens held (its whole blocks; 0 when
    rejected) for ``ttl_seconds``. ``reason`` of a rejection: "caching_disabled",
    "shorter_than_a_block", "not_cached", "pin_quota_exceeded" (the tenant's own pins fill its
    quota), "pin_budget_exceeded" (the server's pin budget is full)."""

    num_tokens: int
    status: str
    ttl_seconds: float
    reason: str | None = None


# Retention priorities (TensorRT-LLM's scale): 0 goes first, 100 last; a block nobody ranked is
# at the default, TensorRT-LLM's too. A cache breakpoint ranks its prefix at the top.
MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY = 0, 100
DEFAULT_RETENTION_PRIORITY = 35


@dataclass(frozen=True)
class RetentionPriority:
    """Rank the blocks this request uses in its tenant's own namespace (its prompt's and its
    output's) at ``priority`` (0-100) for ``seconds`` (None: while they stay cached), then back
    at the default. Eviction takes a tenant's lower-ranked blocks before its higher-ranked
    ones; it never decides *whose* blocks go (docs/design.md §4, "Retention priority")."""

    priority: int
    seconds: float | None = None

    def __post_init__(self) -> None:
        lo, hi = MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY
        if not _is_int(self.priority) or not lo <= self.priority <= hi:
            raise InvalidRequestError(
                f"retention_priority must be an integer in [{lo}, {hi}], got {self.priority!r}",
                param="retention_priority",
            )
        if self.seconds is not None and (not _is_real(self.seconds) or self.seconds <= 0):
            raise InvalidRequestError(
                f"retention_priority_seconds must be a finite number > 0, got {self.seconds!r}",
                param="retention_priority_seconds",
            )

class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Waiting while a KV connector loads its cache (a restore from a persistent tier; vLLM's
    # WAITING_FOR_REMOTE_KVS): never admitted meanwhile. Only cache/connector.py's
    # ConnectorSet moves a sequence into and out of it (back to WAITING).
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # One dict per generated token: token id -> logprob (the chosen token and the top-k).
    logprobs: list[dict[int, float]] | None = None


@dataclass
class CacheReport:
    """What a request is told about its use of the cache: one object, written field by field
    inside the engine (each field by one module: tests/structure/test_layering.py), and handed on
    as a ``snapshot`` unchanged in ``StreamDelta.cache``, ``RequestOutput.cache`` and the server's
    answers (usage's cached tokens, ``cache_info``, tiers, leases)."""

    # Prompt tokens served from the cache at first admission (exact prefix hits; None until
    # then: the KV cache manager).
    num_cached_tokens: int | None = None
    # Of num_cached_tokens, the tokens restored from each persistent tier ("disk", "redis");
    # None when the engine has no tiers (the tiers connector).
    tier_tokens: dict[str, int] | None = None
    # cache_mode="segments": document tokens whose KV was reused from the segment store and not
    # recomputed (never counted in num_cached_tokens; the segments assembler).
    num_segment_cached_tokens: int | None = None
    # Why the prompt hit or missed, when the request asked (return_cache_info; the engine).
    cache_info: CacheExplanation | None = None
    # What its cache leases got (EngineRequest.leases), once its prompt is computed (the engine).
    lease_grants: tuple[LeaseGrant, ...] | None = None

    def snapshot(self) -> CacheReport:
        """A copy for the outside (counts not yet known read 0): what the engine writes later
        never changes an answer already handed out."""
        return CacheReport(
            self.num_cached_tokens or 0,
            None if self.tier_tokens is None else dict(self.tier_tokens),
            self.num_segment_cached_tokens or 0,
            self.cache_info,
            self.lease_grants,
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    cache: CacheReport = field(default_factory=CacheReport)
    metrics: RequestMetrics | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the cache (vLLM's field)."""
        return self.cache.num_cached_tokens or 0

    @property
    def num_segment_cached_tokens(self) -> int:
        return self.cache.num_segment_cached_tokens or 0


@dataclass
class StreamDelta:
    """One increment of a streamed request (AsyncEngine.add yields these)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    cache: CacheReport = field(default_factory=CacheReport)
    new_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    # The first delta of its request: it alone carries the prompt's ids.
    first: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def num_cached_tokens(self) -> int:
        return self.cache.num_cached_tokens or 0


@dataclass(frozen=True)
class CacheExplanation:
    """Why a prompt hit or missed the prefix cache, computed when it was admitted.

    reason is one of: "full_hit" (every full block cached), "no_prior_request" (nothing with this
    prefix was ever cached in the namespace), "evicted" (it was cached, then evicted),
    "diverged" (an earlier prompt shared the first ``first_uncached_position`` tokens, then
    differed), "other_namespace" (the blocks exist, but under another namespace),
    "partial_block" (only the tail, shorter than a block, is uncached: it is never cached),
    "caching_disabled".
    """

    cached_tokens: int
    first_uncached_position: int
    reason: str
    diverged_at: int | None = None
