"""Per-owner shares of a bounded store, the rule of the tiers (tiers/shares.py) and the segment
store (segments/store.py): while the store is within its capacity anyone may add to it; past
it, entries go from the owner holding the most bytes, its least recently used first. So an owner
at or within ``capacity / owners`` never loses an entry to another's writes, and one alone may
use everything. An owner is the part of a namespace before its first "/" (server/base/auth.py: a
tenant and all its salts; a shared namespace is an owner of its own). No torch, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


def owner_of(namespace: str | None) -> str | None:
    """The tenant (or shared name) a namespace's bytes count against (server/base/auth.py's rule)."""
    return None if namespace is None else namespace.split("/", 1)[0]


def share(capacity: int, owners: int) -> int:
    """Each owner's share of a store of ``capacity`` bytes that ``owners`` owners use."""
    return capacity // max(1, owners)


_ABSENT = object()


class OwnerLRU:
    """Records by owner, each owner's in least-recently-used order, and bytes per owner.
    Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self._owner: dict[Hashable, str] = {}  # record -> its owner
        self._lru: dict[str, OrderedDict[Hashable, int]] = {}  # owner -> record -> bytes
        self._bytes: dict[str, int] = {}
        self.total = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def add(self, owner: str, key: Hashable, size: int) -> None:
        """Insert (most recently used) or, when present, move it to ``owner`` and refresh it."""
        self.pop(key)
        self._owner[key] = owner
        self._lru.setdefault(owner, OrderedDict())[key] = size
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.total += size

    def touch(self, key: Hashable) -> None:
        owner = self._owner.get(key, _ABSENT)
        if owner is not _ABSENT:
            self._lru[owner].move_to_end(key)

    def pop(self, key: Hashable) -> int | None:
        owner = self._owner.pop(key, _ABSENT)  # None is an owner too (the offline API's)
        if owner is _ABSENT:
            return None
        size = self._lru[owner].pop(key)
        self._bytes[owner] -= size
        self.total -= size
        if not self._lru[owner]:
            del self._lru[owner], self._bytes[owner]
        return size

    def keys_of(self, owner: str) -> list:
        return list(self._lru.get(owner, ()))

    def records(self) -> list:
        return list(self._owner)

    def bytes_of(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def count_of(self, owner: str) -> int:
        return len(self._lru.get(owner, ()))

    @property
    def owners(self) -> int:
        return len(self._lru)

    def victim(self) -> tuple[str, Hashable, int] | None:
        """The record to give way next: the least recently used of the owner holding the most."""
        if not self._lru:
            return None
        owner = max(self._bytes, key=self._bytes.__getitem__)
        key, size = next(iter(self._lru[owner].items()))
        return owner, key, size

    def check(self) -> None:
        assert self.total == sum(self._bytes.values()), "tier byte count drifted"
        for owner, recs in self._lru.items():
            assert recs and self._bytes[owner] == sum(recs.values()), "owner bytes drifted"
            assert all(self._owner[k] == owner for k in recs), "record owner map drifted"
        assert len(self._owner) == sum(len(r) for r in self._lru.values()), "record map drifted"
