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
- **A count, not a rate.** The cap bounds what a tenant holds now; there is no clock in it, so
  an honest client issuing calls one after another is never refused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prefixcache.server.errors import APIError

T = TypeVar("T")


class CacheCallGate:
    def __init__(self, threads: int, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prefixcache-cache-route")
        self._lock = threading.Lock()  # released from worker threads
        # tenant -> calls admitted and not finished; a tenant leaves with its last call, so the
        # map is bounded by the calls in flight.
        self._admitted: dict[str, int] = {}

    def admitted(self, tenant: str) -> int:
        with self._lock:
            return self._admitted.get(tenant, 0)

    async def run(self, tenant: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the cache routes' pool, charged to ``tenant``; 429 over its cap."""
        with self._lock:
            n = self._admitted.get(tenant, 0)
            if n >= self.per_tenant:
                raise APIError(
                    429,
                    f"too many cache control calls at once: at most {self.per_tenant} per "
                    "tenant may run; retry when one has finished",
                    code="rate_limit_exceeded", headers={"Retry-After": "1"},
                )  # fmt: skip
            self._admitted[tenant] = n + 1
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._release(tenant)
            raise
        future.add_done_callback(lambda _f: self._release(tenant))
        return await asyncio.wrap_future(future)

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
