"""The request log, written off the event loop; a failing log never fails a request.

``--log-requests FILE`` records one line per prompt (analyze/request_log.py is the format). A
handler only puts a small record in a bounded queue; one background thread hashes the prompt's
blocks and writes the line. A write that fails (disk full, file gone) is a warning in the log
(the first, then one per 1,000) and a counter on ``/metrics``; when the queue is full (the disk is
slower than the traffic) the record is dropped and counted. The request is never failed or
delayed by either.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixcache.api.request import SharedPrefix

log = logging.getLogger("prefixcache.server")

_STOP = object()


@dataclass(frozen=True)
class LogRecord:
    time: float
    tenant: str
    namespace: str
    prompt_token_ids: Sequence[int]
    num_cached_tokens: int
    shared_prefix: SharedPrefix | None = None  # what it declared shared: keys as the engine's


class BackgroundRequestLog:
    """Wraps a ``RequestLogWriter``; ``block_hashes(ids, namespace, shared_prefix)`` computes
    the keys."""

    def __init__(
        self,
        writer,
        block_hashes: Callable[[Sequence[int], str, SharedPrefix | None], list[bytes]],
        max_queue: int = 10_000,
    ) -> None:
        self.writer = writer
        self._hashes = block_hashes
        self._queue: queue.Queue = queue.Queue(max_queue)
        self.errors_total = 0
        self.dropped_total = 0
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def submit(self, record: LogRecord) -> None:
        """Never blocks and never raises."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped_total += 1

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is _STOP:
                return
            if isinstance(record, _Marker):
                record.event.set()
                continue
            try:
                self.writer.log(
                    time=record.time,
                    tenant=record.tenant,
                    namespace=record.namespace,
                    num_prompt_tokens=len(record.prompt_token_ids),
                    block_hashes=self._hashes(
                        record.prompt_token_ids, record.namespace, record.shared_prefix
                    ),
                    num_cached_tokens=record.num_cached_tokens,
                    text=None,
                )
            except Exception as e:  # noqa: BLE001 - a log line is never worth a request
                self.errors_total += 1
                if self.errors_total % 1000 == 1:
                    log.warning(
                        "request log write failed (%d so far): %s: %s",
                        self.errors_total, type(e).__name__, e,
                    )  # fmt: skip

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every submitted record was handled (tests, shutdown)."""
        done = threading.Event()
        self.submit(_Marker(done))  # type: ignore[arg-type]
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        try:
            self.writer.close()
        except OSError as e:
            log.warning("request log close failed: %s", e)


class _Marker:
    """A queue item that signals it was reached (everything before it is written)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
