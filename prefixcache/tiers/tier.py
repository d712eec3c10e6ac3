"""The store protocol every persistent tier declares (``DiskTier``, ``RedisTier``): what
``TierManager`` calls, and nothing else. Records are bytes under (namespace id, record name),
each owned by an owner id (shares.py) whose byte share bounds what it keeps.

One member is optional and looked up where used: ``remaining_ttls(ns, names)`` (the seconds
each record's retention has left; Redis's), so a record restored from a lower tier is written to
the upper one for what remains of its retention, not forever.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from prefixcache.tiers.stats import TierCounters, TierStats


@runtime_checkable
class Tier(Protocol):
    name: ClassVar[str]  # "disk", "redis": in stats, logs and a request's tier_tokens
    # True when the tier's own index is its whole content (a local directory), so a lookup may
    # skip it on a miss; False when others write and evict beside us (a shared Redis).
    knows_contents: ClassVar[bool]
    counters: TierCounters

    def contains(self, ns: str, name: str) -> bool: ...

    def get_many(self, ns: str, names: list[str], owner: str | None = None) -> list[bytes]:
        """The stored bytes of the leading ``names`` present (stops at the first miss)."""
        ...

    def put(self, ns: str, name: str, data: bytes, record: str = "block", *, owner: str,
            ttl: float | None = None) -> bool:  # fmt: skip
        """Store one record owned by ``owner`` for ``ttl`` seconds (None: until evicted)."""
        ...

    def remove(self, ns: str, name: str, owner: str | None = None) -> None:
        """Drop one record (a rejected one)."""
        ...

    def drop_namespace(self, ns: str | None, owner: str | None = None) -> int:
        """Remove a namespace's records (None: every namespace); returns how many."""
        ...

    def sweep(self, now: float | None = None) -> int:
        """Remove the records whose retention ran out; returns how many."""
        ...

    def stats(self) -> TierStats: ...

    def owner_usage(self, owner: str) -> tuple[int | None, int | None]:
        """(records, bytes) ``owner`` holds here: its own figures, nobody else's."""
        ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...
