"""What keeps cached blocks beyond their references: owners' pins (with quotas under a ceiling)
and retention priorities' deadlines. Bookkeeping only: the block pool (block_pool.py) asks
these what to do and tells the eviction policy (a pin is one more reference there; a rank is
the policy's priority), so the pool itself is ref counts, the free list and the policy bridge.

Pins. A block is pinned while any owner's pin on it lasts. Each owner (a tenant; None for the
offline API) holds its own pin with its own deadline, and is charged for it against its quota;
the ceiling (``max_pinned``) counts each pinned block once, whoever pinned it. The quotas sum
within the ceiling (``set_quotas``): the blocks pinned are at most what the quota'd owners hold
plus what the others (admins) pin, so owners within their quotas can never fill the ceiling for
another one, however long they renew. Renewing a pin one already holds costs no quota, but an
owner over its quota (after the quotas shrank) renews nothing until its pins expire down to it.

Retention deadlines. A ranked block's priority lasts until a deadline on the pool's clock;
``RankDeadlines`` finds the ended ones (a heap; stale entries, from a later deadline or an
evicted key, are skipped).

Pure Python, no tensors.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping, Sequence


class PinHolds:
    """Owners' pins on blocks (by block id), their deadlines, quotas and the ceiling."""

    def __init__(self, max_pinned: int):
        self.max_pinned = max_pinned
        self._until: dict[int, float] = {}  # block id -> its last pin's deadline
        self._owners: dict[int, dict[str | None, float]] = {}  # block -> owner -> deadline
        self._per_owner: dict[str | None, int] = {}  # owner -> blocks it holds a pin on
        self._quotas: dict[str | None, int] = {}  # owner -> its quota (set_quotas)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._until

    def __len__(self) -> int:
        return len(self._until)

    def __iter__(self):
        return iter(self._until)

    def set_quotas(self, quotas: Mapping[str | None, int]) -> None:
        """The owners bound by a pin quota and their quotas in blocks, replacing the previous
        ones. Raises ValueError unless they sum within the ceiling. Owners not named are bound
        by the ceiling only (admins, the offline API)."""
        if any(isinstance(q, bool) or not isinstance(q, int) or q < 0 for q in quotas.values()):
            raise ValueError("pin quotas must be non-negative block counts")
        if sum(quotas.values()) > self.max_pinned:
            raise ValueError(
                f"pin quotas sum to {sum(quotas.values())} blocks, over the "
                f"{self.max_pinned} blocks that may be pinned"
            )
        self._quotas = dict(quotas)

    def quota(self, owner: str | None) -> int | None:
        """Blocks ``owner`` may hold pinned (None: no quota of its own, only the ceiling)."""
        return self._quotas.get(owner)

    def pinned_by(self, owner: str | None) -> int:
        """Blocks ``owner`` holds a pin on (what its quota is charged)."""
        return self._per_owner.get(owner, 0)

    def pin(self, block_ids: Sequence[int], deadline: float, owner: str | None) -> list[int]:
        """``owner``'s pin on each block until ``deadline`` (a later one it holds stays).
        Raises ValueError, pinning nothing, over ``owner``'s quota or the ceiling. Returns the
        blocks that were not pinned before (each one more reference for the policy)."""
        wanted = list(dict.fromkeys(block_ids))
        new = [b for b in wanted if b not in self._until]
        mine = [b for b in wanted if owner not in self._owners.get(b, {})]
        held = self._per_owner.get(owner, 0)
        owner_quota = self._quotas.get(owner)
        if owner_quota is not None and held + len(mine) > owner_quota:
            raise ValueError(
                f"pin quota exceeded: {held} pinned + {len(mine)} new > {owner_quota} blocks "
                "allowed per tenant"
            )
        if len(self._until) + len(new) > self.max_pinned:
            # The owner's own figures only: how many blocks everyone pinned is another
            # tenant's business (docs/design.md §9).
            raise ValueError(
                f"pin budget exceeded: the server's pinned blocks are at their limit; "
                f"{len(mine)} new blocks of this caller's ({held} pinned now) cannot be pinned"
            )
        for b in wanted:
            owners = self._owners.setdefault(b, {})
            if owner not in owners:
                self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
            owners[owner] = max(deadline, owners.get(owner, 0.0))
            self._until[b] = max(owners.values())
        return new

    def expire(self, now: float) -> list[int]:
        """End the pins whose deadline passed; returns the blocks whose last pin ended."""
        ended = [(b, o) for b, owners in self._owners.items() for o, t in owners.items() if t <= now]
        for b, o in ended:
            self._drop(b, o)
        unpinned = []
        for b in dict.fromkeys(b for b, _ in ended):
            owners = self._owners.get(b)
            if owners:
                self._until[b] = max(owners.values())
            else:
                del self._until[b]
                unpinned.append(b)
        return unpinned

    def unpin(self, block_id: int) -> bool:
        """Drop every pin on a block (its content is going); whether it was pinned."""
        if block_id not in self._until:
            return False
        for o in list(self._owners.get(block_id, ())):
            self._drop(block_id, o)
        del self._until[block_id]
        return True

    def _drop(self, b: int, owner: str | None) -> None:
        owners = self._owners[b]
        del owners[owner]
        n = self._per_owner[owner] - 1
        if n:
            self._per_owner[owner] = n
        else:
            del self._per_owner[owner]
        if not owners:
            del self._owners[b]

    def check_integrity(self, cached: Iterable[int]) -> None:
        """Every pinned block is cached (``cached``: the indexed blocks), within the ceiling,
        its deadline its owners' latest; per-owner counts match; quotas within the ceiling."""
        cached = set(cached)
        for b in self._until:
            assert b in cached, f"pinned block {b} is not cached"
        assert len(self._until) <= self.max_pinned, "pin budget exceeded"
        assert set(self._owners) == set(self._until), "pinned block without owner"
        for b, owners in self._owners.items():
            assert owners and self._until[b] == max(owners.values()), f"block {b} deadline"
        per_owner: dict[str | None, int] = {}
        for owners in self._owners.values():
            for o in owners:
                per_owner[o] = per_owner.get(o, 0) + 1
        assert per_owner == self._per_owner, "per-owner pin counts drifted"
        assert sum(self._quotas.values()) <= self.max_pinned, "quotas over the ceiling"


class RankDeadlines:
    """When each ranked block's retention priority ends (by key)."""

    def __init__(self):
        self._until: dict[Hashable, float] = {}
        self._ends: list[tuple[float, Hashable]] = []

    def __iter__(self):
        return iter(self._until)

    def set(self, key: Hashable, until: float | None) -> None:
        """``key``'s priority ends at ``until`` (None: it lasts while the block stays cached)."""
        if until is None:
            self._until.pop(key, None)
            return
        self._until[key] = until
        heapq.heappush(self._ends, (until, key))
        if len(self._ends) > 2 * len(self._until) + 64:  # drop stale entries
            self._ends = [(t, k) for t, k in self._ends if self._until.get(k) == t]
            heapq.heapify(self._ends)

    def forget(self, key: Hashable) -> None:
        """The block left the cache: its deadline with it."""
        self._until.pop(key, None)

    def expire(self, now: float) -> list[Hashable]:
        """The keys whose priority ended by ``now`` (forgotten here)."""
        ends, until = self._ends, self._until
        out = []
        while ends and ends[0][0] <= now:
            t, key = heapq.heappop(ends)
            if until.get(key) == t:
                del until[key]
                out.append(key)
        return out

    def check_integrity(self, known) -> None:
        """Each deadline's block is still known (``known``: the eviction policy) and queued."""
        for key in self._until:
            assert key in known, "a ranked block's deadline outlived it"
        ends = set(self._ends)
        assert all((t, k) in ends for k, t in self._until.items()), "deadline not queued"
