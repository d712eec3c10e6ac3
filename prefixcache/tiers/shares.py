"""Per-tenant byte shares in the tiers: who owns a namespace's bytes, and who gives way when a
bounded store (the disk tier, our part of Redis, the write queue) is full.

**Owner.** The bytes of a namespace belong to its *owner*: the part of the namespace before its
first "/" (server/auth.py derives "<tenant>", "<tenant>/<salt>" and shared names so that a
namespace names exactly one owner, and no tenant name contains "/"). So all of a tenant's salts
draw on one share, a shared namespace ("public") is an owner of its own, and the offline API's
``None`` is one owner. In the stores an owner is a keyed digest (``owner_id``), like a
namespace id: a directory listing or a Redis dump does not name tenants.

**Rule (max-min fair, the same in every store).** While the store is within its capacity,
anyone may write (work-conserving: a tenant alone uses everything). When a write takes it past
its capacity, records go from the owner holding the most bytes, its least recently used first,
until the store fits again. Holding the most bytes in a store over capacity means holding more
than ``capacity / owners holding bytes`` (the *share*), so an owner at or within its share
never loses a record to anyone else's writes: tenant A writing unique prompts pushes out its
own blocks, and B's only while B holds more than A. Several tenants each end near an equal
share, or at what they asked for if that is less. We chose equal shares over configured
fractions: nothing to configure, no tenant named in the config, and the pool's memory
preemption (engine/fairness.py) already takes from the tenant holding the most. The write queue
applies the rule at admission (manager.py): a write that does not fit is dropped when its owner
is over its share, otherwise the newest queued writes of the owner holding the most make room.

``OwnerLRU`` is the bookkeeping of the in-process stores (the disk tier's index); Redis runs the
same rule in a script (redis_tier.py), over accounting that every replica shares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from prefixcache.tiers.secret import TierKeys

UNKNOWN_OWNER = ""  # records whose owner is not recorded (a layout before owners): one owner


def owner_of(namespace: str | None) -> str | None:
    """The tenant (or shared name) a namespace's bytes count against (server/auth.py's rule)."""
    return None if namespace is None else namespace.split("/", 1)[0]


def owner_id(owner: str | None, keys: TierKeys) -> str:
    """A file- and key-safe name for an owner in this deployment (32 hex chars)."""
    raw = b"\x00" if owner is None else b"\x01" + owner.encode("utf-8")
    return keys.digest(b"owner", raw, 16).hex()


def is_owner_id(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)


def share(capacity: int, owners: int) -> int:
    """Each owner's share of a store of ``capacity`` bytes that ``owners`` owners use."""
    return capacity // max(1, owners)


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
        owner = self._owner.get(key)
        if owner is not None:
            self._lru[owner].move_to_end(key)

    def pop(self, key: Hashable) -> int | None:
        owner = self._owner.pop(key, None)
        if owner is None:
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
