"""What the tiers store: records of a kind, named by a chain or segment key.

``RecordKind`` says how records of a kind are read and counted; the refs carry their kind, so
the tier code has one restore loop, one write path and one job table for every kind:

- ``BLOCKS``: full KV blocks of a prefix chain. A chain is read in one call and stops at its
  first missing block (later ones are useless without it); a block's payload size is the
  layout's; named under the store id.
- ``SEGMENTS``: a document's K/V computed alone (segments/record.py), any length. Each record is
  looked up on its own (no chain); its payload size is in its ref; named under the segment
  store id, in the same namespace as the blocks (dropping a namespace drops both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class RecordKind:
    name: str  # "blocks" | "segments": take_completed, logs
    label: str  # one record, as a tier logs and counts its puts
    chain: bool  # read as a chain: one call, stops at the first miss
    hit_counter: str  # the TierStats fields a restore's reads and misses count in
    miss_counter: str


BLOCKS = RecordKind("blocks", "block", True, "read_blocks", "miss_blocks")
SEGMENTS = RecordKind("segments", "segment", False, "segment_read", "segment_missed")


@dataclass(frozen=True)
class BlockRef:
    """One full block of a chain: its key and key input (parent key || encoded token ids)."""

    kind: ClassVar[RecordKind] = BLOCKS
    key: bytes
    key_input: bytes


@dataclass(frozen=True)
class SegmentRef:
    """One segment record: its segment key, key input (sink and token ids, segments/record.py),
    the exact payload length a reader expects, and its token count (for the counters)."""

    kind: ClassVar[RecordKind] = SEGMENTS
    key: bytes
    key_input: bytes
    payload_bytes: int
    tokens: int


Ref = BlockRef | SegmentRef
