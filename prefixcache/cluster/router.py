"""Which replica gets a request: a Ray Serve ``RequestRouter`` (the documented custom-router API).

Policies (``request_router_kwargs={"policy": ...}``):

- ``prefix``: the replica whose recorded keys match the longest leading run of the request's
  block keys (route_keys.py) gets it, unless its queue is longer than the shortest queue by more
  than ``imbalance`` requests; then the shortest queue wins (the prefix is recomputed there,
  which is cheaper than waiting). No match at all: the replica holding the fewest recorded
  blocks (among those not overloaded), so new prefixes spread evenly over the pools.
  Recorded keys are per replica, at most the replica's pool capacity in blocks, so the map
  forgets roughly when the replica's own LRU evicts; they are shared by tenants as the tiers
  are (cache/shares.py: past the capacity, the least recently used keys of the tenant holding
  the most go first), and recorded only for requests the replica served (the ingress
  ``settle``s each routed request with its answer): one tenant's flood, refused or not, cannot
  push every other tenant's affinity out (issue #37). Ray Serve LLM's
  ``PrefixCacheAffinityRouter`` and sglang-router's ``cache_aware`` work the same way on text;
  we match the engine's exact keys, namespace included, so tenants never share affinity.
- ``round_robin``: the next replica in turn (the baseline that ignores the cache).
- ``pow2``: the shorter queue of two random replicas (Ray Serve's default).

Every policy honours ``target`` (a replica's unique id): the ingress uses it to reach each
replica in turn (stats, invalidation, metrics). Ray's routing loop takes the first replica of
the first rank that has room; later ranks are the fallbacks when a preferred replica is full.

The router lives in the ingress process; ``live_routers()`` lets the ingress list the replicas.
"""

from __future__ import annotations

import asyncio
import random
import sys
import types
from collections import Counter, OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from prefixcache.cache.shares import OwnerLRU
from prefixcache.cluster import POLICIES

MAX_PENDING = 4096  # routed requests awaiting the ingress's settle (the oldest forgotten)


def live_routers() -> list:
    """The routers of this process. Kept in ``sys.modules`` rather than a module global: Ray
    may load this class from its own pickled copy, whose globals are not this module's."""
    holder = sys.modules.get(_REGISTRY)
    if holder is None:
        holder = sys.modules.setdefault(_REGISTRY, types.ModuleType(_REGISTRY))
        holder.routers = []
    return holder.routers


_REGISTRY = "prefixcache._cluster_routers"


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", imbalance: int = 8, capacity_blocks: int = 4096, **_) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.imbalance, self.capacity_blocks = policy, imbalance, capacity_blocks
        self._keys: dict[ReplicaID, OwnerLRU] = {}  # replica -> recorded keys, by tenant
        # ticket -> (replica, keys, tenant) of a routed request until the ingress settles it
        self._pending: OrderedDict[str, tuple] = OrderedDict()
        self._turn = 0
        # Requests sent and not completed, per replica: the load the fallback compares (Ray's
        # own queue-length cache is only filled in its strict max_ongoing_requests mode).
        self._inflight: Counter = Counter()
        self.decisions: Counter = Counter()  # affinity / load_fallback / no_match / ...
        live_routers().append(self)

    # -- state ----------------------------------------------------------------------------------
    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for rid in [r for r in self._keys if r not in alive]:
            del self._keys[rid]  # a replaced replica starts empty: forget what the old one held

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._keys.pop(replica_id, None)
        self._inflight.pop(replica_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._inflight[replica_id] > 0:
            self._inflight[replica_id] -= 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._inflight[replica_id] += 1
        kwargs = pending_request.kwargs if pending_request is not None else {}
        keys = kwargs.get("route")
        if not keys:
            return
        ticket = kwargs.get("route_ticket")
        if ticket is None:  # nobody will settle it: recorded now
            self.record(replica_id, keys, kwargs.get("route_owner"))
            return
        self._pending[ticket] = (replica_id, keys, kwargs.get("route_owner"))  # a retry: its replica
        self._pending.move_to_end(ticket)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def settle(self, ticket: str, served: bool) -> None:
        """The ingress's word on a routed request: its keys count for the replica that got it
        only when that replica served it (a 2xx), never for a refusal."""
        entry = self._pending.pop(ticket, None)
        if entry is not None and served:
            self.record(*entry)

    def record(self, replica_id: ReplicaID, keys: list[bytes], owner: str | None) -> None:
        """``keys`` now held by the replica for ``owner``, within the capacity by its rule."""
        held = self._keys.setdefault(replica_id, OwnerLRU())
        for k in keys:
            held.add(owner, k, 1)
        while held.total > self.capacity_blocks:
            _, victim, _ = held.victim()
            held.pop(victim)

    def matched_blocks(self, replica_id: ReplicaID, keys: list[bytes]) -> int:
        held = self._keys.get(replica_id)
        if not held:
            return 0
        n = 0
        for k in keys:  # a chain: the first miss ends the usable prefix
            if k not in held:
                break
            n += 1
        return n

    def _queue_len(self, replica_id: ReplicaID) -> int:
        return self._inflight[replica_id]

    async def _select_from_candidate_replicas(self, candidates: list[RunningReplica], backoff_index: int):
        """The least loaded replica of a rank that has room, by this router's in-flight counts.

        Replaces Ray's default, which asks each candidate for its queue length with a 0.1 s
        deadline: an engine replica busy with a step often misses it (measured here: routing
        stalled for 10-30 s per request on 2 loaded cores). The replica still enforces its
        max_ongoing_requests, so an estimate that is off costs a retry, not an overload."""
        best = None
        for r in candidates:
            q = self._inflight[r.replica_id]
            if q < r.max_ongoing_requests and (best is None or q < self._inflight[best.replica_id]):
                best = r
        if best is None:
            await asyncio.sleep(min(0.01 * (backoff_index + 1), 0.2))  # all full: let one finish
            return None
        return self.curr_replicas.get(best.replica_id)

    # -- the choice -----------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target")
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
            # Ray's loop calls us again at once when we return nothing: never spin, and once
            # the caller gave up (its timeout cancelled the request) let the loop see it.
            if pending_request is not None and pending_request.future.done():
                return [candidate_replicas]
            await asyncio.sleep(0.05)
            return []
        if self.policy == "round_robin":
            self._turn += 1
            order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            i = self._turn % len(order)
            return [[order[i]], order[i + 1 :] + order[:i]]
        if self.policy == "prefix":
            keys = kwargs.get("route") or []
            best, best_n = None, 0
            for r in candidate_replicas:
                n = self.matched_blocks(r.replica_id, keys)
                if n > best_n or (n == best_n and n > 0 and self._queue_len(r.replica_id) < self._queue_len(best.replica_id)):
                    best, best_n = r, n
            if best is not None:
                shortest = min(candidate_replicas, key=lambda r: self._queue_len(r.replica_id))
                if self._queue_len(best.replica_id) - self._queue_len(shortest.replica_id) > self.imbalance:
                    self.decisions["load_fallback"] += 1
                    best = shortest
                else:
                    self.decisions["affinity"] += 1
                return [[best], [r for r in candidate_replicas if r is not best]]
            self.decisions["no_match"] += 1
            # A new prefix: the replica holding the fewest recorded blocks, so prefixes spread
            # evenly and each replica's share fits its pool (a random pick put 10 of 16 prefixes
            # on one replica whose pool held 9: measured 92% of the ideal hit rate, see
            # docs/benchmarks-journal.md); the lighter queue breaks ties and a busy replica is skipped.
            shortest = min(self._queue_len(r.replica_id) for r in candidate_replicas)
            fits = [r for r in candidate_replicas if self._queue_len(r.replica_id) - shortest <= self.imbalance]
            best = min(fits, key=lambda r: (len(self._keys.get(r.replica_id, ())), self._queue_len(r.replica_id)))
            return [[best], [r for r in candidate_replicas if r is not best]]
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [two, [r for r in candidate_replicas if r not in two]]
