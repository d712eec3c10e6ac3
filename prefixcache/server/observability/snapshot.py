"""Engine reads for routes anyone may call often: one reader at a time, on its own thread.

``/metrics`` (keyless on an open server, and scraped by every Prometheus in reach) and
``/v1/debug/integrity`` read the engine under its lock, which a running step holds. Each call
waiting for it in the event loop's default executor held one of the threads that parse and
tokenize every tenant's requests: about 64 concurrent scrapes took all of them, and every
tenant's first token waited seconds (issue #37, measured 2.9x the victim's time to first token).
Decisions:

- **One reader, its own thread.** A :class:`Snapshot` reads on a one-thread executor of its
  own (``SnapshotReader``), never the default one; callers that arrive while a read is under
  way await that read instead of starting another. However many call, at most one thread
  waits for the engine lock on their behalf.
- **Reused while fresh, for untrusted readers.** ``get()`` answers with a read younger than
  ``max_age`` seconds (``/metrics`` read without a key under ``--public-metrics``:
  ``--metrics-max-age``, 1 s; Prometheus scrapes every 15 s by default, so a scraper never
  notices); ``get(fresh=True)`` (an admin, the metrics key, any caller of an open server:
  operators, who read counters before and after a run, as ``prefixcache bench`` does) shares
  only a read in flight, so its answer is never older than its request. ``max_age=0``
  (integrity) is always so.
- **A caller that leaves does not cancel the read** others wait for (shielded).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class SnapshotReader:
    """The one thread snapshots read on."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-snapshot")
        self.reads = 0  # reads started (for tests and stats)

    def submit(self, fn: Callable[[], T]):
        self.reads += 1
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Snapshot(Generic[T]):
    def __init__(
        self,
        read: Callable[[], T],
        reader: SnapshotReader,
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._reader = reader
        self.max_age = max_age
        self._clock = clock
        self._value: tuple[float, T] | None = None  # (when its read began, the value)
        self._pending: asyncio.Future | None = None

    async def get(self, fresh: bool = False) -> T:
        """The last value if younger than ``max_age`` (not when ``fresh``), else the read under
        way, else a new read."""
        now = self._clock()
        if not fresh and self._value is not None and now - self._value[0] < self.max_age:
            return self._value[1]
        if self._pending is None:
            began = now
            pending = asyncio.wrap_future(self._reader.submit(self._read))
            self._pending = pending

            def done(f: asyncio.Future) -> None:
                if self._pending is f:
                    self._pending = None
                if not f.cancelled() and f.exception() is None:
                    self._value = (began, f.result())

            pending.add_done_callback(done)
        return await asyncio.shield(self._pending)
