"""AsyncEngine: the step loop in a background thread, requests as async iterators of deltas.

Threading model: one engine thread owns the LLMEngine and runs steps while holding ``_lock``.
Event-loop code never waits on a step to submit work: ``add`` and ``abort`` put typed
messages (:class:`~prefixcache.api.engine.EngineRequest`, :class:`AbortRequest`) in an inbox that the engine thread drains
between steps. Read-only cache queries (lookup, stats) take the lock briefly; call them through
``asyncio.to_thread`` when a step may be long. Deltas are handed back to each request's event
loop with ``call_soon_threadsafe``.

Isolation rules kept here:
- a sequence that fails inside a step fails its own stream only (``SequenceFailedError``); a
  step whose batch fails (the shared forward) fails that batch's streams only
  (``BatchFailedError``), and only a failure before any batch existed fails every stream;
- a stream whose reader leaves more than ``max_pending_deltas`` deltas unread is cancelled
  (``SlowConsumerError``) and its blocks freed, so output queues are bounded;
- a tenant may hold at most ``tenant_waiting_limit`` waiting sequences (``TenantQuotaError``),
  everybody together ``max_waiting_requests`` (``QueueFullError``). Requests without a tenant
  (the offline API, direct users of this class) are subject to the global limit only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

from prefixcache.api.engine import (
    EngineHealth,
    EngineRequest,
    EngineStats,
    LookupResult,
    TenantStats,
    WarmResult,
)
from prefixcache.api.errors import (
    EngineShutDownError,
    InvalidRequestError,
    QueueFullError,
    SequenceFailedError,
    SlowConsumerError,
    TenantQuotaError,
)
from prefixcache.api.request import CacheExplanation, SamplingParams, SharedPrefix, StreamDelta
from prefixcache.api.segments import SegmentRequest
from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import BatchFailedError, LLMEngine

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineShutDownError", "QueueFullError", "WarmResult"]

# Put in a stream's queue by ``abort``: the stream ends (a consumer still iterating stops).
_ABORTED = object()
# A warm's request (store-only segments: nothing is sampled; its prompt must fit as any's).
_WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


InboxMessage = EngineRequest | AbortRequest


class _Stream:
    __slots__ = ("done", "loop", "queue", "tenant")

    def __init__(self, loop: asyncio.AbstractEventLoop, tenant: str | None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.tenant = tenant


class AsyncEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        """``clock``: the time pins and cache leases expire by (tests inject one)."""
        self.engine = LLMEngine(config, clock)
        self.config = config
        self._lock = threading.RLock()
        self._inbox: collections.deque[InboxMessage] = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False  # set by shutdown(): new requests are refused from then on
        self._crash: BaseException | None = None  # what killed the engine thread, if anything
        self._progress = time.monotonic()  # the engine loop last finished an iteration
        self._warm_ids = 0
        self.slow_consumers_total = 0
        self._pin_tenants: frozenset[str] = frozenset()  # the owners bound by a pin quota

    # ---- facts ------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def weights_format(self) -> str:
        return self.engine.weights_format

    @property
    def kv_info(self) -> dict:
        lay = self.engine.layout
        return {
            "kv_cache_dtype": lay.kv_format.name,
            "num_blocks": lay.num_blocks,
            "block_size": lay.block_size,
            "bytes_per_token": lay.bytes_per_token,
            "capacity_tokens": lay.capacity_tokens,
            "capacity_bytes": lay.capacity_bytes,
            "pin_budget_blocks": self.engine.kv.pin_budget_blocks,
            "pin_quota_blocks": self._tenant_pin_quota(len(self._pin_tenants)),
        }

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._closed = False  # a shut-down engine can be started again
        if self._thread is not None and self._crash is not None:
            # A crashed thread is on its way out (its streams are already failed): wait for it
            # off the event loop, then start a new one below.
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._crash = None
        self._progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True, timeout: float = 300.0) -> None:
        """Stop the loop; with ``drain`` the requests already admitted finish first (at most
        ``timeout`` seconds). New requests are refused from the moment this is called."""
        self._closed = True
        if drain:
            deadline = time.monotonic() + timeout
            while (self._streams or self._inbox) and time.monotonic() < deadline:
                if not self._thread_alive():
                    break
                await asyncio.sleep(0.05)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        for rid in list(self._streams):
            self._fail(rid, EngineShutDownError("engine shut down"))
        # Blocks queued for disk / Redis are written before we return: a restart finds them.
        # And KV event subscribers see the last removals too.
        await asyncio.to_thread(self.engine.connectors.flush, 30.0)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> EngineHealth:
        """Dead thread or no progress for ``health_stall_seconds`` while work waits: not ok."""
        since = time.monotonic() - self._progress
        has_work = bool(self._inbox or self._streams)
        if self._thread is None:
            return EngineHealth(False, "not_started", since, has_work)
        # A recorded crash counts as dead at once: the thread sets it before failing its streams,
        # so a consumer that just saw its stream fail must not find the engine "ok" while the
        # thread is still on its way out.
        if self._crash is not None or not self._thread.is_alive():
            return EngineHealth(False, "engine_thread_dead", since, has_work)
        if has_work and since > self.config.health_stall_seconds:
            return EngineHealth(False, "stalled", since, has_work)
        return EngineHealth(True, None, since, has_work)

    # ---- requests ---------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.engine.validate_prompt(prompt_token_ids)

    def check_admission(self, tenant: str | None, num_sequences: int) -> None:
        """Raise unless ``num_sequences`` more waiting sequences of ``tenant`` fit now. The
        tenant's share is checked first: a tenant over it hears so (and nobody else is
        refused because of it), whatever the state of the whole queue. A tenant's message
        gives its own figures only: how many sequences the others have waiting (the global
        count) would tell it how busy they are."""
        mine = self.num_waiting_of(tenant) if tenant is not None else 0
        if tenant is not None:
            share = self.config.tenant_waiting_limit
            if mine + num_sequences > share:
                raise TenantQuotaError(
                    f"this tenant has {mine} sequences waiting and asks for {num_sequences} "
                    f"more (its share of the queue is {share})"
                )
        total = self.num_waiting()
        limit = self.config.max_waiting_requests
        if total + num_sequences > limit:
            if tenant is None:  # the offline API, direct users: one caller, nothing to hide
                raise QueueFullError(f"{total} requests are waiting (limit {limit})")
            raise QueueFullError(
                f"the queue is full; this tenant has {mine} sequences waiting and asks for "
                f"{num_sequences} more (its share is {self.config.tenant_waiting_limit})"
            )

    def add_request(self, *args, **fields) -> AsyncIterator[StreamDelta]:
        """``add`` of ``EngineRequest(*args, **fields)`` (request_id, prompt token ids, params,
        then its optional fields, api/engine.py)."""
        return self.add(EngineRequest(*args, **fields))

    def add(self, request: EngineRequest) -> AsyncIterator[StreamDelta]:
        """Validate now (InvalidRequestError, QueueFullError, TenantQuotaError,
        EngineShutDownError), run in the engine thread, stream deltas. Requests added before
        the first ``start()`` wait for it; after ``shutdown()`` they are refused until
        ``start()`` is called again. The prompt is token ids (the server tokenizes)."""
        request = dataclasses.replace(request, prompt=list(request.prompt))
        self._check_request(request)
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), request.tenant)
        self._streams[rid] = stream
        self._inbox.append(request)
        self._wake.set()
        return self._iterate(rid, stream)

    def _check_request(self, request: EngineRequest) -> None:
        """What ``add`` refuses at once, in this order: a closed engine, a request that
        can never run (``LLMEngine.check_request``: a segments request over its limits, a shared
        prefix past its prompt included), a tenant over its share."""
        if self._closed or self._crash is not None:
            raise EngineShutDownError("the engine is shutting down and takes no new requests")
        self.engine.check_request(request.prompt, request)  # pure: no lock
        self.check_admission(request.tenant, 1)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                item = await stream.queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # The consumer stopped early (client gone, task cancelled): free the blocks now.
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed before the next step."""
        s = self._streams.pop(request_id, None)
        if s is not None and not s.done:
            s.done = True
            # A consumer still iterating (abort from elsewhere) must not wait forever.
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
                s.loop.call_soon_threadsafe(s.queue.put_nowait, _ABORTED)
        self._inbox.append(AbortRequest(request_id))
        self._wake.set()

    def num_waiting(self) -> int:
        adds = sum(1 for m in list(self._inbox) if isinstance(m, EngineRequest))
        return len(self.engine.scheduler.waiting) + adds

    def num_waiting_of(self, tenant: str | None) -> int:
        adds = sum(1 for m in list(self._inbox) if isinstance(m, EngineRequest) and m.tenant == tenant)
        return adds + sum(1 for s in list(self.engine.scheduler.waiting) if s.tenant == tenant)

    # ---- engine thread ----------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._inbox:
            m = self._inbox.popleft()
            if isinstance(m, AbortRequest):
                self.engine.abort(m.request_id)
                continue
            if m.request_id not in self._streams:  # aborted before it was added
                continue
            try:
                self.engine.add(m)
            except Exception as e:  # noqa: BLE001 - handed to the request's consumer
                self._fail(m.request_id, e)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            # Nothing may leave a consumer waiting on a dead thread: fail every stream, and
            # /health reports the death (health()).
            self._crash = e
            log.critical("the engine thread died: %s: %s", type(e).__name__, e, exc_info=e)
            for rid in list(self._streams):
                self._fail(rid, EngineShutDownError("the engine stopped"))

    def _loop(self) -> None:
        while not self._stop:
            self._progress = time.monotonic()
            with self._lock:
                self._drain_inbox()
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        updated = self.engine.step()
                    except BatchFailedError as e:
                        # The forward pass is shared by the batch: every sequence in it fails,
                        # and nobody else (another tenant's waiting request goes on).
                        log.exception("engine step failed; its batch of %d is failed",
                                      len(e.request_ids))  # fmt: skip
                        self._fail_all([r for r in e.request_ids if r in self.engine.seqs], e.cause)
                        updated = []
                    except Exception as e:
                        # Before a batch existed (scheduling, a connector): whom it concerns
                        # is not known, so every sequence fails.
                        log.exception("engine step failed")
                        self._fail_all(list(self.engine.seqs), e)
                        updated = []
                    items = [
                        (s.request_id, s.error or self.engine.output.stream_delta(s))
                        for s in updated
                    ]
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for rid, item in items:
                self._deliver(rid, item)

    def _fail_all(self, request_ids: list[str], err: BaseException) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            self._fail(rid, SequenceFailedError(rid, err))

    def _deliver(self, rid: str, item: StreamDelta | BaseException) -> None:
        s = self._streams.get(rid)
        if s is None:
            return
        if isinstance(item, BaseException):
            self._fail(rid, item)
            return
        if not item.finished and s.queue.qsize() >= self.config.max_pending_deltas:
            # The reader is not keeping up (a stuck client): cancel rather than buffer forever.
            self.slow_consumers_total += 1
            log.warning("request %s cancelled: its reader left %d deltas unread", rid,
                        s.queue.qsize())  # fmt: skip
            self._fail(rid, SlowConsumerError(f"request {rid}: the reader fell behind"))
            self._inbox.append(AbortRequest(rid))
            return
        if item.finished:
            s.done = True
            self._streams.pop(rid, None)
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody reads it, stop it
            self.abort(rid)

    def _fail(self, request_id: str, err: BaseException) -> None:
        s = self._streams.pop(request_id, None)
        if s is not None:
            s.done = True
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
                s.loop.call_soon_threadsafe(s.queue.put_nowait, err)

    # ---- cache control and stats (take the lock: consistent with the engine thread) -------------
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
        """Prefill a prompt (one token is generated and dropped) and optionally pin its blocks,
        charged to ``tenant``'s pin quota (``quota=False``: the pool's budget only). A pin over
        the budget or the quota is a ``PinQuotaError`` after the prefill (the prompt stays
        cached, unpinned): which blocks are new to the pin is known only once they exist.
        ``shared_prefix``: as for a request (a whole prompt may be one).

        Refused before any work as a request would be (the tenant's share of the queue first).
        ``offload(fn, *args)`` runs each call that takes the engine lock (the lookup, the pin)
        and is awaited (default ``asyncio.to_thread``; the server passes its cache routes'
        threads): never the event loop, which a running step would block."""
        call = offload or asyncio.to_thread
        self._warm_ids += 1
        rid = f"warm-{self._warm_ids}-{time.monotonic_ns()}"
        request = EngineRequest(rid, list(prompt_token_ids), _WARM_PARAMS, namespace,
                                tenant=tenant, shared_prefix=shared_prefix)  # fmt: skip
        self._check_request(request)
        if pin:
            self.engine.check_pin_ttl(ttl_seconds)  # before the prefill: a bad TTL costs nothing
        before = await call(self.lookup, prompt_token_ids, namespace, shared_prefix)
        if pin and quota and tenant is not None and tenant not in self._pin_tenants:
            # One nobody named: its share too.
            await call(self.set_pin_tenants, self._pin_tenants | {tenant})
        async for _ in self.add(request):
            pass
        pinned = 0
        if pin:
            pinned = await call(self._pin_prefix, prompt_token_ids, namespace, ttl_seconds,
                                tenant, shared_prefix)  # fmt: skip
        return WarmResult(len(prompt_token_ids), before.num_cached_tokens, pinned)

    def _pin_prefix(self, ids, namespace, ttl_seconds, owner, shared_prefix) -> int:
        with self._lock:
            return self.engine.pin_prefix(ids, namespace, ttl_seconds, owner=owner,
                                          shared_prefix=shared_prefix)  # fmt: skip

    async def warm_segments(
        self,
        token_ids: list[int],
        spans: list[tuple[int, int]],
        namespace: str | None,
        *,
        tenant: str | None = None,
        offload: Callable[..., Awaitable] | None = None,
    ) -> int:
        """Compute and keep each span of ``token_ids`` as a segment (cache_mode="segments" of
        /v1/cache/warm). Returns how many the store held already. A request of ``tenant`` like
        any: refused over its share of the queue (before anything is computed), its documents
        computed alone in pieces within each step's token budget and the tenant's share.
        ``offload``: as for ``warm``."""
        if not spans:
            return 0
        request = EngineRequest("warm", list(token_ids), _WARM_PARAMS, namespace, tenant=tenant,
                                segments=SegmentRequest(tuple(spans), store_only=True))  # fmt: skip
        self._check_request(request)
        before = (await (offload or asyncio.to_thread)(self._held, request)).get("segments", 0)
        self._warm_ids += 1
        rid = f"warm-{self._warm_ids}-{time.monotonic_ns()}"
        stream = self.add(dataclasses.replace(request, request_id=rid))
        async for _ in stream:
            pass
        return before

    def _held(self, request: EngineRequest) -> dict[str, int]:
        with self._lock:
            return self.engine.held(request)

    def set_pin_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants bound by a pin quota (the server's non-admin ones; called again when the
        keys change). Each gets ``pin_quota_fraction`` of the pin budget, but never more than
        an equal share: their quotas sum within the budget, so tenants that pin and renew up
        to their quotas never leave another without its own (block_pool.py)."""
        names = frozenset(tenants)
        with self._lock:
            quota = self._tenant_pin_quota(len(names))
            self.engine.kv.set_pin_quotas(dict.fromkeys(names, quota))
            self._pin_tenants = names

    def _tenant_pin_quota(self, num_tenants: int) -> int:
        budget = self.engine.kv.pin_budget_blocks
        return min(int(budget * self.config.pin_quota_fraction), budget // max(1, num_tenants))

    def lookup(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> LookupResult:
        with self._lock:
            return self.engine.lookup(prompt_token_ids, namespace, shared_prefix)

    def explain(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        across: bool = False,
        shared_prefix: SharedPrefix | None = None,
    ) -> CacheExplanation:
        with self._lock:
            return self.engine.explain(prompt_token_ids, namespace, across, shared_prefix)

    def invalidate(self, namespace: str | None, all_namespaces: bool | None = None) -> int:
        """Drop a namespace's cached blocks; ``namespace=None`` drops all namespaces."""
        everything = namespace is None if all_namespaces is None else all_namespaces
        with self._lock:
            n, tickets = self.engine.start_invalidate(namespace, everything)
        # Deleting from disk / Redis happens outside the lock: steps go on meanwhile.
        self.engine.connectors.wait(tickets)
        return n

    def block_hashes(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> list[bytes]:
        return self.engine.block_hashes(prompt_token_ids, namespace, shared_prefix)

    def cache_stats(self) -> dict:
        with self._lock:
            return self.engine.cache_stats()

    def engine_stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def tenant_stats(self, tenant: str | None, owns: Callable[[str | None], bool]) -> TenantStats:
        with self._lock:
            return self.engine.tenant_stats(tenant, owns)

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()
