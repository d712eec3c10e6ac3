"""A :class:`Run`: the engine requests ("choices") of one API request and their merged stream.

One API request becomes ``len(prompts) * n`` engine requests, started together and read through
one merged stream. Whoever starts a run must ``close()`` it, which aborts every choice still
running (client gone, error, cancellation), so no request outlives its HTTP connection and its
blocks return to the pool.

The merged stream is bounded (``_MERGE_QUEUE``): a reader that stops reading stops the pumps,
so unread deltas pile up in the engine's per-request queues, where ``max_pending_deltas``
cancels the request, instead of piling up here without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.api.engine import EngineAPI
from prefixcache.api.request import CacheReport, SharedPrefix, StreamDelta
from prefixcache.server.base.auth import Tenant
from prefixcache.server.edge.errors import from_engine_error, internal_error, request_id_of
from prefixcache.server.observability.activity import Activity
from prefixcache.server.observability.cache_keys import PromptCacheKeyStats
from prefixcache.server.observability.metrics import ServerMetrics
from prefixcache.server.observability.request_log import LogRecord


class RunHost(Protocol):
    """What a run needs of the server's state (``serving.Serving`` is one): the engine, where
    outcomes are counted and logged, and how much of a shared prefix is shared."""

    engine: EngineAPI
    metrics: ServerMetrics
    activity: Activity
    cache_keys: PromptCacheKeyStats
    request_log: object | None  # analyze.request_log.RequestLogWriter: its ``submit``

    def shared_tokens(self, shared: SharedPrefix | None) -> int: ...

_MERGE_QUEUE = 64
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client still waits


@dataclass
class Choice:
    """One engine request: choice ``index`` of the API response."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    stream: AsyncIterator[StreamDelta] | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # The engine's report of its cache use, as the latest delta carried it (api.request).
    cache: CacheReport = field(default_factory=lambda: CacheReport().snapshot())
    started: bool = False  # has seen its first delta

    def apply(self, d: StreamDelta) -> None:
        self.text.append(d.text_delta)
        self.token_ids.extend(d.new_token_ids)
        if d.new_logprobs:
            self.logprobs.extend(d.new_logprobs)
        self.num_prompt_tokens = d.num_prompt_tokens
        self.num_output_tokens = d.num_output_tokens
        self.cache = d.cache
        if d.finished:
            self.finished = True
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


class Run:
    """The choices of one API request and their merged stream."""

    def __init__(
        self, serving: RunHost, run_id: str, tenant: Tenant, namespace: str, n: int = 1
    ) -> None:
        self.serving = serving
        self.n = n
        self.id = run_id
        self.tenant = tenant
        self.namespace = namespace
        self.segments = False  # cache_mode "segments": usage reports segment_cached_tokens
        self.shared_prefix = None  # the request.SharedPrefix its prompts declare, if any
        self.prompt_cache_key: str | None = None  # OpenAI's field: its per-key stats group
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self._tasks: list[asyncio.Task] = []

    async def deltas(self) -> AsyncIterator[tuple[Choice, StreamDelta]]:
        """Every delta of every choice, as they come; each choice's deltas stay in order."""
        if len(self.choices) == 1:
            c = self.choices[0]
            async for d in c.stream:
                self._on_delta(c, d)
                yield c, d
            return
        queue: asyncio.Queue = asyncio.Queue(_MERGE_QUEUE)

        async def pump(c: Choice) -> None:
            try:
                async for d in c.stream:
                    await queue.put((c, d))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((c, e))
            finally:
                await queue.put((c, None))

        self._tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        live = len(self.choices)
        while live:
            c, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                self._on_delta(c, item)
                yield c, item

    async def collect(self) -> None:
        async for _ in self.deltas():
            pass

    async def collect_while_connected(self, request) -> bool:
        """``collect`` for a non-streamed answer, checking every ``DISCONNECT_POLL_S`` that the
        client still waits: False (the collection cancelled; the caller's ``close`` aborts the
        run) when it left first. A request the engine refused or failed raises its typed
        error's status (``from_engine_error``), anything else a logged 500."""
        task = asyncio.ensure_future(self.collect())
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                return False
        try:
            task.result()
        except Exception as e:  # noqa: BLE001 - mapped by type; the rest is a logged 500
            rid = request_id_of(request.scope)
            raise (from_engine_error(e, rid) or internal_error(rid, e)) from None
        return True

    def _on_delta(self, c: Choice, d: StreamDelta) -> None:
        first = not c.started
        c.started = True
        c.apply(d)
        s = self.serving
        if first and self.prompt_cache_key is not None and c.index == c.prompt_index * self.n:
            s.cache_keys.record(self.tenant.name, self.prompt_cache_key,
                                d.num_prompt_tokens, d.num_cached_tokens)  # fmt: skip
        if first and s.request_log is not None and c.index == c.prompt_index * self.n:
            # Once per prompt, not once per choice; written by the log's own thread.
            s.request_log.submit(
                LogRecord(
                    d.metrics.arrival_time, self.tenant.name, self.namespace,
                    c.prompt_token_ids, c.cache.num_cached_tokens, self.shared_prefix,
                )
            )  # fmt: skip
        if d.finished:
            s.metrics.observe_finished(d)
            s.activity.record(
                self.tenant.name, self.namespace, c.prompt_token_ids, c.cache.num_cached_tokens,
                d.metrics.ttft, c.cache.cache_info and c.cache.cache_info.reason, time.time(),
            )  # fmt: skip

    def close(self) -> None:
        """Abort every unfinished choice (idempotent); frees their blocks in the engine."""
        for t in self._tasks:
            t.cancel()
        for c in self.choices:
            if not c.finished:
                c.finished = True
                c.finish_reason = c.finish_reason or "abort"
                self.serving.engine.abort(c.request_id)

    # -- results ------------------------------------------------------------------------------

    def usage(self) -> dict:
        by_prompt: dict[int, list[Choice]] = {}
        for c in self.choices:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        prompt_tokens = sum(
            cs[0].num_prompt_tokens or len(cs[0].prompt_token_ids) for cs in by_prompt.values()
        )
        # Tokens of a prompt no choice had to compute: the least any of its choices reused.
        cached = sum(min(c.cache.num_cached_tokens for c in cs) for cs in by_prompt.values())
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        details = {"cached_tokens": cached}
        if self.segments:  # only for requests that asked for cache_mode "segments"
            details["segment_cached_tokens"] = sum(
                min(c.cache.num_segment_cached_tokens for c in cs) for cs in by_prompt.values()
            )
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": details,
        }

    def cache_info(self, c: Choice) -> dict | None:
        info = c.cache.cache_info
        if info is None:
            return None
        # "other_namespace" is only ever computed for admins (explain_across_namespaces), so
        # nobody else can hear that another tenant sent this prompt, nor time the search.
        return {
            "cached_tokens": info.cached_tokens,
            "first_uncached_position": info.first_uncached_position,
            "reason": info.reason,
            "diverged_at": info.diverged_at,
            "namespace": self.namespace,
            **self._shared(),
            **self._tiers(c),
        }

    def _shared(self) -> dict:
        """With a shared prefix: where it is cached and its tokens that are (whole blocks)."""
        sp = self.shared_prefix
        if sp is None:
            return {}
        return {"shared_namespace": sp.namespace, "shared_tokens": self.serving.shared_tokens(sp)}

    @staticmethod
    def _tiers(c: Choice) -> dict:
        """Where the cached tokens came from: the RAM pool, or restored from disk / Redis
        (only on a server with tiers)."""
        if c.cache.tier_tokens is None:
            return {}
        restored = {k: min(v, c.cache.num_cached_tokens) for k, v in c.cache.tier_tokens.items()}
        ram = max(0, c.cache.num_cached_tokens - sum(restored.values()))
        return {"cached_tokens_by_tier": {"ram": ram, **restored}}
