"""AsyncEngine: the step loop in a background thread, requests as async iterators of deltas.

Threading model: one engine thread owns the LLMEngine and runs steps while holding ``_lock``.
Event-loop code never waits on a step to submit work: ``add_request`` and ``abort`` go through
an inbox that the engine thread drains between steps. Read-only cache queries (lookup, stats)
take the lock briefly; call them through ``asyncio.to_thread`` when a step may be long.
Deltas are handed back to each request's event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prefixcache.config import EngineConfig
from prefixcache.engine import EngineStats, LLMEngine, LookupResult
from prefixcache.request import SamplingParams, StreamDelta

log = logging.getLogger(__name__)


# Put in a stream's queue by ``abort``: the stream ends (a consumer still iterating stops).
_ABORTED = object()


class QueueFullError(RuntimeError):
    """More requests are waiting than the engine accepts; retry later (HTTP 429)."""


class EngineShutDownError(RuntimeError):
    """The engine is shutting down or shut down: it takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class WarmResult:
    num_tokens: int
    num_cached_tokens: int
    pinned_blocks: int


class _Stream:
    __slots__ = ("done", "loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = config
        self._lock = threading.RLock()
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False  # set by shutdown(): new requests are refused from then on
        self._warm_ids = 0

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
    def weights_format(self) -> str:
        return self.engine.weights_format

    @property
    def kv_info(self) -> dict:
        lay = self.engine.layout
        return {
            "num_blocks": lay.num_blocks,
            "block_size": lay.block_size,
            "bytes_per_token": lay.bytes_per_token,
            "capacity_tokens": lay.capacity_tokens,
            "capacity_bytes": lay.capacity_bytes,
        }

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._closed = False  # a shut-down engine can be started again
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True, timeout: float = 300.0) -> None:
        """Stop the loop; with ``drain`` the requests already admitted finish first. New
        requests are refused from the moment this is called."""
        self._closed = True
        if drain:
            deadline = time.monotonic() + timeout
            while (self._streams or self._inbox) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        for rid in list(self._streams):
            self._fail(rid, RuntimeError("engine shut down"))

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: str | None = None,
        priority: int = 0,
        explain: bool = False,
    ) -> AsyncIterator[StreamDelta]:
        """Validate now (ValueError, QueueFullError, EngineShutDownError), run in the engine
        thread, stream deltas. Requests added before the first ``start()`` wait for it; after
        ``shutdown()`` they are refused until ``start()`` is called again."""
        if self._closed:
            raise EngineShutDownError("the engine is shutting down and takes no new requests")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.num_waiting() >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting()} requests are waiting (limit {self.config.max_waiting_requests})"
            )
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._inbox.append(("add", request_id, list(prompt_token_ids), params, namespace, priority, explain))
        self._wake.set()
        return self._iterate(request_id, stream)

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
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + sum(1 for c in list(self._inbox) if c[0] == "add")

    # ---- engine thread ----------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd[0] == "abort":
                self.engine.abort(cmd[1])
                continue
            _, rid, ids, params, ns, prio, explain = cmd
            if rid not in self._streams:  # aborted before it was added
                continue
            try:
                self.engine.add_request(rid, ids, params, namespace=ns, priority=prio, explain=explain)
            except Exception as e:  # noqa: BLE001 - handed to the request's consumer
                self._fail(rid, e)

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                self._drain_inbox()
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        updated = self.engine.step()
                    except Exception as e:
                        log.exception("engine step failed")
                        for rid in list(self.engine.seqs):
                            self.engine.abort(rid)
                            self._fail(rid, e)
                        updated = []
                    deltas = [self.engine.output.stream_delta(s) for s in updated]
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for d in deltas:
                s = self._streams.get(d.request_id)
                if s is None:
                    continue
                if d.finished:
                    s.done = True
                    self._streams.pop(d.request_id, None)
                try:
                    s.loop.call_soon_threadsafe(s.queue.put_nowait, d)
                except RuntimeError:  # its event loop is closed: nobody reads it, stop it
                    self.abort(d.request_id)

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
    ) -> WarmResult:
        """Prefill a prompt (one token is generated and dropped) and optionally pin its blocks."""
        before = await asyncio.to_thread(self.lookup, prompt_token_ids, namespace)
        if pin:
            pool = self.engine.pool
            need = len(prompt_token_ids) // self.engine.config.block_size
            if pool.counts().pinned + need > pool.max_pinned_blocks:
                raise ValueError(
                    f"pin budget exceeded: {pool.counts().pinned} blocks pinned + {need} > "
                    f"{pool.max_pinned_blocks} allowed"
                )
        self._warm_ids += 1
        rid = f"warm-{self._warm_ids}-{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        async for _ in self.add_request(rid, prompt_token_ids, params, namespace=namespace):
            pass
        pinned = 0
        if pin:
            with self._lock:
                pinned = self.engine.pin_prefix(prompt_token_ids, namespace, ttl_seconds)
        return WarmResult(len(prompt_token_ids), before.num_cached_tokens, pinned)

    def lookup(self, prompt_token_ids: list[int], namespace: str | None = None) -> LookupResult:
        with self._lock:
            return self.engine.lookup(prompt_token_ids, namespace)

    def explain(self, prompt_token_ids: list[int], namespace: str | None = None):
        with self._lock:
            return self.engine.explain(prompt_token_ids, namespace)

    def invalidate(self, namespace: str | None, all_namespaces: bool | None = None) -> int:
        """Drop a namespace's cached blocks; ``namespace=None`` drops all namespaces."""
        with self._lock:
            everything = namespace is None if all_namespaces is None else all_namespaces
            return self.engine.invalidate(namespace, everything)

    def block_hashes(self, prompt_token_ids: list[int], namespace: str | None = None) -> list[bytes]:
        return self.engine.block_hashes(prompt_token_ids, namespace)

    def cache_stats(self) -> dict:
        with self._lock:
            return self.engine.cache_stats()

    def engine_stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()
