"""Continuous batching with chunked prefill, cache-aware admission and preemption.

Each step builds one flat batch under ``max_num_batched_tokens`` (fewer tokens, sized to
``shared_step_ms``, while several tenants are active: fairness.py 4.). Short work goes first:
1. running sequences whose remainder is short (a decode token each, a prefill's last piece),
   in arrival order, then waiting requests whose *uncached* remainder is short (a prefix hit's
   new tokens), within half the step while a long prefill runs, never taking the slot of a
   longer request waiting before them (nor more than half the rest behind one);
2. then the other running sequences, in arrival order: the next chunk of an unfinished prefill.
   When a block cannot be had, the newest running sequence is preempted (its blocks are
   released, its computed blocks stay cached, so resuming is mostly hits);
3. then waiting sequences, in policy order interleaved fairly over tenants (fairness.py), while
   ``max_num_seqs`` and the budget allow. A request is admitted when its *uncached* blocks fit:
   cached blocks are memory already paid for. When the batch is full and a tenant under its fair
   share of slots waits, the newest sequence of a tenant over its share is preempted first.
"Short" is an eighth of ``max_num_batched_tokens`` or less (256 tokens by default).

In-batch sharing: when a waiting request's next uncached block is being computed right now by
another request (its key is "pending"), the request waits instead of computing it again; it is
admitted as the blocks land (they are registered after every chunk) and then hits on them.

The scheduler never touches tensors; the engine runs the batch it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixcache.api.request import RequestStatus
from prefixcache.cache.hashing import BlockHash
from prefixcache.cache.manager import KVCacheManager
from prefixcache.config import EngineConfig
from prefixcache.engine.fairness import (
    NewcomerSteps,
    RecentTenants,
    StepPace,
    busy_budget,
    fair_order,
    memory_victim,
    rebalance,
    running_by_tenant,
    shared_budget,
    token_caps,
)
from prefixcache.sequence import ScheduledSeq, Sequence


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_steps: int = 0
    batched_tokens: int = 0
    computed_prompt_tokens: int = 0  # prefill tokens actually run through the model
    deferred_for_sharing: int = 0  # admissions postponed because another request computes it
    fairness_preemptions: int = 0  # preempted to give a tenant under its share a slot
    shared_steps: int = 0  # steps shortened because tenants share the engine (fairness.py 4.)
    first_steps: int = 0  # steps that ran only newly arrived tenants' first chunks (fairness.py 4.)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        wants: Callable[[Sequence], int | None] | None = None,
    ):
        self.config = config
        self.kv = kv
        # The connectors' cap on a running sequence's grant (ConnectorSet.wants): a segments
        # assembly in a phase that spends less than its prompt's remainder (documents computed
        # alone, a probe, a few recomputed tokens) leaves the rest of the step to others.
        self.wants = wants or (lambda seq: None)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.step_index = 0
        # Short steps while tenants share (fairness.py 4.): the pace of recent steps, fed by the
        # engine through observe_step, and who was active lately, on ``clock``.
        self.pace = StepPace()
        # The pace of prefill-dominated steps only (busy steps size prefill work; a decode row
        # costs several times a prefill token, so mixing them in would shrink busy steps to
        # their floor when decodes dominate).
        self.prefill_pace = StepPace()
        self.recent = RecentTenants(config.shared_window_s)
        self.clock = clock
        self._last_first_step = -2
        self._active_tenants = 1  # tenants sharing the engine at the last step_budget
        # tenant -> the step of its last newcomer step (fairness.py 4.): a tenant gets one at
        # most every 2 x (active tenants) steps, however often it arrives anew.
        self._first_steps = NewcomerSteps()

    # ---- queue operations ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        seq.arrival_step = self.step_index
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def observe_step(self, tokens: int, seconds: float, rows: int) -> None:
        """The engine reports each step's batched tokens, its wall time (schedule to end) and
        how many sequences it scheduled."""
        self.pace.observe(tokens, seconds)
        if tokens >= 4 * rows:
            self.prefill_pace.observe(tokens, seconds)

    def step_budget(self) -> int:
        """This step's token budget: ``max_num_batched_tokens``, or less while sequences share
        the engine (``busy_step_ms``) or tenants do (``shared_step_ms``)."""
        cfg = self.config
        now = self.clock()
        self.recent.touch({s.tenant for s in self.running} | {s.tenant for s in self.waiting}, now)
        self._active_tenants = len(self.recent.active(now))
        shared = shared_budget(
            cfg.max_num_batched_tokens,
            self._active_tenants,
            self.pace,
            cfg.shared_step_ms / 1000,
            floor=cfg.block_size,
        )
        busy = busy_budget(
            cfg.max_num_batched_tokens, len(self.running) + len(self.waiting), self.prefill_pace,
            cfg.busy_step_ms / 1000,
        )  # fmt: skip
        return min(shared, busy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput()
        budget = total = self.step_budget()
        if total < self.config.max_num_batched_tokens:
            self.counters.shared_steps += 1
        if self.waiting and len(self.running) >= self.config.max_num_seqs:
            ready = [s for s in self._order_waiting() if not s.loading]
            for victim in rebalance(ready, self.running, self.config.max_num_seqs):
                self._preempt(victim, out)
                self.counters.fairness_preemptions += 1
        fair_preempted = len(out.preempted)
        if total < self.config.max_num_batched_tokens and self._first_step(out, total):
            self.counters.first_steps += 1
            return self._finish(out)
        # Short work first (decodes, a prefill's short remainder, a waiting hit's new tokens),
        # then long prefills: a request whose prompt is cached waits one step, not behind a
        # long cold prompt's whole prefill.
        # Admitted short work takes at most half the step while a long prefill runs, and never a
        # slot or more than half the rest before a longer waiting request (_schedule_waiting), so
        # long prompts always progress and keep their place. Within each pass the order is the one
        # described above.
        caps = token_caps(budget, self.running, self.waiting)
        short = self._short_tokens()
        self._schedule_running(out, budget, caps, lambda seq: self._left(seq) <= short)
        long_running = any(self._left(seq) > short for seq in self.running)
        if len(out.preempted) == fair_preempted:
            left = total - out.num_batched_tokens
            self._schedule_waiting(out, left // 2 if long_running else left, short=short)
        self._schedule_running(out, total - out.num_batched_tokens, caps)
        if len(out.preempted) == fair_preempted:  # out of memory this step: admit nobody new
            self._schedule_waiting(out, total - out.num_batched_tokens)
            self._top_up(out, total - out.num_batched_tokens)
        return self._finish(out)

    def _short_tokens(self) -> int:
        """A remainder this short (an eighth of a full step, at least a block) counts as short
        work: a hit's new tokens, a prefill's last piece."""
        return max(self.config.block_size, self.config.max_num_batched_tokens // 8)

    @staticmethod
    def _left(seq: Sequence) -> int:
        """Tokens of ``seq`` not computed yet: its prefill's remainder, or 1 for a decode."""
        return seq.num_tokens - seq.kv.num_computed_tokens

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        self.counters.num_steps += 1
        self.counters.batched_tokens += out.num_batched_tokens
        for s in out.scheduled:
            prompt_left = s.seq.num_prompt_tokens - s.seq.kv.num_computed_tokens
            self.counters.computed_prompt_tokens += max(0, min(s.num_new_tokens, prompt_left))
        return out

    def _first_step(self, out: SchedulerOutput, budget: int) -> bool:
        """While tenants share: a step of newly arrived tenants' first chunks alone (fairness.py
        4.), when some tenant has sequences waiting and none running, and had no such step in
        the last 2 x (active tenants) steps. At most every other step, so running sequences
        always progress. True if it scheduled anything."""
        if self.step_index - self._last_first_step < 2:
            return False
        running = running_by_tenant(self.running)
        spacing = 2 * max(1, self._active_tenants)
        fresh = {
            s.tenant for s in self.waiting
            if not s.loading and running[s.tenant] == 0
            and self._first_steps.eligible(s.tenant, self.step_index, spacing)
        }  # fmt: skip
        if not fresh:
            return False
        self._schedule_waiting(out, budget, tenants=fresh)
        if not out.scheduled:
            return False
        self._last_first_step = self.step_index
        self._first_steps.record({s.seq.tenant for s in out.scheduled}, self.step_index)
        return True

    def _schedule_running(self, out: SchedulerOutput, budget: int, caps: dict | None,
                          select: Callable[[Sequence], bool] | None = None) -> None:
        """Running sequences in order (those ``select`` picks; none already in the step), each
        tenant's within its token cap (``caps``, fairness.py: spent across the step's passes);
        when blocks run out, ``memory_victim`` is preempted until the sequence fits."""
        done = {id(x.seq) for x in out.scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if id(seq) in done or (select is not None and not select(seq)):
                i += 1
                continue
            n = min(self._left(seq), budget, self._cap(seq))
            if caps is not None:
                n = min(n, caps[seq.tenant])
                if n <= 0:  # over its cap this step; may be topped up at the end
                    i += 1
                    continue
            preempted_self = False
            while not self.kv.allocate_slots(seq, _slots(seq, seq.kv.num_computed_tokens, n)):
                victim = memory_victim(self.running)
                j = self.running.index(victim)
                refund = next((x.num_new_tokens for x in out.scheduled if x.seq is victim), 0)
                self._preempt(victim, out)
                budget += refund
                if caps is not None:
                    caps[victim.tenant] += refund
                if victim is seq:
                    preempted_self = True
                    break
                if j < i:
                    i -= 1
            if preempted_self:
                continue  # running[i] is now the next sequence
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if caps is not None:
                caps[seq.tenant] -= n
            i += 1

    def _top_up(self, out: SchedulerOutput, budget: int) -> None:
        """Give what the step has left to running sequences the token caps held back (capped
        chunks grow, skipped ones run). Never preempts: only blocks that are free are used."""
        if budget <= 0:
            return
        index = {id(x.seq): k for k, x in enumerate(out.scheduled)}
        for seq in self.running:
            if budget <= 0:
                break
            k = index.get(id(seq))
            have = out.scheduled[k].num_new_tokens if k is not None else 0
            extra = min(self._left(seq), self._cap(seq)) - have
            extra = min(extra, budget)
            if extra <= 0 or not self.kv.allocate_slots(seq, have + extra):
                continue
            if k is None:
                index[id(seq)] = len(out.scheduled)
                out.scheduled.append(ScheduledSeq(seq, extra))
            else:
                out.scheduled[k] = ScheduledSeq(seq, have + extra)
            budget -= extra

    def _cap(self, seq: Sequence) -> int:
        w = self.wants(seq)
        return seq.num_tokens if w is None else max(1, w)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled[:] = [s for s in out.scheduled if s.seq is not seq]
        self.kv.free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def _pending_keys(self) -> set[BlockHash]:
        """Keys of prompt blocks that running prefills have not computed yet."""
        pending: set[BlockHash] = set()
        for seq in self.running:
            if seq.is_prefilling:
                self.kv.extend_keys(seq, seq.num_tokens - 1)
                # A segments request never registers blocks past its limit: not pending.
                stop = seq.kv.max_registered_blocks
                done = seq.kv.num_computed_tokens // self.kv.block_size
                pending.update(seq.kv.block_keys[done:stop])
        return pending

    def _order_waiting(self) -> list[Sequence]:
        """The policy's order, interleaved over tenants (``fair_order``: priorities order a
        tenant's own queue only)."""
        return fair_order(self._policy_order(), running_by_tenant(self.running))

    def _policy_order(self) -> list[Sequence]:
        by_arrival = sorted(self.waiting, key=lambda s: (s.priority, s.metrics.arrival_time))
        cfg = self.config
        if cfg.scheduling_policy == "fcfs" or len(self.waiting) > cfg.lpm_max_queue:
            return by_arrival
        # lpm: longest cached prefix first; sjf: least prefill work first (the prompt tokens the
        # cache does not hold: length-aware and cache-aware at once). Starvation guard:
        # requests that waited too long go first, in arrival order.
        starved = [s for s in by_arrival if self.step_index - s.arrival_step > cfg.lpm_max_wait_steps]
        rest = [s for s in by_arrival if s not in starved]
        if cfg.scheduling_policy == "lpm":
            rest.sort(key=lambda s: (s.priority, -self.kv.match(s).num_tokens, s.metrics.arrival_time))
        else:
            rest.sort(key=lambda s: (s.priority, s.num_tokens - self.kv.match(s).num_tokens,
                                     s.metrics.arrival_time))
        return starved + rest

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, tenants: set | None = None, short: int | None = None
    ) -> None:
        """Admit waiting sequences in fair order while the budget and slots last; ``tenants``:
        only theirs; ``short``: only those whose uncached remainder is at most that many tokens.
        A longer one keeps its place: a slot stays free for each one ahead (a short request
        never takes the slot of a request before it, whatever its tenant), and short requests
        behind one take at most half of the budget left."""
        if budget <= 0 or not self.waiting:
            return
        pending = self._pending_keys() if self.kv.enable_caching else set()
        ahead = 0  # (short pass) longer requests ahead in fair order, each keeping a slot
        for seq in self._order_waiting():
            if budget <= 0 or len(self.running) + ahead >= self.config.max_num_seqs:
                break
            if tenants is not None and seq.tenant not in tenants:
                continue
            if seq.loading:
                continue  # a connector is loading its KV (a restore); others go first
            m = self.kv.match(seq)
            uncached = seq.num_tokens - m.num_tokens
            if short is not None and uncached > short:
                if ahead == 0:
                    budget //= 2
                ahead += 1
                continue
            nb = len(m.block_ids)
            if nb < len(seq.kv.block_keys) and seq.kv.block_keys[nb] in pending:
                if short is None:  # (counted once a step: in the pass that admits any request)
                    self.counters.deferred_for_sharing += 1
                continue  # another request is computing this block right now
            n = min(uncached, budget)
            if not self.kv.admit(seq, m, _slots(seq, m.num_tokens, n)):
                break  # no room: later arrivals must not overtake
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = RequestStatus.RUNNING
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if self.kv.enable_caching:
                pending.update(seq.kv.block_keys[nb : seq.kv.max_registered_blocks])


def _slots(seq: Sequence, computed: int, n: int) -> int:
    """Slots to allocate for ``n`` new tokens of ``seq`` with ``computed`` computed: also every
    slot up to ``seq.kv.reserve_until`` (a connector's work fills them in one go)."""
    return max(n, seq.kv.reserve_until - computed)
