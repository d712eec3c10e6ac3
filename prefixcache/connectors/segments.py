"""Segment caching as a KV connector (cache/connector.py): plans a segments request at arrival,
spends its granted tokens on the assembly's pieces (assembler.py) in the step's one forward, and, when
persistent tiers are configured, looks up the documents the segment store lacks there at arrival
and writes each segment computed alone through (tier records of kind "segments",
segments/record.py).

Its state, keyed by request id: the plan, the assembly in progress (with the preemption count
it started at: a preemption frees the blocks it was writing, so the job is void), and the
restore out for the request's documents.
"""

from __future__ import annotations

from collections import Counter

from prefixcache.cache.connector import KVConnector, Prefill
from prefixcache.cache.shares import owner_of
from prefixcache.segments import record
from prefixcache.segments.assembler import SegmentAssembler
from prefixcache.segments.plan import SegmentPlan
from prefixcache.segments.store import SegmentEntry
from prefixcache.sequence import ScheduledSeq, Sequence
from prefixcache.tiers.jobs import RestoreJob, take_mine
from prefixcache.tiers.records import SEGMENTS, SegmentRef


class SegmentConnector(KVConnector):
    name = "segments"

    def __init__(self, assembler: SegmentAssembler, storage=None):
        """``storage``: the TierManager of the persistent tiers (None: none)."""
        self.assembler = assembler
        self.store = assembler.store
        self.storage = storage
        self.device = assembler.runner.device  # where restored segments go
        self._plans: dict[str, SegmentPlan] = {}
        self._restores: dict[str, tuple[Sequence, RestoreJob]] = {}
        if storage is not None:
            assembler.on_computed = self._offload

    def plan_of(self, seq: Sequence) -> SegmentPlan | None:
        return self._plans.get(seq.request_id)

    # ---- a request -------------------------------------------------------------------------------
    def check(self, token_ids: list[int], request) -> None:
        if request.segments is not None and request.segments.spans:
            self.assembler.check(token_ids, request.segments)

    def on_arrival(self, seq: Sequence, request) -> None:
        if request.segments is None or not request.segments.spans:
            return
        plan = self.assembler.plan(seq.prompt_token_ids, request.segments, seq.namespace)
        self._plans[seq.request_id] = plan
        # a warm computes into scratch blocks only: none of its own slots are reserved
        reserve = 0 if plan.store_only else plan.end
        self.assembler.kv.restrict(seq, self.assembler.register_limit(plan), reserve,
                                   self.assembler.scratch_tokens(plan))  # fmt: skip
        if self.storage is not None:
            self._restore(seq, plan)

    def pending(self, seq: Sequence) -> bool:
        return seq.request_id in self._restores

    def on_finish(self, seq: Sequence) -> None:
        self._plans.pop(seq.request_id, None)
        self.assembler.drop(seq)
        entry = self._restores.pop(seq.request_id, None)
        if entry is not None and entry[0] is seq:
            self.storage.cancel(entry[1])

    # ---- the step --------------------------------------------------------------------------------
    def wants(self, seq: Sequence) -> int | None:
        # asked for every running sequence every step: nothing to look up without assemblies
        if not self.assembler.jobs:
            return None
        return self.assembler.wants(seq)

    def prefill(self, s: ScheduledSeq) -> Prefill | None:
        if not self._plans:
            return None
        return self.assembler.prefill(s, self._plans.get(s.seq.request_id))

    def after_forward(self, output, prefill_tokens: int, seconds: float) -> list[Sequence]:
        if not self.assembler.jobs:
            return []
        return self.assembler.after_forward(output)

    def before_step(self) -> list[Sequence]:
        if self.storage is None or not self._restores:
            return []
        changed = []
        for entry, job in take_mine(self.storage.take_completed(SEGMENTS), self._restores):
            changed.append(entry[0])
            if job.found and self.storage.is_current(job):
                self._install(entry[0], job)
        return changed

    def has_pending(self) -> bool:
        return bool(self._restores)

    def idle_wait(self, timeout: float) -> None:
        self.storage.wait_completed(timeout)

    # ---- the tiers -------------------------------------------------------------------------------
    def _restore(self, seq: Sequence, plan: SegmentPlan) -> None:
        """Look up in the tiers the segments of ``seq`` that will be placed and that the
        segment store lacks (a request whose spans are all recomputed needs none; a warm
        computes what the store lacks and writes it through: none)."""
        if plan.store_only:
            return
        refs, seen = [], set()
        for sp in plan.spans:
            if plan.options.recompute_for(sp.length) >= sp.length or sp.key in seen:
                continue
            seen.add(sp.key)
            if self.store.contains(sp.key):
                continue
            if not self.storage.may_have(seq.namespace, sp.key, SEGMENTS):
                continue
            refs.append(self._ref(sp.key, plan.sink, seq.prompt_token_ids[sp.start : sp.end]))
        if refs:
            # whose turn at the reader: the owner of the request's own namespace (its tenant)
            job = self.storage.submit_restore(seq.request_id, seq.namespace, refs, owner_of(seq.namespace))
            if job is not None:  # else the tenant's restore queue is full: they are computed
                self._restores[seq.request_id] = (seq, job)

    def _install(self, seq: Sequence, job: RestoreJob) -> None:
        """Restored segments into the segment store, where the assembly finds them."""
        lay, plan = self.storage.layout, self._plans[seq.request_id]
        spans = {sp.key: sp for sp in plan.spans}
        got: Counter = Counter()
        for ref, payload, where in job.found:
            sp = spans[ref.key]
            entry = record.entry_of(
                payload, seq.namespace, seq.prompt_token_ids[sp.start : sp.end], plan.sink,
                lay.num_layers, lay.num_kv_heads, lay.head_dim, self.device,
            )  # fmt: skip
            if self.store.put(ref.key, entry):
                got[where] += ref.tokens
        self.storage.count_served({}, dict(got))

    def _offload(self, key: bytes, entry: SegmentEntry) -> None:
        """Queue a segment just computed alone for every tier."""
        ref = self._ref(key, entry.sink, entry.token_ids)
        self.storage.offload(entry.namespace, [(ref, record.payload_of(entry))])

    def _ref(self, key: bytes, sink, token_ids) -> SegmentRef:
        """The name, key input and exact payload length of a segment's tier record."""
        lay = self.storage.layout
        n = len(token_ids)
        size = record.payload_bytes(n, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        return SegmentRef(key, record.key_input(sink, token_ids), size, n)

    # ---- control and facts -----------------------------------------------------------------------
    def held(self, token_ids: list[int], request) -> int | None:
        """How many of a segments request's documents the RAM store holds now."""
        if request.segments is None:
            return None
        return self.assembler.num_stored(token_ids, request.segments.spans, request.namespace)

    def start_invalidate(self, namespace: str | None, all_namespaces: bool) -> None:
        self.store.invalidate(namespace, all_namespaces)

    def stats(self) -> dict:
        return self.assembler.stats()

    def check_integrity(self) -> None:
        self.store.check_integrity()
        for rid, (seq, job) in self._restores.items():
            assert seq.loading and rid == seq.request_id == job.request_id, "restore bookkeeping"
        assert set(self.assembler.jobs) <= set(self._plans), "an assembly without its plan"
