"""The engine side of segment caching: fill a segments request's document spans from the
segment store, recompute the first tokens of each in its new context, go on normally after.

For a sequence with a ``SegmentPlan``, from when it is first scheduled (and again after a
preemption: the assembly is deterministic), its assembly (``_Job``) does, in prompt order::

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

Segments work is a prefill plan run in the step's one forward. The scheduler grants a segments
sequence tokens as it grants any prefill chunk (within ``max_num_batched_tokens`` and the
tenant's share, fairness.py); ``prefill`` spends them on pieces (``sequence.Piece``) of its
job's current phase, which run in the step's forward beside every other sequence's chunk in
place of the sequence's own:

1. alone: each document the store lacks, after the sink, at positions 0.. of temporary pool
   blocks (``SeqKV.scratch``, held with the sequence's reserved slots from its admission, so
   they are paid for like any slot and a preemption frees them); after the forward that
   computed its last token it is read back, kept in the store and written through, and the
   scratch goes back once every one is kept;
2. then every document is placed (a copy, between forwards); with deviation selection a probe
   piece over the documents (layer 0, then layer 1's K/V: model/llama.py ``ProbeRows``) gives
   the deviations, and the selection is made after its forward (blend.py);
3. compute: the exact pieces and the recomputed tokens, in prompt order.

A phase that waits for a forward ends the sequence's share of that step early (the rest of its
grant is not spent), so an assembly takes at least one step per phase it has, and every other
request runs between its steps (the engine lock is released between steps). Tokens counted:
each token of a piece (the sink included when computed alone), and a probe as 1/layers of its
tokens; placing and store hits are copies and count nothing. Pieces of a job never change its
result: a document computed alone in several forwards, or pieces spread over several forwards
or beside other sequences, give the same bits on the exact path (chunked == whole, alone ==
batched, docs/design.md section 2) and agree elsewhere, as any chunked prefill. A preemption
voids the job (its blocks are freed; the job remembers the preemption count it began at);
readmitted, the sequence starts a new one, finding the documents already kept in the store.

``store_only`` plans (/v1/cache/warm in segments mode) compute and keep each document the store
lacks and end the request: nothing placed, nothing sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.api.errors import ContextLengthError, InvalidRequestError, SegmentLimitError
from prefixcache.api.segments import SegmentRequest
from prefixcache.cache.connector import Prefill
from prefixcache.cache.manager import KVCacheManager
from prefixcache.model.runner import ModelRunner
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
from prefixcache.sequence import Piece, ScheduledSeq, Sequence


@dataclass
class SegmentCounters:
    requests: int = 0  # segments requests assembled (first assembly only)
    reused_tokens: int = 0  # placed from a store hit and not recomputed
    recomputed_tokens: int = 0  # recomputed in context (the first k of each span)
    computed_alone_tokens: int = 0  # store misses: computed alone, then stored


ALONE, PROBE, COMPUTE, DONE = "alone", "probe", "compute", "done"


@dataclass(eq=False)
class _Alone:
    """A document computed alone: ``token_ids`` (the sink, then the document's) at positions
    0.. in ``table``, its share of the sequence's scratch blocks; ``done`` of them so far."""

    key: bytes
    token_ids: list[int]
    sink: int  # len(sink): the document's own tokens start there
    table: list[int]
    done: int = 0


class _Job:
    """A segments sequence's assembly in progress (``SegmentAssembler.jobs``): what is left of
    each phase, and the pieces it put in the step's forward (``inflight``), which advance it
    once the forward ran (``SegmentAssembler.after_forward``)."""

    def __init__(self, seq: Sequence, plan: SegmentPlan):
        self.seq, self.plan = seq, plan
        self.preemptions = seq.num_preemptions  # a preemption voids the job
        self.phase = ALONE
        self.todo: list[tuple[bytes, list[int]]] = []  # (key, document ids) to compute alone
        self.active: list[_Alone] = []  # being computed alone, each in its scratch blocks
        self.entries: dict[bytes, SegmentEntry] = {}
        self.places: list[tuple[int, int, bytes]] = []  # (start, tokens skipped, key) to place
        self.pieces: list[tuple[int, int]] = []  # prompt ranges to compute, in prompt order
        self.probed: list[tuple[int, SegmentSpan]] = []  # (piece index, span) by deviation
        self.probe_from = self.probe_at = self.probe_end = 0
        self.deviation: list[torch.Tensor] = []
        self.end = 0  # the prompt position the assembly computes up to
        self.reused = self.recomputed = 0
        self.inflight: list[tuple[Piece, object]] = []  # (piece, what it advances)


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
        self.jobs: dict[str, _Job] = {}  # request id -> its assembly in progress
        self._finished: list[Sequence] = []  # warms done, until after_forward reports them
        # Called with (key, entry) for every segment computed alone: the persistent tiers'
        # write-through (connector.py); None without tiers.
        self.on_computed = on_computed

    # ---- planning (at arrival) -----------------------------------------------------------------
    def check(self, token_ids: list[int], request: SegmentRequest) -> None:
        """Refuse what a segments request may never run: bad spans (InvalidRequestError), more
        documents than ``max_segments`` or a document whose KV computed alone would make a
        record over ``max_record_bytes`` (SegmentLimitError), more KV blocks while it assembles
        than the pool can ever give it (ContextLengthError: it would wait at the head of the
        queue for ever). Pure: no lock needed."""
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
        # What it may hold at once while it assembles: its slots, at most the prompt's (a warm:
        # one step's chunk), and the scratch its documents are computed alone in.
        plan = SegmentPlan(tuple(SegmentSpan(a, b, b"") for a, b in spans), request.options,
                           self.sink_of(token_ids, spans), request.store_only)  # fmt: skip
        own = min(len(token_ids), self.max_chunk) if request.store_only else len(token_ids)
        bs = self.block_size
        need = -(-own // bs) + -(-self.scratch_tokens(plan) // bs)
        if need > self.kv.usable_blocks:
            raise ContextLengthError(
                f"this segments request needs {need} KV blocks while it assembles (its documents, "
                f"and room to compute them alone) but the cache holds "
                f"{self.kv.usable_blocks} unpinnable blocks; raise kv_cache_memory",
                param="messages",
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
    def prefill(self, s: ScheduledSeq, plan: SegmentPlan | None) -> Prefill | None:
        """What a segments sequence at its spans makes of its grant this step: the pieces of
        its assembly's current phase (``Prefill``); None for any other sequence."""
        seq = s.seq
        if plan is None or not plan.spans:
            return None
        if not plan.store_only and seq.kv.num_computed_tokens >= plan.end:
            if seq.kv.scratch:  # (hits reached past its documents: nothing to compute alone)
                self.kv.release_scratch(seq)
            return None
        job = self._job_of(seq)
        if job is None:
            # The scheduler allocated up to plan.end (and the scratch) when it scheduled the
            # sequence (SeqKV.reserve_until, scratch_tokens, set by the connector at arrival).
            room = plan.store_only or self.kv.allocate_slots(seq, plan.end - seq.kv.num_computed_tokens)
            if not room:
                raise AssertionError("a segments sequence scheduled without its reserved slots")
            job = self._start(seq, plan)
            self.jobs[seq.request_id] = job
        return self._plan_step(job, min(s.num_new_tokens, self.max_chunk))

    def wants(self, seq: Sequence) -> int | None:
        """The tokens the sequence's assembly can spend next step (``KVConnector.wants``): what
        its documents computed alone have left, its probe, or its pieces in context. None
        before its job starts and where the next step plans anew (the scratch filled again)."""
        job = self._job_of(seq)
        if job is None:
            return None
        if job.phase == ALONE:
            if not job.active:
                return None
            return sum(len(a.token_ids) - a.done for a in job.active)
        if job.phase == PROBE:
            return self._probe_step(job, self.max_chunk)[1]
        if job.phase == COMPUTE:
            return max(1, sum(b - a for a, b in job.pieces))
        return None

    def _job_of(self, seq: Sequence) -> _Job | None:
        """The sequence's assembly in progress; one begun before a preemption is void (it
        lived in the blocks the preemption freed)."""
        job = self.jobs.get(seq.request_id)
        if job is not None and job.preemptions != seq.num_preemptions:
            del self.jobs[seq.request_id]
            return None
        return job

    def drop(self, seq: Sequence) -> None:
        """The sequence left (finished, aborted): its assembly in progress goes with it."""
        self.jobs.pop(seq.request_id, None)

    def _start(self, seq: Sequence, plan: SegmentPlan) -> _Job:
        """The job's phases, from the store as it is now: the documents it lacks (computed
        alone, then kept), where each document is placed, and what is computed in context."""
        job = _Job(seq, plan)
        missing: set[bytes] = set()

        def need(sp: SegmentSpan) -> None:  # the entry of ``sp``: from the store, or computed
            ids = seq.prompt_token_ids[sp.start : sp.end]
            if sp.key in job.entries or sp.key in missing:
                return
            entry = self.store.get(sp.key, ids, seq.namespace, plan.sink)
            if entry is None:
                missing.add(sp.key)
                job.todo.append((sp.key, ids))
            else:
                job.entries[sp.key] = entry

        if plan.store_only:  # compute and keep every span the store lacks
            for sp in plan.spans:
                need(sp)
            return job
        c = seq.kv.num_computed_tokens
        for sp in plan.spans:
            if sp.end <= c:  # already computed (exact prefix hits reached past it)
                continue
            if sp.start < c:  # partly computed: finish it exactly
                job.pieces.append((c, sp.end))
                c = sp.end
                continue
            if c < sp.start:
                job.pieces.append((c, sp.start))  # exact: the prefix, or text between spans
            k = plan.options.recompute_for(sp.length)
            if k < sp.length:
                again = sp.key in job.entries or sp.key in missing  # (the same document twice)
                need(sp)
                if again or sp.key in job.entries:  # a store hit, or this job's own
                    job.reused += sp.length - k
                probe = bool(k) and plan.options.probes and self.runner.config.num_layers >= 2
                # probed: every token placed (the probe picks which k to recompute); else the
                # first k are recomputed and need no placing
                job.places.append((sp.start, 0 if probe else k, sp.key))
                if probe:
                    job.probed.append((len(job.pieces), sp))
            if k:
                job.pieces.append((sp.start, sp.start + k))
                job.recomputed += k
            c = sp.end
        job.end = c
        return job

    def _plan_step(self, job: _Job, grant: int) -> Prefill:
        """The pieces of the job's current phase for this step's forward, within ``grant``;
        phases that need no forward (placing, finishing) happen here."""
        seq = job.seq
        job.inflight = []
        if job.phase == ALONE:
            if not job.active and job.todo:
                self._assign_scratch(job)
            if job.active:
                return self._alone_pieces(job, grant)
            self._after_alone(job)
            if job.phase == DONE:  # a warm with nothing to compute
                self._finished.append(seq)
                return Prefill([], 0)
        if job.phase == PROBE:
            n, tokens = self._probe_step(job, grant)
            piece = Piece(seq.all_token_ids, seq.kv.block_table, job.probe_at, n, probe=True)
            job.inflight = [(piece, PROBE)]
            return Prefill([piece], tokens)
        if job.phase == COMPUTE:
            if not job.pieces:
                self._finish(job)
                return Prefill([], 0)
            tokens, table = seq.all_token_ids, seq.kv.block_table
            out, left = [], grant
            while job.pieces and left:
                a, b = job.pieces[0]
                n = min(b - a, left)
                out.append(Piece(tokens, table, a, n))
                job.inflight.append((out[-1], COMPUTE))
                left -= n
                if a + n < b:
                    job.pieces[0] = (a + n, b)
                else:
                    job.pieces.pop(0)
            return Prefill(out, grant - left)
        raise AssertionError(f"a segments job planned in phase {job.phase}")

    def _probe_step(self, job: _Job, grant: int) -> tuple[int, int]:
        """(positions, tokens counted) of the job's next probe piece within ``grant``: the probe
        runs layer 0 (and layer 1's projections) only, so it counts 1/layers of its positions."""
        layers = self.runner.config.num_layers
        n = min(job.probe_end - job.probe_at, grant * layers, self.max_chunk)
        return n, -(-n // layers)

    def _alone_blocks(self, sink: int, n: int) -> int:
        """Scratch blocks a document of ``n`` tokens computed alone after a sink of ``sink``
        takes (from a block boundary)."""
        return -(-(sink + n) // self.block_size)

    def _assign_scratch(self, job: _Job) -> None:
        """The next documents to compute alone, as many as the sequence's scratch blocks hold
        side by side (each at least fits alone: ``scratch_tokens``)."""
        scratch, sink = job.seq.kv.scratch, list(job.plan.sink)
        used = 0
        while job.todo:
            key, ids = job.todo[0]
            need = self._alone_blocks(len(sink), len(ids))
            if used + need > len(scratch):
                break
            job.todo.pop(0)
            job.active.append(_Alone(key, sink + list(ids), len(sink), scratch[used : used + need]))
            used += need
        assert job.active, "a document larger than its sequence's scratch blocks"

    def _alone_pieces(self, job: _Job, grant: int) -> Prefill:
        out, left = [], grant
        for a in job.active:
            n = min(len(a.token_ids) - a.done, left)
            if n <= 0:
                continue
            out.append(Piece(a.token_ids, a.table, a.done, n))
            job.inflight.append((out[-1], a))
            left -= n
            if not left:
                break
        return Prefill(out, grant - left)

    def _after_alone(self, job: _Job) -> None:
        """Every document the store lacked is computed and kept: the scratch blocks go back;
        a warm is done; an assembly places every document and goes on to the probe or the
        recompute (after every placement: recomputed tokens attend to them)."""
        seq = job.seq
        self.kv.release_scratch(seq)
        if job.plan.store_only:
            job.phase = DONE
            return
        for start, skip, key in job.places:
            self._place(seq, start, skip, job.entries[key])
        if job.probed:
            job.phase = PROBE
            job.probe_from = job.probe_at = seq.kv.num_computed_tokens
            job.probe_end = max(sp.end for _, sp in job.probed)
        else:
            job.phase = COMPUTE

    def after_forward(self, output) -> list[Sequence]:
        """Advance every job by what its pieces of the forward computed; returns the warms
        now done."""
        for job in list(self.jobs.values()):
            if not job.inflight:
                continue
            for piece, what in job.inflight:
                if what == PROBE:
                    job.deviation.append(output.deviation(piece))
                    job.probe_at += piece.n
                elif isinstance(what, _Alone):
                    what.done += piece.n
            job.inflight = []
            if job.phase == ALONE:
                for a in [a for a in job.active if a.done == len(a.token_ids)]:
                    self._keep(job, a)
                    job.active.remove(a)
                if not job.active and not job.todo:
                    self._after_alone(job)
                    if job.phase == DONE:
                        self._finished.append(job.seq)
            elif job.phase == PROBE and job.probe_at == job.probe_end:
                deviation = torch.cat(job.deviation)
                job.pieces = blend_pieces(job.plan.options, job.pieces, job.probed, deviation, job.probe_from)
                job.phase = COMPUTE
            elif job.phase == COMPUTE and not job.pieces:
                self._finish(job)
        done, self._finished = self._finished, []
        for seq in done:
            self.jobs.pop(seq.request_id, None)
        return done

    def _keep(self, job: _Job, a: _Alone) -> None:
        """A document computed alone: its K/V (its own tokens, after the sink) read back as
        the float32 values attention would see, kept in the store, written through."""
        k, v = self.runner.read_kv(a.table, a.sink, len(a.token_ids))
        ns, sink = job.seq.namespace, tuple(a.token_ids[: a.sink])
        entry = SegmentEntry(ns, tuple(a.token_ids[a.sink :]), k, v, sink, a.sink)
        job.entries[a.key] = entry
        self.store.put(a.key, entry)
        self.counters.computed_alone_tokens += len(a.token_ids) - a.sink
        if self.on_computed is not None:
            self.on_computed(a.key, entry)

    def _finish(self, job: _Job) -> None:
        """The assembly computed up to the end of its last span: the scheduler prefills the
        rest of the prompt (the question) as for any request."""
        seq = job.seq
        self.kv.mark_computed(seq, job.end)
        job.phase = DONE
        del self.jobs[seq.request_id]
        if seq.cache.num_segment_cached_tokens is None:  # first assembly: what the user sees
            seq.cache.num_segment_cached_tokens = job.reused
            self.counters.requests += 1
            self.counters.reused_tokens += job.reused
            self.counters.recomputed_tokens += job.recomputed

    def _place(self, seq: Sequence, start: int, skip: int, entry: SegmentEntry) -> None:
        """Write ``entry``'s tokens [skip, n) at positions start+skip.. of ``seq``: K re-rotated
        by ``start``, both quantized into the pool's KV format (``runner.write_kv``)."""
        n = len(entry.token_ids)
        self.runner.write_kv(seq.kv.block_table, start + skip, entry.k[:, :, skip:n],
                             entry.v[:, :, skip:n], shift=start - entry.position)  # fmt: skip

    def scratch_tokens(self, plan: SegmentPlan) -> int:
        """The scratch a sequence of this plan holds while it assembles: room for its documents
        that may be computed alone (each after the sink, from a block boundary) side by side,
        as many as one forward computes (``max_chunk``), and at least for the largest. Packed,
        every miss of a request is computed in one forward when the step's grant allows:
        measured in docs/benchmarks-journal.md ("Segments as a prefill plan")."""
        bs = self.block_size
        sizes = [
            self._alone_blocks(len(plan.sink), sp.length) * bs for sp in plan.spans
            if plan.store_only or plan.options.recompute_for(sp.length) < sp.length
        ]  # fmt: skip
        if not sizes:
            return 0
        return max(max(sizes), min(sum(sizes), -(-self.max_chunk // bs) * bs))

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
