"""What the prefix index reports of its changes: typed records, appended in order while the
engine holds its lock and taken by the caller after each step and invalidation (the shape of
vLLM's ``BlockPool.kv_event_queue``: the pool records, the caller takes; nothing is called back
from inside the index).

``parent`` is the key input's parent (cache/hashing.py): a namespace's root for its first
block, the join of a shared prefix for the first block after it. How events show it on the wire
is the KV events connector's business (connectors/kv_events.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.api.keys import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    key: BlockHash
    parent: BlockHash
    token_ids: tuple[int, ...]
    namespace: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    key: BlockHash


KVEvent = BlockStored | BlockRemoved
