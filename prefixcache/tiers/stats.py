"""What the tiers measure: the counters of one tier, kept by the tier and read at one moment as
a ``TierStats``, and the speeds (``Rates``) that decide restore vs recompute."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierStats:
    """One tier at one moment (``cache_stats()["tiers"]``, ``/v1/cache/stats``, ``/metrics``)."""

    name: str  # "disk" | "redis"
    enabled: bool  # false while the tier does not write (disk: paused after a write error)
    available: bool  # readable now (Redis up; disk: always, reads go on while writes pause)
    hit_blocks: int  # blocks restored from this tier into the RAM pool (served)
    hit_tokens: int
    read_blocks: int  # blocks read and verified (a block two requests wait for is read twice)
    read_tokens: int
    miss_blocks: int  # blocks looked up here and not found
    rejected_blocks: int  # found but corrupt, forged, truncated or foreign: never served
    written_blocks: int
    written_bytes: int
    read_bytes: int
    dropped_writes: int  # not written: queue full, tier paused or down, refused, too large
    errors: int  # I/O or connection errors (each one also logged)
    stored_blocks: int | None  # blocks held now (None: not known, e.g. a shared Redis)
    stored_bytes: int | None
    capacity_bytes: int | None
    restores: int  # restore jobs that read from this tier
    restore_seconds_total: float  # time those reads took
    reconnects: int = 0
    skipped_slow: int = 0  # restores that skipped this tier: measured slower than prefilling
    # Segment records (cache_mode "segments", segments/record.py): one per document's KV.
    segment_hit_tokens: int = 0  # tokens of segments restored from this tier (served)
    segment_read: int = 0  # segment records read and verified
    segment_missed: int = 0  # segment records looked up here and not found
    segment_written: int = 0
    oversize_writes: int = 0  # not sent: over the tier's record size cap (Redis)
    evicted: int = 0  # records we removed to stay within capacity (shares.py), by this process
    expired: int = 0  # records with a retention whose time ran out, removed by this process
    owners: int | None = None  # owners (tenants) holding bytes here now (None: not known)
    rejected_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def restore_tokens_per_second(self) -> float | None:
        """Tokens read and verified per second of restore I/O."""
        s = self.restore_seconds_total
        return self.read_tokens / s if s > 0 else None


class TierCounters:
    """Mutable counters shared by a tier's reader and writer threads (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hit_blocks = self.hit_tokens = self.miss_blocks = self.rejected_blocks = 0
        self.read_blocks = self.read_tokens = 0
        self.written_blocks = self.written_bytes = self.read_bytes = 0
        self.dropped_writes = self.errors = self.restores = self.reconnects = 0
        self.skipped_slow = 0
        self.segment_hit_tokens = self.segment_read = self.segment_missed = 0
        self.segment_written = self.oversize_writes = self.evicted = self.expired = 0
        self.restore_seconds_total = 0.0
        self.rejected_by_reason: dict[str, int] = {}

    def add(self, **deltas) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def written(self, record: str, nbytes: int) -> None:
        """One record written: a pool block ("block") or a segment ("segment")."""
        self.add(**{"segment_written" if record == "segment" else "written_blocks": 1},
                 written_bytes=nbytes)  # fmt: skip

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected_blocks += 1
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def snapshot(self, name: str, enabled: bool, available: bool, stored_blocks, stored_bytes,
                 capacity_bytes, owners: int | None = None) -> TierStats:  # fmt: skip
        with self.lock:
            return TierStats(
                name=name, enabled=enabled, available=available, hit_blocks=self.hit_blocks,
                hit_tokens=self.hit_tokens, read_blocks=self.read_blocks,
                read_tokens=self.read_tokens, miss_blocks=self.miss_blocks,
                rejected_blocks=self.rejected_blocks, written_blocks=self.written_blocks,
                written_bytes=self.written_bytes, read_bytes=self.read_bytes,
                dropped_writes=self.dropped_writes, errors=self.errors,
                stored_blocks=stored_blocks, stored_bytes=stored_bytes,
                capacity_bytes=capacity_bytes, restores=self.restores,
                restore_seconds_total=self.restore_seconds_total, reconnects=self.reconnects,
                skipped_slow=self.skipped_slow, segment_hit_tokens=self.segment_hit_tokens,
                segment_read=self.segment_read, segment_missed=self.segment_missed,
                segment_written=self.segment_written, oversize_writes=self.oversize_writes,
                evicted=self.evicted, expired=self.expired, owners=owners,
                rejected_by_reason=dict(self.rejected_by_reason),
            )  # fmt: skip


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
