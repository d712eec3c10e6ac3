"""The engine side of segment caching: fill a segments request's document spans from the
segment store, recompute the first tokens of each in its new context, go on normally after.

For a sequence with a ``SegmentPlan``, from when it is first scheduled (and again after a
preemption: the assembly is deterministic), ``prepare`` does, in prompt order::

    [ exact prefix ][ doc A          ][ doc B          ][ question ... ]
      computed        k tokens | rest   k tokens | rest   left to the scheduler
      exactly         recomputed|placed recomputed|placed

- the part before the first span (system prompt: prefix-cache hits, or computed exactly);
- each span: its KV computed alone (from the store, or computed now and stored), re-rotated to
  the span's start and written into the sequence's own blocks, except its first k tokens, which
  are recomputed with attention over everything before them (EPIC-style; k from the options);
  with ``selection`` "deviation"/"both" every token is placed and the k recomputed are picked
  by a one-layer probe of their KV deviation (blend.py, CacheBlend-style);
- then ``num_computed_tokens`` points at the end of the last span; the scheduler prefills the
  rest (the question) exactly as for any request.

Invariant: blocks from the first span on are never registered in the prefix index
(``Sequence.max_registered_blocks``), so no other request can hit KV that a cold run would not
compute. The output of a segments request does not depend on whether its segments were in the
store: a miss computes the same KV alone that a hit reads (cold == warm within the mode).
With k >= the span length nothing is placed and the assembly is a chunked cold prefill.

Segments work is prefill work of the requesting tenant, inside the step's token budget. The
scheduler grants a segments sequence tokens as it grants any prefill chunk (within
``max_num_batched_tokens`` and the tenant's share, fairness.py); ``prepare`` spends them on the
sequence's assembly job (``_Job``) and the sequence drops out of the step's forward. The job
resumes where it stopped at the next step that grants it tokens, so a request with many documents
takes many steps and every other request runs between them (the engine lock is released between
steps). Tokens counted: each token of a forward computed alone (the sink included), each token
recomputed or computed exactly, and the probe as 1/layers of its tokens; placing and store hits
are copies and count nothing. Pieces of a job never change its result: a document computed alone
in several forwards, or pieces spread over several forwards, give the same bits on the exact
path (chunked == whole, docs/design.md section 2) and agree elsewhere, as any chunked prefill.
A preemption voids the job (its blocks are freed; the job remembers the preemption count it
began at); readmitted, the sequence starts a new one, finding the documents already kept in the store.

``store_only`` plans (/v1/cache/warm in segments mode) compute and keep each document the store
lacks and end the request: nothing placed, nothing sampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from prefixcache.api.errors import InvalidRequestError, SegmentLimitError
from prefixcache.api.segments import SegmentRequest
from prefixcache.cache.manager import KVCacheManager
from prefixcache.model.runner import ModelRunner, Piece
from prefixcache.segments import record
from prefixcache.segments.blend import blend_pieces
from prefixcache.segments.plan import (
    SINK_TOKENS,
    SegmentPlan,
    SegmentSpan,
    check_spans,
    segment_key,
)
from prefixcache.segments.store import SegmentEntry, SegmentStore
from prefixcache.sequence import ScheduledSeq, Sequence


@dataclass
class SegmentCounters:
    requests: int = 0  # segments requests assembled (first assembly only)
    reused_tokens: int = 0  # placed from a store hit and not recomputed
    recomputed_tokens: int = 0  # recomputed in context (the first k of each span)
    computed_alone_tokens: int = 0  # store misses: computed alone, then stored


class _Job:
    """A segments sequence's work in progress (``SegmentAssembler.jobs``). ``steps`` (a
    generator) does at most ``left`` tokens of work, then yields until the next step grants
    more; it returns when done. A preemption (which frees the blocks it writes) voids it; the
    sequence's end drops it."""

    __slots__ = ("left", "steps")

    def __init__(self):
        self.left = 0
        self.steps: Generator | None = None

    def start(self, work: Callable[..., Generator], *args) -> _Job:
        """``work(*args, self)`` is the job's generator."""
        self.steps = work(*args, self)
        return self

    def run(self, tokens: int) -> tuple[bool, int]:
        """Work for up to ``tokens`` (the step's grant): (whether the job is done, the tokens of
        work it did). A job that ends leaves the rest of its grant unspent; the probe's
        rounding may overrun it by a token or so (counted: it is work done)."""
        self.left = tokens
        try:
            next(self.steps)
        except StopIteration:
            return True, tokens - self.left
        return False, tokens - self.left


def _finish(job: _Job):
    """Run a job without a budget (``compute_alone``); its return value."""
    job.left = math.inf
    try:
        while True:
            next(job.steps)
    except StopIteration as stop:
        return stop.value


class SegmentAssembler:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        store: SegmentStore,
        fingerprint: str,
        max_chunk: int,
        on_computed=None,
        max_segments: int = 64,
        max_record_bytes: int = 64 << 20,
    ):
        self.runner = runner
        self.kv = kv
        self.store = store
        self.fingerprint = fingerprint
        self.kv_dtype = runner.kv.layout.kv_format.name
        self.block_size = kv.block_size
        self.max_chunk = max_chunk  # the most tokens of one forward
        self.max_segments = max_segments
        self.max_record_bytes = max_record_bytes
        self.counters = SegmentCounters()
        # request id -> (its assembly in progress, the preemption count it began at)
        self.jobs: dict[str, tuple[_Job, int]] = {}
        # Called with (key, entry) for every segment computed alone: the persistent tiers'
        # write-through (connector.py); None without tiers.
        self.on_computed = on_computed

    # ---- planning (at arrival) -----------------------------------------------------------------
    def check(self, token_ids: list[int], request: SegmentRequest) -> None:
        """Refuse what a segments request may never run: bad spans (InvalidRequestError), more
        documents than ``max_segments`` or a document whose KV computed alone would make a
        record over ``max_record_bytes`` (SegmentLimitError). Pure: no lock needed."""
        if self.runner.kv.windowed:
            # A document's KV computed alone is reused at another position; a sliding-window
            # layer's K/V is only kept a window back (cache/window.py), so there is none to reuse.
            raise InvalidRequestError(
                "cache_mode 'segments' is not available for models with sliding-window layers "
                f"({self.runner.config.name}); use the default prefix cache", param="cache_mode",
            )  # fmt: skip
        spans = list(request.spans)
        check_spans(spans, len(token_ids))
        if len(spans) > self.max_segments:
            raise SegmentLimitError(
                f"this request has {len(spans)} documents; at most {self.max_segments} per "
                "segments request (max_segments_per_request)", param="messages",
            )  # fmt: skip
        cfg = self.runner.config
        for a, b in spans:
            n = b - a
            if not request.store_only and request.options.recompute_for(n) >= n:
                continue  # recomputed whole: never computed alone, no record
            size = record.payload_bytes(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            if size > self.max_record_bytes:
                raise SegmentLimitError(
                    f"a document of {n} tokens would make a segment record of {size} bytes; at "
                    f"most {self.max_record_bytes} (max_segment_record)", param="messages",
                )  # fmt: skip

    def plan(
        self, token_ids: list[int], request: SegmentRequest, namespace: str | None
    ) -> SegmentPlan:
        self.check(token_ids, request)
        spans = list(request.spans)
        sink = self.sink_of(token_ids, spans)
        return SegmentPlan(
            tuple(
                SegmentSpan(a, b, self.key(token_ids[a:b], namespace, sink)) for a, b in spans
            ),
            request.options,
            sink,
            request.store_only,
        )

    @staticmethod
    def sink_of(token_ids: list[int], spans) -> tuple[int, ...]:
        """The tokens segments are computed after: the prompt's first SINK_TOKENS (none when a
        span starts earlier)."""
        n = min(SINK_TOKENS, spans[0][0]) if spans else 0
        return tuple(token_ids[:n])

    def key(self, token_ids: list[int], namespace: str | None, sink=()) -> bytes:
        return segment_key(self.fingerprint, self.kv_dtype, namespace, token_ids, sink)

    def register_limit(self, plan: SegmentPlan) -> int:
        """Full blocks of a sequence that may enter the prefix index: those wholly before the
        first span (exact KV); every later block may hold placed segment KV. A store-only
        sequence computes nothing into the pool: none."""
        return 0 if plan.store_only else plan.first_start() // self.block_size

    def num_stored(self, token_ids: list[int], spans, namespace: str | None) -> int:
        """How many of these spans the store holds now (a warm's "already cached")."""
        sink = self.sink_of(token_ids, spans)
        return sum(self.store.contains(self.key(token_ids[a:b], namespace, sink)) for a, b in spans)

    # ---- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(
        self, scheduled: list[ScheduledSeq], plans: dict[str, SegmentPlan]
    ) -> tuple[list[ScheduledSeq], list[Sequence], int]:
        """Spend the tokens granted to segments sequences that are at their spans on their jobs;
        those drop out of this step's batch (the step after a job ends computes what follows
        the last span). ``plans``: request id -> plan. Returns (the batch left, the store-only
        sequences now done, the tokens of work the jobs did: what the step's pace counts, so a
        job ending early in its grant does not make the step look faster than it was)."""
        out, stored, worked = [], [], 0
        for s in scheduled:
            seq = s.seq
            plan = plans.get(seq.request_id)
            if plan is None or not plan.spans or (
                not plan.store_only and seq.kv.num_computed_tokens >= plan.end
            ):
                out.append(s)
                continue
            job = self._job_of(seq)
            if job is None:
                if not plan.store_only and not self.kv.allocate_slots(
                    seq, plan.end - seq.kv.num_computed_tokens
                ):
                    # No room: not expected, the scheduler allocated up to plan.end when it
                    # scheduled the sequence (Sequence.reserve_until, set by the connector).
                    # This chunk then runs exactly, which a cold run would not do.
                    out.append(s)
                    continue
                work = self._store_only if plan.store_only else self._assemble
                job = _Job().start(work, seq, plan)
                self.jobs[seq.request_id] = (job, seq.num_preemptions)
            done, spent = job.run(s.num_new_tokens)
            worked += spent
            if done:
                del self.jobs[seq.request_id]
                if plan.store_only:
                    stored.append(seq)
        return out, stored, worked

    def _job_of(self, seq: Sequence) -> _Job | None:
        """The sequence's assembly in progress; one begun before a preemption is void (it
        lived in the blocks the preemption freed)."""
        entry = self.jobs.get(seq.request_id)
        if entry is None:
            return None
        if entry[1] != seq.num_preemptions:
            del self.jobs[seq.request_id]
            return None
        return entry[0]

    def drop(self, seq: Sequence) -> None:
        """The sequence left (finished, aborted): its assembly in progress goes with it."""
        self.jobs.pop(seq.request_id, None)

    def _take(self, job: _Job, want: int):
        """Up to ``want`` tokens for one forward (at most ``max_chunk``), from this step's grant;
        waits for the next step while it is spent."""
        while job.left <= 0:
            yield
        n = min(want, job.left, self.max_chunk)
        job.left -= n
        return n

    def _store_only(self, seq: Sequence, plan: SegmentPlan, job: _Job):
        """Compute and keep every span the store lacks (a warm)."""
        for sp in plan.spans:
            ids = seq.prompt_token_ids[sp.start : sp.end]
            if self.store.get(sp.key, ids, seq.namespace, plan.sink) is None:
                yield from self._compute_and_keep(sp.key, ids, seq.namespace, plan.sink, job)

    def _assemble(self, seq: Sequence, plan: SegmentPlan, job: _Job):
        c = seq.kv.num_computed_tokens
        reused = recomputed = 0
        pieces: list[tuple[int, int]] = []  # token ranges to compute, in prompt order
        probed: list[tuple[int, SegmentSpan]] = []  # (piece index, span): selected by deviation
        for sp in plan.spans:
            if sp.end <= c:  # already computed (exact prefix hits reached past it)
                continue
            if sp.start < c:  # partly computed: finish it exactly
                pieces.append((c, sp.end))
                c = sp.end
                continue
            if c < sp.start:
                pieces.append((c, sp.start))  # exact: the prefix, or text between spans
            k = plan.options.recompute_for(sp.length)
            if k < sp.length:
                ids = seq.prompt_token_ids[sp.start : sp.end]
                entry = self.store.get(sp.key, ids, seq.namespace, plan.sink)
                if entry is None:
                    entry = yield from self._compute_and_keep(
                        sp.key, ids, seq.namespace, plan.sink, job
                    )
                else:
                    reused += sp.length - k
                probe = bool(k) and plan.options.probes
                # probed: every token placed (the probe picks which k to recompute); else the
                # first k are recomputed and need no placing
                self._place(seq, sp.start, 0 if probe else k, entry)
                if probe:
                    probed.append((len(pieces), sp))
            if k:
                pieces.append((sp.start, sp.start + k))
                recomputed += k
            c = sp.end
        if probed:  # one layer over the probed tokens, run whole: 1/layers of their tokens
            while job.left <= 0:
                yield
            n = max(sp.end for _, sp in probed) - seq.kv.num_computed_tokens
            job.left -= -(-n // self.runner.config.num_layers)
        pieces = blend_pieces(self.runner, seq, plan.options, pieces, probed, self.max_chunk)
        # after every placement: recomputed tokens attend to them
        yield from self._compute_in_steps(seq, pieces, job)
        self.kv.mark_computed(seq, c)
        if seq.cache.num_segment_cached_tokens is None:  # first assembly: what the user sees
            seq.cache.num_segment_cached_tokens = reused
            self.counters.requests += 1
            self.counters.reused_tokens += reused
            self.counters.recomputed_tokens += recomputed

    def _compute_in_steps(self, seq: Sequence, pieces: list[tuple[int, int]], job: _Job):
        """``_compute`` of ``pieces`` in forwards as large as the grant allows, over as many
        steps as it takes. A piece split between forwards, or one computed a step after an
        earlier one, sees what it would see in one forward (``_compute``'s reason)."""
        todo = list(reversed(pieces))
        while todo:
            size = yield from self._take(job, sum(b - a for a, b in todo))
            batch = []
            while size:
                a, b = todo.pop()
                n = min(b - a, size)
                batch.append((a, a + n))
                size -= n
                if a + n < b:
                    todo.append((a + n, b))
            self._compute(seq, batch)

    def _compute(self, seq: Sequence, pieces: list[tuple[int, int]]) -> None:
        """Compute the prompt tokens of ``pieces`` (ordered, disjoint ranges) into ``seq``'s
        blocks, each token attending over every slot before it, in as few forwards as
        ``max_chunk`` allows: one ``runner.run`` per batch of pieces over the same block table
        (a piece attends over an earlier piece of the same forward as if it had been computed
        before: runner.py). One forward instead of one per document: at small k a forward
        costs a pass over the weights, whatever its size. Nothing is sampled (every piece ends
        before the last prompt token)."""
        assert all(b < seq.num_tokens for _, b in pieces), "a piece would need logits"
        tokens, table = seq.all_token_ids, seq.kv.block_table
        batch, size = [], 0
        for a, b in pieces:
            while a < b:
                n = min(b - a, self.max_chunk - size)
                batch.append(Piece(tokens, table, a, n))
                size += n
                a += n
                if size == self.max_chunk:
                    self.runner.run(batch)
                    batch, size = [], 0
        if batch:
            self.runner.run(batch)

    def _place(self, seq: Sequence, start: int, skip: int, entry: SegmentEntry) -> None:
        """Write ``entry``'s tokens [skip, n) at positions start+skip.. of ``seq``: K re-rotated
        by ``start``, both quantized into the pool's KV format (``runner.write_kv``)."""
        n = len(entry.token_ids)
        self.runner.write_kv(seq.kv.block_table, start + skip, entry.k[:, :, skip:n],
                             entry.v[:, :, skip:n], shift=start - entry.position)  # fmt: skip

    @torch.inference_mode()
    def compute_alone(
        self, token_ids: list[int], namespace: str | None, sink: tuple[int, ...] = ()
    ) -> SegmentEntry:
        """KV of ``token_ids`` computed after ``sink`` alone, at positions m..m+n-1 (m =
        len(sink)), in a private cache of the pool's KV format (the engine's pool is not
        touched); read back as the float32 values attention would see."""
        return _finish(_Job().start(self._alone, token_ids, namespace, sink))

    def _alone(self, token_ids, namespace: str | None, sink, job: _Job):
        """``compute_alone`` as a job: forwards as large as the grant allows."""
        seg, token_ids = list(token_ids), list(sink) + list(token_ids)
        m, n = len(sink), len(token_ids)
        private = self.runner.private_kv(n)
        a = 0
        while a < n:
            c = yield from self._take(job, n - a)
            self.runner.run([Piece(token_ids, private.block_table, a, c)], private)
            a += c
        k, v = self.runner.read_kv(private, m, n)  # the segment's own tokens
        return SegmentEntry(namespace, tuple(seg), k, v, tuple(sink), m)

    def stats(self) -> dict:
        """``cache_stats()["segments"]``."""
        st, c = self.store.stats(), self.counters
        return {
            "entries": st.entries, "used_bytes": st.used_bytes,
            "capacity_bytes": st.capacity_bytes, "hits": st.hits, "misses": st.misses,
            "evicted": st.evicted, "requests": c.requests, "reused_tokens": c.reused_tokens,
            "recomputed_tokens": c.recomputed_tokens,
            "computed_alone_tokens": c.computed_alone_tokens,
        }  # fmt: skip

    def _compute_and_keep(self, key: bytes, token_ids, namespace, sink, job: _Job):
        """A store miss: compute the segment alone, keep it, write it through to the tiers."""
        entry = yield from self._alone(token_ids, namespace, sink, job)
        self.store.put(key, entry)
        self.counters.computed_alone_tokens += len(token_ids)
        if self.on_computed is not None:
            self.on_computed(key, entry)
        return entry
