"""Content-addressed index: block key -> block id, with the facts needed to explain a miss.

Contracts:
- ``match`` does not modify the index. The caller must ``acquire`` the returned block ids in the
  block pool before the next allocation, or they may be evicted and reused.
- A hit compares the stored input of the block's key (parent key || encoded token ids, see
  ``hashing.py``), so a hash collision can never serve the KV of different tokens or of another
  prefix (the check is one compare of 16 + 4·block_size bytes per block).
- Evicted keys are remembered (bounded) only to tell "evicted" from "never seen" in explanations.
- ``longest_child`` finds, among the cached children of a key, the one whose tokens share the
  longest prefix with a few tokens (token-exact reuse of a partial block, manager.py): each
  parent keeps its children sorted by their encoded tokens, and in lexicographic order the
  string sharing the longest prefix with a query is next to where the query would sort, so a
  lookup is one bisection and two comparisons, however many children a block has.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixcache.cache.hashing import (
    KEY_BYTES,
    BlockHash,
    block_chunks,
    decode_tokens,
    encode_tokens,
    key_hash,
)
from prefixcache.cache.kv_events import BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, slots=True)
class IndexEntry:
    block_id: int
    key_input: bytes  # parent key || encoded token ids: what the block's key is the hash of
    namespace: str | None

    @property
    def parent(self) -> BlockHash:
        return self.key_input[:KEY_BYTES]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(decode_tokens(self.key_input[KEY_BYTES:]))


_MISS = IndexEntry(-1, b"", None)  # compares unequal to every key input


@dataclass(frozen=True)
class PrefixMatch:
    """Leading full blocks of a prompt that are cached, in order; with ``partial_block`` (the
    KV cache manager's token-exact match), a cached block whose leading tokens continue the
    prompt after them: ``num_tokens`` counts those too (``partial_tokens``)."""

    block_ids: list[int]
    num_tokens: int
    partial_block: int | None = None

    def partial_tokens(self, block_size: int) -> int:
        return self.num_tokens - len(self.block_ids) * block_size


def _common_tokens(a: bytes, b: bytes) -> int:
    """How many leading 4-byte token ids two encodings share."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    if x == 0:
        return n // 4
    return (n - (x.bit_length() + 7) // 8) // 4


class PrefixIndex:
    def __init__(self, block_size: int, evicted_memory: int = 65536) -> None:
        self.block_size = block_size
        self._entries: dict[BlockHash, IndexEntry] = {}
        self._key_of_block: dict[int, BlockHash] = {}
        # parent key -> its children as (encoded tokens || key), sorted: where a prompt diverged
        # (an explanation) and which child continues it furthest (``longest_child``).
        self._children: dict[BlockHash, list[bytes]] = {}
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self._evicted_memory = evicted_memory
        # namespace -> its indexed blocks. The registry of namespaces is exactly the namespaces
        # that hold a block now, so it is bounded by the pool (a namespace is forgotten with its
        # last block; one per cache_salt ever seen would grow without end).
        self._by_namespace: dict[str | None, set[int]] = {}
        # Every key learned and forgotten, as typed records (kv_events.py) in order, for the
        # caller to take (``take_events``); None: not recorded (no connector wants them).
        self.events: list[KVEvent] | None = None

    def record_events(self) -> None:
        """From now on, keep every change as a KVEvent until taken."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._entries

    def key_of(self, block_id: int) -> BlockHash | None:
        return self._key_of_block.get(block_id)

    def keys_of(self, block_ids: Iterable[int]) -> list[BlockHash | None]:
        """``key_of`` of each block, in order."""
        get = self._key_of_block.get
        return [get(b) for b in block_ids]

    def entry(self, key: BlockHash) -> IndexEntry | None:
        return self._entries.get(key)

    def namespace_of(self, block_id: int) -> str | None:
        key = self._key_of_block.get(block_id)
        return None if key is None else self._entries[key].namespace

    def match(
        self, keys: Sequence[BlockHash], token_ids: Sequence[int], root: BlockHash
    ) -> PrefixMatch:
        """Longest run of leading blocks whose key, parent and stored tokens all match (``keys``
        are the chain of ``token_ids`` from ``root``). No side effects."""
        get = self._entries.get
        ids: list[int] = []
        append = ids.append
        parent = root
        chunks = block_chunks(token_ids, self.block_size, num_tokens=len(keys) * self.block_size)
        for key, chunk in zip(keys, chunks):
            e = get(key, _MISS)
            if e.key_input != parent + chunk:
                break
            append(e.block_id)
            parent = key
        return PrefixMatch(ids, len(ids) * self.block_size)

    def match_tokens(
        self, token_ids: Sequence[int], root: BlockHash, num_tokens: int | None = None
    ) -> PrefixMatch:
        """``match`` of the chain of ``token_ids[:num_tokens]`` from ``root``, hashing as it walks:
        one loop, and no block after the first miss is hashed. No side effects."""
        b = self.block_size
        chunks = block_chunks(token_ids, b, num_tokens=num_tokens)
        get = self._entries.get
        h = key_hash
        ids: list[int] = []
        append = ids.append
        parent = root
        for chunk in chunks:
            data = parent + chunk
            parent = h(data)
            e = get(parent, _MISS)
            if e.key_input != data:
                break
            append(e.block_id)
        return PrefixMatch(ids, len(ids) * b)

    def insert(
        self,
        key: BlockHash,
        block_id: int,
        parent: BlockHash,
        token_ids: Sequence[int],
        namespace: str | None,
    ) -> int | None:
        """Record that ``block_id`` holds the KV named by ``key``; returns the block that does.

        If another block already holds this key with the same key input (two requests computed
        the same block at once), the existing one stays the cached copy and its id is returned;
        ``block_id`` stays private. If it holds the key for another input (a collision), None:
        nothing is shared and ``block_id`` stays private; the caller must register no block
        after it either, since their keys chain from the colliding one (design.md §3).
        """
        key_input = parent + encode_tokens(token_ids)
        existing = self._entries.get(key)
        if existing is not None:
            return existing.block_id if existing.key_input == key_input else None
        assert block_id not in self._key_of_block, f"block {block_id} already indexed"
        self._entries[key] = IndexEntry(block_id, key_input, namespace)
        self._key_of_block[block_id] = key
        bisect.insort(self._children.setdefault(parent, []), key_input[KEY_BYTES:] + key)
        self._by_namespace.setdefault(namespace, set()).add(block_id)
        self._evicted.pop(key, None)
        if self.events is not None:
            self.events.append(BlockStored(key, parent, tuple(token_ids), namespace))
        return block_id

    def remove_block(self, block_id: int, evicted: bool) -> BlockHash | None:
        """Forget the key a block holds (eviction or invalidation). Returns the key, if any."""
        key = self._key_of_block.pop(block_id, None)
        if key is None:
            return None
        e = self._entries.pop(key)
        mine = self._by_namespace[e.namespace]
        mine.discard(block_id)
        if not mine:
            del self._by_namespace[e.namespace]
        kids = self._children.get(e.parent)
        if kids is not None:
            item = e.key_input[KEY_BYTES:] + key
            i = bisect.bisect_left(kids, item)
            if i < len(kids) and kids[i] == item:
                del kids[i]
            if not kids:
                del self._children[e.parent]
        if self.events is not None:
            self.events.append(BlockRemoved(key))
        if evicted:
            self._evicted[key] = None
            if len(self._evicted) > self._evicted_memory:
                self._evicted.popitem(last=False)
        return key

    def blocks_in_namespace(self, namespace: str | None) -> list[int]:
        return list(self._by_namespace.get(namespace, ()))

    def namespaces(self) -> list[str | None]:
        """The namespaces that hold at least one indexed block now."""
        return list(self._by_namespace)

    def num_blocks_in_namespace(self, namespace: str | None) -> int:
        return len(self._by_namespace.get(namespace, ()))

    def all_blocks(self) -> list[int]:
        return list(self._key_of_block)

    def was_evicted(self, key: BlockHash) -> bool:
        return key in self._evicted

    def children(self, parent: BlockHash) -> list[IndexEntry]:
        return [self._entries[c[-KEY_BYTES:]] for c in self._children.get(parent, ())]

    def has_children(self, parent: BlockHash) -> bool:
        return parent in self._children  # an emptied list is removed (remove_block)

    def longest_child(
        self, parent: BlockHash, token_ids: Sequence[int]
    ) -> tuple[IndexEntry, int] | None:
        """The cached child of ``parent`` whose tokens share the longest prefix with
        ``token_ids`` (at most a block of them), and how many tokens they share; None when no
        child shares even the first. No side effects."""
        kids = self._children.get(parent)
        if not kids or not token_ids:
            return None
        q = encode_tokens(token_ids)
        i = bisect.bisect_left(kids, q)
        best, best_n = None, 0
        for j in (i - 1, i):  # the neighbours in sorted order share the most with the query
            if 0 <= j < len(kids):
                n = _common_tokens(kids[j][: len(q)], q)
                if n > best_n:
                    best, best_n = kids[j], n
        if best is None:
            return None
        return self._entries[best[-KEY_BYTES:]], min(best_n, len(token_ids))

    def check_integrity(self) -> None:
        assert len(self._entries) == len(self._key_of_block), "entry/block maps differ in size"
        for key, e in self._entries.items():
            assert self._key_of_block.get(e.block_id) == key, f"block {e.block_id} maps elsewhere"
            assert len(e.key_input) == KEY_BYTES + 4 * self.block_size, "indexed block is not full"
            assert e.key_input[KEY_BYTES:] + key in self._children.get(e.parent, ()), (
                "child link missing")
        n_links = sum(len(v) for v in self._children.values())
        assert n_links == len(self._entries), "dangling child links"
        assert all(v == sorted(v) for v in self._children.values()), "children out of order"
        by_ns = sum(len(v) for v in self._by_namespace.values())
        assert by_ns == len(self._entries) and all(self._by_namespace.values()), "namespace map"
        for ns, blocks in self._by_namespace.items():
            for b in blocks:
                assert self._entries[self._key_of_block[b]].namespace == ns, "namespace map"
