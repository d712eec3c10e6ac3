"""Fair sharing of the running batch between tenants (no torch; used by the scheduler).

Two rules, both pure functions of the queues:

1. **Admission order** (``fair_order``): the waiting sequences are taken round-robin over
   tenants, the tenant with the fewest running sequences first. Within one tenant the
   scheduling policy's order holds (fcfs, or lpm's longest cached prefix), after the tenant's own
   ``priority``: a priority orders a tenant's own queue and never jumps another tenant. With one
   tenant this is exactly the policy order.

       tenant A waiting a1 a2 a3 a4 (3 running)      rank = position in own queue + running
       tenant B waiting b1 b2       (0 running)      order: b1 b2 a1 b3.. -> b1(0) b2(1) a1(3) a2(4)

2. **Fair share of slots** (``rebalance``): when the batch is full and a tenant below its share
   (``max_num_seqs // active tenants``) waits, the newest running sequence of the tenant furthest
   over its share is preempted to make room. Preemption keeps outputs (its computed blocks stay
   cached and it resumes from them), and it only ever moves slots from a tenant over its share to
   one under it, so it cannot oscillate. While a tenant is alone it may use every slot.

3. **Fair share of a step's tokens** (``token_caps``): with several tenants active, each one's
   running sequences get at most ``max_num_batched_tokens // active tenants`` tokens first, so a
   tenant's long prefills cannot take every step while another tenant's request waits for
   admission. What a tenant leaves unused goes to the others at the end of the step (the
   scheduler tops capped chunks up), so the cap costs no throughput.

4. **Short steps while tenants share** (``StepPace``, ``RecentTenants``, ``shared_budget``): a
   step cannot be interrupted, so a request that arrives waits for the step under way and then
   for its own; on 2 CPU cores a full 2,048-token step takes ~9 s and 128 decode rows ~0.5 s.
   While two or more tenants are active (running, waiting, or finished a request within
   ``shared_window_s``), the step carries only as many tokens as fit in ``shared_step_ms`` at
   the pace of recent steps (seconds per token, a moving average the engine feeds), so another
   tenant's short request waits at most about two such steps. And when a tenant with nothing
   running has a request waiting, the next step runs only such tenants' first chunks (at most
   every other step, so running sequences always progress): the newcomer waits for the step
   under way and then for its own tokens alone, not for everyone's. "Newly arrived" is a share
   too (``NewcomerSteps``): a tenant gets such a step at most once every 2 x (active tenants)
   steps, so one that keeps arriving anew (one-token requests that finish in their first step)
   has at most 1/(2N) of the steps to itself, not every other one (issue #37). A tenant alone
   keeps the full ``max_num_batched_tokens``. What it costs a busy tenant is the per-step overhead of smaller
   steps (docs/benchmarks-journal.md "Tenant isolation"); outputs never change with step sizes (the
   exact path is batch-invariant, docs/design.md section 2).

5. **Memory preemption** (``memory_victim``): when blocks run out, the newest sequence of the
   tenant holding the most running sequences goes first (with one tenant: the newest, as before),
   so a tenant's flood cannot push out another tenant's only request.

Memory is not partitioned: a tenant's sequences compete for KV blocks as everyone's do, but
their number is bounded by the shares above and by the per-tenant waiting quota (async engine).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq

from prefixcache.sequence import Sequence


def running_by_tenant(running: Iterable[Sequence]) -> Counter:
    return Counter(s.tenant for s in running)


def fair_order(policy_order: Seq[Sequence], running: Mapping) -> list[Sequence]:
    """``policy_order`` (the waiting queue as the policy sorts it) interleaved over tenants."""
    if not policy_order:
        return []
    if len({s.tenant for s in policy_order}) == 1:
        return list(policy_order)
    position = {id(s): i for i, s in enumerate(policy_order)}
    queues: dict[str | None, list[Sequence]] = {}
    for s in policy_order:
        queues.setdefault(s.tenant, []).append(s)
    rank: dict[int, int] = {}
    for tenant, queue in queues.items():
        for k, s in enumerate(queue):
            rank[id(s)] = k + running.get(tenant, 0)
    return sorted(policy_order, key=lambda s: (rank[id(s)], position[id(s)]))


def fair_share(max_num_seqs: int, running: Mapping, waiting: Iterable[Sequence]) -> int:
    """Slots each active tenant (running or waiting) is entitled to; at least one."""
    active = set(running) | {s.tenant for s in waiting}
    return max(1, max_num_seqs // max(1, len(active)))


def rebalance(
    waiting_fair: Seq[Sequence], running: Seq[Sequence], max_num_seqs: int
) -> list[Sequence]:
    """The running sequences to preempt so that tenants under their share get a slot now.

    ``waiting_fair`` is the waiting queue in ``fair_order``. Victims are the newest sequences
    (the end of ``running``) of the tenant furthest over its share.
    """
    counts = running_by_tenant(running)
    share = fair_share(max_num_seqs, counts, waiting_fair)
    free = max_num_seqs - len(running)
    taken: set[int] = set()
    victims: list[Sequence] = []
    for seq in waiting_fair:
        t = seq.tenant
        if counts[t] >= share:
            continue
        if free > 0:  # a free slot: the scheduler admits it (memory permitting)
            free -= 1
            counts[t] += 1
            continue
        over = [(n - share, u) for u, n in counts.items() if n > share]
        if not over:
            break
        _, loser = max(over, key=lambda x: x[0])
        victim = next(
            s for s in reversed(running) if s.tenant == loser and id(s) not in taken
        )
        taken.add(id(victim))
        victims.append(victim)
        counts[loser] -= 1
        counts[t] += 1
    return victims


def token_caps(budget: int, running: Seq[Sequence], waiting: Seq[Sequence]) -> dict | None:
    """Tokens each active tenant's running sequences may take first in a step; None (no cap)
    while one tenant is alone."""
    active = {s.tenant for s in running} | {s.tenant for s in waiting}
    if len(active) < 2:
        return None
    share = max(1, budget // len(active))
    return dict.fromkeys(active, share)


def memory_victim(running: Seq[Sequence]) -> Sequence:
    """The sequence to preempt when blocks run out: the newest of the tenant with the most
    running sequences (ties: the tenant of the newest sequence)."""
    counts = running_by_tenant(running)
    newest = running[-1]
    if len(counts) < 2:
        return newest
    most = max(counts.values())
    if counts[newest.tenant] == most:
        return newest
    loser = next(t for t, n in counts.items() if n == most)
    return next(s for s in reversed(running) if s.tenant == loser)


class StepPace:
    """Seconds per batched token of recent steps (an exponential moving average), to turn a step
    duration into a token count. Unknown until the first step is observed."""

    # Weight of the newest step: a few steps follow a change of load (long contexts, a wider
    # batch) without one odd step swinging the budget.
    ALPHA = 0.3

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        x = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = x if old is None else old + self.ALPHA * (x - old)

    def tokens_within(self, seconds: float) -> int | None:
        """Tokens a step may carry to last about ``seconds``; None while the pace is unknown."""
        if self.seconds_per_token is None:
            return None
        return int(seconds / self.seconds_per_token)


class RecentTenants:
    """When each tenant last had work in the engine, so that a tenant between two requests (a
    chat user reading the answer) still counts as sharing for ``window`` seconds. Bounded: at
    most ``limit`` tenants are remembered (the oldest are forgotten first)."""

    def __init__(self, window: float, limit: int = 4096) -> None:
        self.window = window
        self.limit = limit
        self._seen: dict[str | None, float] = {}

    def touch(self, tenants: Iterable[str | None], now: float) -> None:
        for t in tenants:
            self._seen.pop(t, None)
            self._seen[t] = now  # insertion order is recency order
        while len(self._seen) > self.limit:
            del self._seen[next(iter(self._seen))]

    def active(self, now: float) -> set[str | None]:
        cutoff = now - self.window
        while self._seen:
            t, last = next(iter(self._seen.items()))
            if last >= cutoff:
                break
            del self._seen[t]
        return set(self._seen)


# The least a busy step carries (tokens): below it a step's fixed cost (scheduling, the per-step
# Python, a narrow GEMM) outweighs what a shorter step saves.
BUSY_STEP_FLOOR = 64


def busy_budget(budget: int, sequences: int, pace: StepPace, step_seconds: float) -> int:
    """The step's token budget while ``sequences`` (running or waiting) share the engine: what
    fits in ``step_seconds`` at the recent pace, at least BUSY_STEP_FLOOR, at most ``budget``;
    the whole ``budget`` for a sequence alone, an unknown pace or a bound of 0."""
    if sequences < 2 or step_seconds <= 0:
        return budget
    fit = pace.tokens_within(step_seconds)
    if fit is None:
        return budget
    return max(1, min(budget, max(fit, BUSY_STEP_FLOOR)))


def shared_budget(
    budget: int, active: int, pace: StepPace, step_seconds: float, floor: int
) -> int:
    """The step's token budget: ``budget`` while one tenant is active (or the bound is off or the
    pace unknown); otherwise what fits in ``step_seconds``, at least ``floor`` per active tenant
    (every tenant's next block can progress), never more than ``budget``."""
    if active < 2 or step_seconds <= 0:
        return budget
    fit = pace.tokens_within(step_seconds)
    if fit is None:
        return budget
    return max(1, min(budget, max(fit, floor * active)))


class NewcomerSteps:
    """The step of each tenant's last newcomer step (fairness.py 4.). Bounded: at most
    ``limit`` tenants are remembered, the longest ago forgotten first (a forgotten tenant's
    last one was that long ago: it is eligible anyway)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._last: dict[str | None, int] = {}

    def eligible(self, tenant: str | None, step: int, spacing: int) -> bool:
        last = self._last.get(tenant)
        return last is None or step - last >= spacing

    def record(self, tenants: Iterable[str | None], step: int) -> None:
        for t in tenants:
            self._last.pop(t, None)
            self._last[t] = step  # insertion order is recency order
        while len(self._last) > self.limit:
            del self._last[next(iter(self._last))]
