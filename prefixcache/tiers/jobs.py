"""The work items of the tiers' I/O threads (manager.py): what a restore asks for and finds,
what a write or an invalidation carries. Plain data, no I/O."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prefixcache.tiers.records import RecordKind, Ref


@dataclass
class RestoreJob:
    request_id: str
    namespace: str | None
    refs: list[Ref]  # all of one kind: a chain of BlockRef, or independent SegmentRef
    generation: tuple[int, int]
    kind: RecordKind
    # The requester (shares.py's owner of the request's own namespace): whose turn at the
    # reader and whose bound it uses (manager.py); set when submitted.
    owner: str | None = None
    # Filled by the reader: the leading blocks found, with their payload and the tier's name.
    found: list[tuple[Ref, bytes, str]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


def take_mine(completed: list[RestoreJob], table: dict) -> list[tuple[tuple, RestoreJob]]:
    """The finished ``completed`` jobs still current in ``table`` (request id -> an entry whose
    second item is the job: a connector's restores), each removed from it, with its entry;
    a job whose request left meanwhile (or was resubmitted) is skipped."""
    out = []
    for job in completed:
        entry = table.get(job.request_id)
        if entry is not None and entry[1] is job:
            del table[job.request_id]
            out.append((entry, job))
    return out


@dataclass
class Write:
    namespace: str | None
    ns_id: str
    owner: str | None  # whose share it counts against (shares.py), in the queue and the tiers
    owner_id: str
    generation: tuple[int, int]
    records: list[tuple[Ref, bytes]]  # all of ``kind``
    tiers: tuple  # the tiers to write to
    nbytes: int
    kind: RecordKind
    ttl: float | None = None  # seconds the records are kept in the tiers (None: until evicted)


@dataclass
class Invalidate:
    ns_id: str | None
    owner_id: str | None  # the namespace's owner (None with ns_id None: everything)
    done: threading.Event = field(default_factory=threading.Event)
    dropped: dict = field(default_factory=dict)
    error: str | None = None
