"""The tiers behind the RAM pool, driven by two I/O threads so that no step waits on them.

    engine thread                          reader thread                 writer thread
    submit_restore(blocks) ─a queue per──▶ one restore of each tenant    invalidations first,
                            tenant         in turn: disk, then Redis     then one write of each
    take_completed() ◀──── done ────────── for what disk lacked          tenant in turn
    offload(blocks) ──────────────────────────────────── a queue per tenant ──▶

Decisions:
- **Write-through, not write-on-evict.** A block is queued for every tier when it is first
  registered in the RAM pool. Writing only at eviction would lose every block still in RAM at a
  restart or a crash (the restart case is the point of a disk tier), and an eviction happens
  inside an allocation, where copying out KV would put I/O-sized work on the step. The copy
  into the queue is one memcpy of the block; the queue is bounded in bytes and a full queue
  drops writes (counted), it never blocks the step.
- **The write queue is shared fairly** (shares.py). Each owner (tenant) has its own FIFO; the
  writer takes one write of each owner in turn (round-robin), so a tenant flooding the queue
  delays another's write-through by at most one of its writes, not by the whole queue. The
  ``max_queued_bytes`` bound is shared by the same rule as the tiers' capacity: a write that
  does not fit is dropped when its owner holds its share (``max_queued_bytes / owners with
  writes queued``) or more, counted as that owner's drop; otherwise the newest queued writes
  of the owner holding the most (over its share) are dropped to make room. A tenant alone may
  fill the whole queue; a flood drops only the flooder's writes.
- **The reader is shared the same way.** Each tenant has its own FIFO of restore jobs and the
  reader takes one job of each tenant in turn, so a tenant queueing many restores (long prompts
  whose blocks are on disk) delays another's restore, and with it its first token, by at most
  one of its jobs per round, not by its whole backlog; a tenant's own jobs keep their order.
  The tenant of a restore is the *requester* (the owner of the request's own namespace), not
  the owner of the namespace read: a chain's shared part (a shared namespace) is read for
  whoever asked, so one tenant's restores of a public prefix never queue ahead of, or count
  against, another's. Each tenant may have ``max_queued_restores`` jobs waiting; past that its
  newest restore is not queued (``submit_restore`` returns None, counted as that tenant's
  ``dropped_restores``) and its request computes those blocks, which gives the same outputs
  (cold == warm). A count, not bytes: a job is at most one prompt's blocks (``max_model_len``),
  so the count bounds a tenant's backlog in bytes too, with nothing to size per deployment.
- **Order of the tiers.** Disk first (local, cheaper), then Redis for the blocks disk lacks;
  blocks found only in Redis are also written to disk. A chain stops at its first missing
  block: later blocks are useless without it.
- **Records are typed by kind** (records.py): blocks (a chain) and segments (cache_mode
  "segments": a document's K/V computed alone, any length, named under the *segment* store id,
  in the same namespace directory / key prefix as the blocks, so dropping a namespace drops
  them too). A ref carries its kind; one restore loop reads both (a chain in one call, stopping
  at its first miss; segments one by one), one write path writes both, with the same checks
  (codec.py), and one job table holds both (each connector takes its own kind's results).
- **Every name and record is the deployment's** (secret.py): namespace ids and record names
  are keyed digests and every record is MAC'd under ``keys``, so what another deployment, or
  anyone without the secret, put in a shared store is never found or never served.
- **Invalidation runs before any write queued after it** (invalidations are the writer's first
  work), and each namespace has a generation: writes and restores of an older generation are
  dropped, so a write queued before an invalidation either ran before it (and is deleted by
  it) or is dropped, and nothing of an invalidated namespace comes back from a queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque

from prefixcache.cache.shares import owner_of, share
from prefixcache.tiers import codec
from prefixcache.tiers.jobs import Invalidate, RestoreJob, Write
from prefixcache.tiers.keys import StoreLayout, block_name, namespace_id
from prefixcache.tiers.records import BLOCKS, SEGMENTS, RecordKind, Ref
from prefixcache.tiers.secret import TierKeys
from prefixcache.tiers.shares import owner_id
from prefixcache.tiers.stats import Rates, TierStats
from prefixcache.tiers.tier import Tier

log = logging.getLogger(__name__)

MAX_GENERATIONS = 65536  # namespaces remembered as invalidated (then a global epoch moves on)
PROBE_EVERY = 16  # a tier measured slower than prefill is still read on every 16th restore
MAX_QUEUED_RESTORES = 32  # restore jobs one tenant may have waiting for the reader
SWEEP_INTERVAL = 60.0  # seconds between sweeps of records whose retention ran out
_OF_NAMESPACE = object()  # submit_restore's default requester: the owner of the namespace read


def _pop_in_turn(queues: OrderedDict) -> object:
    """The round robin of both threads (under ``_cv``, ``queues`` not empty): the oldest item
    of the owner first in the round, which then goes to the back (or leaves, emptied)."""
    owner, q = next(iter(queues.items()))
    item = q.popleft()
    if q:
        queues.move_to_end(owner)
    else:
        del queues[owner]
    return item


class TierManager:
    def __init__(self, tiers: list[Tier], layout: StoreLayout, keys: TierKeys,
                 compression: str = "none", max_queued_bytes: int = 512 << 20,
                 max_queued_restores: int = MAX_QUEUED_RESTORES):  # fmt: skip
        if not tiers:
            raise ValueError("a TierManager needs at least one tier")
        for t in tiers:  # a tier declares the protocol (tiers/tier.py), never just resembles it
            if Tier not in type(t).__mro__:
                raise TypeError(f"{type(t).__name__} is not a tiers.tier.Tier")
        self.tiers = tiers
        self.layout = layout
        self.keys = keys  # the deployment's (secret.py): in every name and MAC
        self.store_id = layout.store_id()
        self.segment_store_id = layout.segment_store_id()
        self._store_ids = {BLOCKS: self.store_id, SEGMENTS: self.segment_store_id}
        self.compression = compression
        self.max_queued_bytes = max_queued_bytes
        if max_queued_restores < 0:
            raise ValueError(f"max_queued_restores must be >= 0, got {max_queued_restores}")
        self.max_queued_restores = max_queued_restores
        self._cv = threading.Condition()
        # Restores: one FIFO per requesting owner, in round-robin order, like the writes.
        self._restores: OrderedDict[str | None, deque[RestoreJob]] = OrderedDict()
        self._owner_restores_dropped: Counter = Counter()  # owner -> restores not queued
        # Writes: one FIFO per owner, in round-robin order (the next to serve first); an owner
        # with nothing queued has no entry. Invalidations go before every write.
        self._writes: OrderedDict[str | None, deque[Write]] = OrderedDict()
        self._invalidations: deque[Invalidate] = deque()
        self._owner_bytes: Counter = Counter()  # owner -> bytes queued or being written
        self._owner_dropped: Counter = Counter()  # owner -> records dropped at the queue
        self._completed: list[RestoreJob] = []
        self._done_event = threading.Event()
        self._queued_bytes = 0
        self._busy_writes = 0
        self._epoch = 0
        self._ns_gen: dict[str | None, int] = {}
        self._rates = Rates()
        self._probes: dict[str, int] = {}
        self._stop = False
        self._threads = [
            threading.Thread(target=self._reader, name="prefixcache-tier-reader", daemon=True),
            threading.Thread(target=self._writer, name="prefixcache-tier-writer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- names ----------------------------------------------------------------------------------
    def generation(self, namespace: str | None) -> tuple[int, int]:
        with self._cv:
            return self._epoch, self._ns_gen.get(namespace, 0)

    def is_current(self, job: RestoreJob) -> bool:
        return not job.cancelled and self.generation(job.namespace) == job.generation

    def _expected(self, ns_id: str, ref: Ref) -> codec.BlockName:
        name = bytes.fromhex(self.record_name(ref.key, ref.kind))
        return codec.BlockName(name, bytes.fromhex(ns_id), ref.key_input)

    def record_name(self, key: bytes, kind: RecordKind = BLOCKS) -> str:
        """The name a record of ``kind`` (a block of chain key ``key``, or a segment of segment
        key ``key``) has in every tier."""
        return block_name(self._store_ids[kind], key, self.keys)

    def _payload_bytes(self, ref: Ref) -> int:
        return self.layout.block_bytes if ref.kind is BLOCKS else ref.payload_bytes

    def _tokens(self, ref: Ref) -> int:
        return self.layout.block_size if ref.kind is BLOCKS else ref.tokens

    def namespace_id(self, namespace: str | None) -> str:
        """The namespace's directory / key prefix in every tier (this deployment's)."""
        return namespace_id(namespace, self.keys)

    def owner_id(self, namespace: str | None) -> str:
        """The id of the namespace's owner in every tier: whose share its bytes count in."""
        return owner_id(owner_of(namespace), self.keys)

    # ---- restores (engine thread submits, reader thread runs) -----------------------------------
    def submit_restore(self, request_id: str, namespace: str | None, refs: list[Ref],
                       requester=_OF_NAMESPACE) -> RestoreJob | None:  # fmt: skip
        """Queue a restore of ``refs`` (all of one kind: a chain of blocks, or segments each
        looked up on its own) for ``requester`` (the owner whose turn and bound it uses; by
        default the owner of ``namespace``). None: the requester has ``max_queued_restores``
        restores waiting already, so this one is not queued and its request computes."""
        job = RestoreJob(request_id, namespace, list(refs), self.generation(namespace), refs[0].kind)
        return self._submit(job, requester)

    def _submit(self, job: RestoreJob, requester) -> RestoreJob | None:
        job.owner = owner_of(job.namespace) if requester is _OF_NAMESPACE else requester
        with self._cv:
            if len(self._restores.get(job.owner, ())) >= self.max_queued_restores:
                self._owner_restores_dropped[job.owner] += 1
                return None
            self._restores.setdefault(job.owner, deque()).append(job)
            self._cv.notify_all()
        return job

    def may_have(self, namespace: str | None, key: bytes, kind: RecordKind = BLOCKS) -> bool:
        """False only when every tier knows, without I/O, that it lacks this block or segment
        (the disk tier's index): then a restore is not worth a trip through the reader thread."""
        ns_id, name = self.namespace_id(namespace), self.record_name(key, kind)
        return any(not t.knows_contents or t.contains(ns_id, name) for t in self.tiers)

    def take_completed(self, kind: RecordKind | None = None) -> list[RestoreJob]:
        """The finished restores (of ``kind`` only, when given: each connector takes its own)."""
        with self._cv:
            if kind is None:
                out, self._completed = self._completed, []
            else:
                out = [j for j in self._completed if j.kind is kind]
                self._completed = [j for j in self._completed if j.kind is not kind]
            if not self._completed:
                self._done_event.clear()
        return out

    def wait_completed(self, timeout: float) -> None:
        self._done_event.wait(timeout)

    def _reader(self) -> None:
        while True:
            with self._cv:
                while not self._restores and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = _pop_in_turn(self._restores)  # one job of each requester in turn
            if not job.cancelled:
                try:
                    self._restore(job)
                except Exception:  # a bug here must cost a miss, not the thread
                    log.exception("restore for %s failed; the request recomputes", job.request_id)
                    job.found = []
            job.done = True
            with self._cv:
                self._completed.append(job)
                self._done_event.set()

    def _restore(self, job: RestoreJob) -> None:
        """Each record from the first tier that has it, disk then Redis; a rejected record is
        removed there and looked for in the next tier. A chain (blocks) is read in one call
        per tier and stops at its first miss or rejection, the rest going to the next tier;
        segments are looked up one by one. Found only in a lower tier: also written to disk."""
        kind = job.kind
        ns_id, oid = self.namespace_id(job.namespace), self.owner_id(job.namespace)
        pending: list[Ref] = list(job.refs)
        missing_from: list = []  # tiers that lacked records found later (promotion targets)
        for tier in self.tiers:
            if not pending:
                break
            if self._too_slow(tier):
                tier.counters.add(skipped_slow=1)
                continue
            t0, left, nbytes, tokens = time.perf_counter(), [], 0, 0
            for batch in [pending] if kind.chain else [[r] for r in pending]:
                datas = tier.get_many(ns_id, [self.record_name(r.key, kind) for r in batch], owner=oid)
                for i, ref in enumerate(batch):
                    payload = self._verified(tier, ns_id, oid, ref, datas[i]) if i < len(datas) else None
                    if payload is None:
                        left.extend(batch[i:])  # a chain stops here; a segment: this one
                        break
                    job.found.append((ref, payload, tier.name))
                    nbytes += len(datas[i])
                    tokens += self._tokens(ref)
            dt = time.perf_counter() - t0
            hits = len(pending) - len(left)
            tier.counters.add(
                **{kind.hit_counter: hits, kind.miss_counter: len(left)}, read_tokens=tokens,
                read_bytes=nbytes, restores=1, restore_seconds_total=dt,
            )  # fmt: skip
            if hits and dt > 0:
                self._rates.observe(tier.name, tokens / dt)
            if left:
                missing_from.append(tier)
            pending = left
        self._promote(job, missing_from)

    def _verified(self, tier, ns_id: str, oid: str, ref: Ref, data: bytes) -> bytes | None:
        """The payload of a record read from ``tier``, or None when it is rejected (removed
        there, counted, logged: it is recomputed, or read from the next tier)."""
        try:
            return codec.decode(data, self._expected(ns_id, ref), self._payload_bytes(ref), self.keys)
        except codec.BlockRejected as e:
            tier.counters.reject(e.reason)
            log.warning("%s tier: %s %s rejected (%s); removed, recomputed",
                        tier.name, ref.kind.label, ref.key.hex(), e)  # fmt: skip
            tier.remove(ns_id, self.record_name(ref.key, ref.kind), owner=oid)
            return None

    def _promote(self, job: RestoreJob, missing_from: list) -> None:
        """What only a lower tier (Redis) held is written to disk, when disk lacked it, for
        as long as it has left there (a record with a retention keeps its deadline)."""
        disk = tuple(t for t in missing_from if t.name == "disk")
        lower = [(ref, p, where) for ref, p, where in job.found if where != "disk"]
        if not (disk and lower):
            return
        ns_id = self.namespace_id(job.namespace)
        by_ttl: dict[float | None, list] = {}
        for where in dict.fromkeys(w for _, _, w in lower):
            tier = next(t for t in self.tiers if t.name == where)
            mine = [(ref, p) for ref, p, w in lower if w == where]
            ask = getattr(tier, "remaining_ttls", None)  # optional (tiers/tier.py)
            names = [self.record_name(ref.key, job.kind) for ref, _ in mine]
            ttls = ask(ns_id, names) if ask is not None else [None] * len(mine)
            for rec, ttl in zip(mine, ttls, strict=True):
                by_ttl.setdefault(ttl, []).append(rec)
        for ttl, recs in by_ttl.items():
            self._queue_write(job.namespace, recs, disk, job.generation, ttl)

    # ---- restore vs recompute ------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill-dominated step (engine thread): its tokens per second."""
        if tokens > 0 and seconds > 0:
            self._rates.observe("prefill", tokens / seconds)

    def _too_slow(self, tier) -> bool:
        """Loading from ``tier`` is measured slower than prefilling: skip it (the request
        recomputes), except for every ``PROBE_EVERY``-th restore, which keeps the tier's
        figure fresh (a Redis that was slow for a while must get its chance back)."""
        mine, prefill = self._rates.get(tier.name), self._rates.get("prefill")
        if mine is None or prefill is None or mine >= prefill:
            return False
        self._probes[tier.name] = self._probes.get(tier.name, 0) + 1
        return self._probes[tier.name] % PROBE_EVERY != 0

    def count_served(self, served: dict[str, int], segment_tokens: dict | None = None) -> None:
        """Blocks of each tier that were installed into the RAM pool, and tokens of segments
        installed into the segment store (engine thread)."""
        bs = self.layout.block_size
        for t in self.tiers:
            n, seg = served.get(t.name, 0), (segment_tokens or {}).get(t.name, 0)
            if n:
                t.counters.add(hit_blocks=n, hit_tokens=n * bs)
            if seg:
                t.counters.add(segment_hit_tokens=seg)

    def cancel(self, job: RestoreJob) -> None:
        """The request left: a queued job leaves its queue (it no longer counts against its
        owner's bound, nor takes a turn); a running one installs nothing."""
        job.cancelled = True
        with self._cv:
            q = self._restores.get(job.owner)
            for i, j in enumerate(q or ()):
                if j is job:  # identity: jobs are dataclasses, == compares their fields
                    del q[i]
                    if not q:
                        del self._restores[job.owner]
                    job.done = True
                    break

    @property
    def pending_restores(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._restores.values())

    # ---- writes ---------------------------------------------------------------------------------
    def offload(
        self, namespace: str | None, records: list[tuple[Ref, bytes]], ttl: float | None = None
    ) -> None:
        """Queue newly computed records (all of one kind) for every tier (never blocks; drops
        when the queue is full). ``ttl``: seconds they are kept there (None: until evicted)."""
        if records:
            self._queue_write(namespace, records, tuple(self.tiers), self.generation(namespace),
                              ttl)  # fmt: skip

    def _queue_write(self, namespace, records, tiers, generation, ttl=None) -> None:
        nbytes = sum(len(p) for _, p in records)
        owner = owner_of(namespace)
        w = Write(namespace, self.namespace_id(namespace), owner, owner_id(owner, self.keys),
                  generation, records, tiers, nbytes, records[0][0].kind, ttl)  # fmt: skip
        with self._cv:
            gone = self._make_room(owner, nbytes)
            if gone is None:
                gone = [w]
            else:
                self._queued_bytes += nbytes
                self._owner_bytes[owner] += nbytes
                self._writes.setdefault(owner, deque()).append(w)
                self._cv.notify_all()
            for g in gone:
                self._owner_dropped[g.owner] += len(g.records)
        for g in gone:
            for t in g.tiers:
                t.counters.add(dropped_writes=len(g.records))

    def _make_room(self, owner: str | None, nbytes: int) -> list[Write] | None:
        """Under ``_cv``: room for ``nbytes`` more of ``owner``'s (shares.py's rule). Returns the
        queued writes dropped to make it (their owners over their share, the one holding the
        most first, its newest first), or None when this write is the one to drop."""
        over = self._queued_bytes + nbytes - self.max_queued_bytes
        if over <= 0:
            return []
        owners = {o for o, b in self._owner_bytes.items() if b > 0} | {owner}
        fair = share(self.max_queued_bytes, len(owners))
        if self._owner_bytes[owner] + nbytes > fair:
            return None
        held, taken, plan = dict(self._owner_bytes), Counter(), []
        while over > 0:  # plan first: drop nothing unless the room can be made
            cands = [o for o, q in self._writes.items()
                     if o != owner and taken[o] < len(q) and held[o] > fair]  # fmt: skip
            if not cands:
                return None  # the excess is being written now; it cannot be taken back
            top = max(cands, key=held.__getitem__)
            taken[top] += 1
            g = self._writes[top][-taken[top]]
            held[top] -= g.nbytes
            over -= g.nbytes
            plan.append(g)
        for g in plan:  # each owner's planned ones are its newest: pop them from the right
            q = self._writes[g.owner]
            q.pop()
            if not q:
                del self._writes[g.owner]
            self._queued_bytes -= g.nbytes
            self._owner_bytes[g.owner] -= g.nbytes
            if not self._owner_bytes[g.owner]:
                del self._owner_bytes[g.owner]
        return plan

    def _next_work(self) -> Write | Invalidate:
        """Under ``_cv``, with work queued: an invalidation, else the next owner's oldest write
        (that owner goes to the back of the round)."""
        if self._invalidations:
            return self._invalidations.popleft()
        return _pop_in_turn(self._writes)

    def sweep(self, now: float | None = None) -> int:
        """Remove the records whose retention ran out, in every tier (the writer thread runs
        this every ``SWEEP_INTERVAL`` seconds; tests call it with an injected ``now``)."""
        n = 0
        for t in self.tiers:
            try:
                n += t.sweep(now)
            except Exception:  # a bug here must cost a sweep, not the thread
                log.exception("%s tier: sweep of expired records failed", t.name)
        return n

    def _writer(self) -> None:
        next_sweep = time.monotonic() + SWEEP_INTERVAL
        while True:
            with self._cv:
                while not self._has_work() and not self._stop:
                    left = next_sweep - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if self._stop and not self._has_work():
                    return
                item = self._next_work() if self._has_work() else None
                if item is not None:
                    self._busy_writes += 1
            if time.monotonic() >= next_sweep:
                self.sweep()
                next_sweep = time.monotonic() + SWEEP_INTERVAL
            if item is None:
                continue
            try:
                if isinstance(item, Invalidate):
                    self._run_invalidate(item)
                else:
                    self._run_write(item)
            except Exception:  # a bug here must cost a write, not the thread
                log.exception("tier write failed")
            finally:
                with self._cv:
                    self._busy_writes -= 1
                    if isinstance(item, Write):
                        self._queued_bytes -= item.nbytes
                        self._owner_bytes[item.owner] -= item.nbytes
                        if not self._owner_bytes[item.owner]:
                            del self._owner_bytes[item.owner]
                    self._cv.notify_all()

    def _has_work(self) -> bool:
        return bool(self._invalidations or self._writes)

    def _run_write(self, w: Write) -> None:
        if self.generation(w.namespace) != w.generation:
            return  # invalidated after it was queued
        for ref, payload in w.records:
            name = self.record_name(ref.key, w.kind)
            data = None
            for tier in w.tiers:
                if tier.contains(w.ns_id, name):
                    continue
                if data is None:
                    data = codec.encode(self._expected(w.ns_id, ref), payload, self.keys, self.compression)
                # A TTL only when there is one: a tier may not know retention at all.
                kw = {} if w.ttl is None else {"ttl": w.ttl}
                tier.put(w.ns_id, name, data, w.kind.label, owner=w.owner_id, **kw)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write has run (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._has_work() or self._busy_writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # ---- invalidation ---------------------------------------------------------------------------
    def start_invalidate(self, namespace: str | None, all_namespaces: bool = False) -> Invalidate:
        """Drop a namespace (or everything) from every tier, before any write queued after
        it; queued writes and in-flight restores of the namespace are dropped from now on (a
        write already running finishes first and is deleted). ``wait_invalidate`` waits for
        the deletion."""
        with self._cv:
            if all_namespaces:
                self._epoch += 1
                self._ns_gen.clear()
            else:
                if len(self._ns_gen) >= MAX_GENERATIONS:
                    self._epoch += 1
                    self._ns_gen.clear()
                self._ns_gen[namespace] = self._ns_gen.get(namespace, 0) + 1
            if all_namespaces:
                job = Invalidate(None, None)
            else:
                job = Invalidate(self.namespace_id(namespace), self.owner_id(namespace))
            self._invalidations.append(job)
            self._cv.notify_all()
        return job

    @staticmethod
    def wait_invalidate(job: Invalidate, timeout: float = 60.0) -> dict[str, int]:
        """Blocks dropped per tier. Raises ConnectionError when a tier could not be reached (the
        others are dropped anyway)."""
        if not job.done.wait(timeout):
            raise ConnectionError("dropping the namespace from the cache tiers timed out")
        if job.error:
            raise ConnectionError(job.error)
        return job.dropped

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> dict[str, int]:
        return self.wait_invalidate(self.start_invalidate(namespace, all_namespaces))

    def _run_invalidate(self, job: Invalidate) -> None:
        errors = []
        for tier in self.tiers:
            try:
                job.dropped[tier.name] = tier.drop_namespace(job.ns_id, owner=job.owner_id)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                errors.append(f"{tier.name}: {e}")
        job.error = "; ".join(errors) or None
        job.done.set()

    # ---- facts and lifecycle --------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def owner_stats(self, owner: str | None) -> dict[str, dict]:
        """One owner's own figures (a tenant's ``/v1/cache/stats``): its bytes and drops in the
        write queue, its restores waiting for the reader and those not queued (over
        ``max_queued_restores``), and what each tier holds of it. Nothing here counts another
        owner."""
        oid = owner_id(owner, self.keys)
        with self._cv:
            out = {"queue": {
                "queued_bytes": self._owner_bytes.get(owner, 0),
                "dropped_writes": self._owner_dropped.get(owner, 0),
                "queued_restores": len(self._restores.get(owner, ())),
                "dropped_restores": self._owner_restores_dropped.get(owner, 0),
            }}  # fmt: skip
        for t in self.tiers:
            records, nbytes = t.owner_usage(oid)
            out[t.name] = {"stored_records": records, "stored_bytes": nbytes}
        return out

    def check_integrity(self) -> None:
        with self._cv:
            assert self._queued_bytes >= 0, "tier write queue accounting drifted"
            queued = Counter()
            for owner, q in self._writes.items():
                assert q, "an empty write queue kept its place in the round"
                for w in q:
                    assert w.owner == owner, "a write in another owner's queue"
                    queued[owner] += w.nbytes
            if not self._busy_writes:  # else one write's bytes are out of the queues
                assert +self._owner_bytes == queued, "per-owner queue bytes drifted"
                assert self._queued_bytes == sum(queued.values()), "queue bytes drifted"
            for owner, q in self._restores.items():
                assert q, "an empty restore queue kept its place in the round"
                assert all(j.owner == owner for j in q), "a restore in another owner's queue"
                assert all(not j.done and not j.cancelled for j in q), "a dead restore queued"
                assert len(q) <= self.max_queued_restores, "an owner's restores passed the bound"
        for t in self.tiers:
            t.check_integrity()

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(5)
        for t in self.tiers:
            t.close()
