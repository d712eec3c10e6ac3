"""Where the cache routes' engine calls run: their own small pool, a cap per tenant.

``/v1/cache/lookup``, ``/invalidate`` and ``/stats`` call the engine synchronously: they wait for
its lock (held through a step) and an invalidation waits for the tier writer (up to a minute
when a tier is slow). Run in the event loop's default executor, a burst of them would take every
thread that tokenization and body parsing also need, so one tenant's cheap calls would stall
every tenant's completions. Decisions:

- **Own executor.** ``cache_route_threads`` threads serve these calls and nothing else; the
  default executor never waits behind them.
- **Per-tenant cap.** A tenant may have at most ``max_cache_calls_per_tenant`` such calls
  admitted (queued or running) at once; one more is a 429 for that tenant alone (OpenAI's
  ``rate_limit_error`` shape, ``Retry-After: 1``). With the cap at most half the threads, a
  flooding tenant never holds the whole pool. A call is released when its thread finishes, not
  when its client leaves: a disconnect cannot free a slot that is still working.
- **And a rate.** The count alone let one tenant answer ~300 calls a second two at a time;
  their Python (hashing, stats) holds the GIL the engine's step needs between its kernels, so
  another tenant's first token took 2.9-3.1x as long (benchmarks/tenant_isolation.py
  ``routes``, Zen 4). A non-admin tenant also gets ``max_cache_calls_per_second`` calls a second
  (a token bucket holding one second's worth, so a burst of that many passes at once); past
  it, a 429 before anything runs. An honest client polling stats or looking up prompts stays far
  under it; admins (operators' tooling) are not rated.
- **Charged before the body is read** (issue #37): a route takes its call from the bucket
  (``take``) right after authentication, so a tenant over its rate is refused before its
  body is parsed or its prompt tokenized. The same gate carries the other work a tenant can
  ask for outside the engine's queue: ``/v1/cache/warm`` (its lookup and pin wait for the
  engine lock on these threads, never on the event loop or the default executor),
  ``/v1/messages/count_tokens`` (up to five renders) and comparisons with an earlier response
  (a binary search of renders).
- **One admission for several calls** (``admitted``): a warm looks up, prefills, then pins; it
  is admitted once and its calls run under that ticket, so it never meets a 429 half done.
  The slot is released when the ticket is closed *and* its last call has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prefixcache.server.edge.errors import APIError

T = TypeVar("T")


class CacheCallGate:
    # Rate buckets remembered at most (least recently used forgotten first: a forgotten tenant
    # starts again with a full bucket, which is what an idle one has anyway).
    MAX_BUCKETS = 4096

    def __init__(self, threads: int, per_tenant: int, per_second: float = math.inf,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.per_tenant = per_tenant
        self.per_second = per_second
        self.clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prefixcache-cache-route")
        self._lock = threading.Lock()  # released from worker threads
        # tenant -> calls admitted and not finished; a tenant leaves with its last call, so the
        # map is bounded by the calls in flight.
        self._admitted: dict[str, int] = {}
        # tenant -> (calls it may still make now, when that was counted): a token bucket
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _take(self, tenant: str) -> None:
        """One call from ``tenant``'s bucket, or a 429 (under ``self._lock``)."""
        now = self.clock()
        tokens, then = self._buckets.pop(tenant, (self.per_second, now))
        tokens = min(self.per_second, tokens + (now - then) * self.per_second)
        if tokens < 1:
            self._buckets[tenant] = (tokens, now)
            raise APIError(
                429,
                f"too many cache control calls: at most {self.per_second:g} a second per tenant",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil((1 - tokens) / self.per_second)))},
            )  # fmt: skip
        self._buckets[tenant] = (tokens - 1, now)
        while len(self._buckets) > self.MAX_BUCKETS:
            self._buckets.popitem(last=False)

    def num_admitted(self, tenant: str) -> int:
        with self._lock:
            return self._admitted.get(tenant, 0)

    def take(self, tenant: str) -> None:
        """One call from ``tenant``'s rate (429 over it), before any of its work is done."""
        if math.isfinite(self.per_second):
            with self._lock:
                self._take(tenant)

    def _admit(self, tenant: str, rated: bool) -> None:
        with self._lock:
            if rated and math.isfinite(self.per_second):
                self._take(tenant)
            n = self._admitted.get(tenant, 0)
            if n >= self.per_tenant:
                raise APIError(
                    429,
                    f"too many cache control calls at once: at most {self.per_tenant} per "
                    "tenant may run; retry when one has finished",
                    code="rate_limit_exceeded", headers={"Retry-After": "1"},
                )  # fmt: skip
            self._admitted[tenant] = n + 1

    @contextlib.contextmanager
    def admitted(self, tenant: str, rated: bool = True):
        """A ticket (429 over the tenant's cap or, when ``rated``, its rate) whose ``call``s
        run on the cache routes' pool; its slot is freed once the block is left and every
        call it started has finished."""
        self._admit(tenant, rated)
        ticket = _Ticket(self, tenant)
        try:
            yield ticket
        finally:
            ticket.close()

    async def run(self, tenant: str, fn: Callable[..., T], *args, rated: bool = True) -> T:
        """``fn(*args)`` on the cache routes' pool, charged to ``tenant``; 429 over its cap or,
        when ``rated`` (a non-admin), over its calls a second."""
        with self.admitted(tenant, rated) as ticket:
            return await ticket.call(fn, *args)

    def _release(self, tenant: str) -> None:
        with self._lock:
            n = self._admitted[tenant] - 1
            if n:
                self._admitted[tenant] = n
            else:
                del self._admitted[tenant]

    def close(self) -> None:
        """Calls not started are dropped; running ones finish on their own (never joined here:
        one may wait a minute on a tier)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Ticket:
    """One admission to the gate: its calls, and when its slot is given back."""

    def __init__(self, gate: CacheCallGate, tenant: str) -> None:
        self._gate = gate
        self._tenant = tenant
        self._calls = 0  # started and not finished
        self._open = True

    async def call(self, fn: Callable[..., T], *args) -> T:
        gate = self._gate
        with gate._lock:
            self._calls += 1
        try:
            future = gate._pool.submit(fn, *args)
        except BaseException:
            self._finished()
            raise
        future.add_done_callback(lambda _f: self._finished())
        return await asyncio.wrap_future(future)

    def _finished(self) -> None:
        with self._gate._lock:
            self._calls -= 1
            last = not self._open and self._calls == 0
        if last:
            self._gate._release(self._tenant)

    def close(self) -> None:
        with self._gate._lock:
            self._open = False
            last = self._calls == 0
        if last:
            self._gate._release(self._tenant)
