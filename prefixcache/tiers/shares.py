"""Per-tenant byte shares in the tiers: who owns a namespace's bytes, and who gives way when a
bounded store (the disk tier, our part of Redis, the write queue) is full.

**Owner.** The bytes of a namespace belong to its *owner*: the part of the namespace before its
first "/" (server/base/auth.py derives "<tenant>", "<tenant>/<salt>" and shared names so that a
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

``OwnerLRU`` (cache/shares.py, where the segment store uses it too) is the bookkeeping of the
in-process stores (the disk tier's index); Redis runs the same rule in a script
(redis_tier.py), over accounting that every replica shares.
"""

from __future__ import annotations

from prefixcache.tiers.secret import TierKeys

UNKNOWN_OWNER = ""  # records whose owner is not recorded (a layout before owners): one owner


def owner_id(owner: str | None, keys: TierKeys) -> str:
    """A file- and key-safe name for an owner in this deployment (32 hex chars)."""
    raw = b"\x00" if owner is None else b"\x01" + owner.encode("utf-8")
    return keys.digest(b"owner", raw, 16).hex()


def is_owner_id(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)
