"""The work items of the tiers' I/O threads (manager.py): what a restore asks for and finds,
what a write or an invalidation carries, and the speed figures that decide restore vs recompute.
Plain data, no I/O."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class Rates:
    """Exponential moving averages of tokens per second, by name (a tier, "prefill")."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self._lock = threading.Lock()
        self._ema: dict[str, float] = {}

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            old = self._ema.get(name)
            self._ema[name] = value if old is None else old + self.weight * (value - old)

    def get(self, name: str) -> float | None:
        with self._lock:
            return self._ema.get(name)


@dataclass(frozen=True)
class BlockRef:
    """One full block of a chain: its key and key input (parent key || encoded token ids)."""

    key: bytes
    key_input: bytes


@dataclass(frozen=True)
class SegmentRef:
    """One segment record: its segment key, key input (sink and token ids, segments/record.py),
    the exact payload length a reader expects, and its token count (for the counters)."""

    key: bytes
    key_input: bytes
    payload_bytes: int
    tokens: int


@dataclass
class RestoreJob:
    request_id: str
    namespace: str | None
    blocks: list  # BlockRef (a chain: "blocks") or SegmentRef (independent: "segments")
    generation: tuple[int, int]
    kind: str = "blocks"
    # The requester (shares.py's owner of the request's own namespace): whose turn at the
    # reader and whose bound it uses (manager.py); set when submitted.
    owner: str | None = None
    # Filled by the reader: the leading blocks found, with their payload and the tier's name.
    found: list[tuple[BlockRef, bytes, str]] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


@dataclass
class Write:
    namespace: str | None
    ns_id: str
    owner: str | None  # whose share it counts against (shares.py), in the queue and the tiers
    owner_id: str
    generation: tuple[int, int]
    blocks: list[tuple[BlockRef, bytes]]
    tiers: tuple  # the tiers to write to
    nbytes: int
    kind: str = "blocks"  # or "segments" (SegmentRef, the segment store id)


@dataclass
class Invalidate:
    ns_id: str | None
    owner_id: str | None  # the namespace's owner (None with ns_id None: everything)
    done: threading.Event = field(default_factory=threading.Event)
    dropped: dict = field(default_factory=dict)
    error: str | None = None
