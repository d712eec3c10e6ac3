"""The segment store: KV of documents computed alone, reusable at any position. Torch tensors in
RAM, under a byte budget shared by tenants as the tiers' are (cache/shares.py): when a new entry
does not fit, the least recently used entries of the owner (tenant) holding the most bytes go
first, so one tenant storing unique documents evicts its own, and another's only while that one
holds more than it (it was one global LRU: one tenant's warms evicted everyone's, issue #37).

An entry holds, for every layer, K and V of the segment's tokens at positions 0..n-1 as float32
``[layers, kv_heads, n, head_dim]``: the values attention would read back from the pool (for
int8/fp8/bf16 KV, the dequantized stored values), so placing an entry into the pool quantizes
numbers that are already on the format's grid. K is stored rotated for positions 0..n-1;
``model.llama.rerotate`` moves it to where the segment lands.

Kept apart from the block pool on purpose: the pool's index serves only KV that a cold run would
compute at that exact position after that exact prefix (the cold == warm contract), and segment
KV is not that. Nothing here is ever registered in the prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.cache.shares import OwnerLRU, owner_of


@dataclass(frozen=True)
class SegmentEntry:
    namespace: str | None
    token_ids: tuple[int, ...]
    k: torch.Tensor  # [layers, kv_heads, n, head_dim] float32, rotated for positions p..p+n-1
    v: torch.Tensor  # [layers, kv_heads, n, head_dim] float32
    sink: tuple[int, ...] = ()  # computed after these tokens
    position: int = 0  # p: the position of its first token when computed (= len(sink))

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(frozen=True)
class SegmentStoreStats:
    entries: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    hit_tokens: int
    evicted: int


class SegmentStore:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"segment store capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: dict[bytes, SegmentEntry] = {}
        self._owners = OwnerLRU()  # key -> bytes, per owner in LRU order (who gives way)
        self.hits = self.misses = self.hit_tokens = self.evicted = 0

    @property
    def used_bytes(self) -> int:
        return self._owners.total

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, key: bytes, token_ids: list[int], namespace: str | None, sink=None
    ) -> SegmentEntry | None:
        """The entry for these tokens, or None. A key whose stored ids or namespace differ (a
        collision) is a miss, never someone else's KV."""
        e = self._entries.get(key)
        if e is None or e.namespace != namespace or e.token_ids != tuple(token_ids) \
                or (sink is not None and e.sink != tuple(sink)):  # fmt: skip
            self.misses += 1
            return None
        self._owners.touch(key)
        self.hits += 1
        self.hit_tokens += len(token_ids)
        return e

    def put(self, key: bytes, entry: SegmentEntry) -> bool:
        """Keep ``entry``, making room from the owner holding the most (the module's rule);
        False when it is larger than the whole store (it is then not kept)."""
        if entry.nbytes > self.capacity_bytes:
            return False
        if self._entries.pop(key, None) is not None:
            self._owners.pop(key)
        self._entries[key] = entry
        self._owners.add(owner_of(entry.namespace), key, entry.nbytes)
        while self._owners.total > self.capacity_bytes:
            _, victim, _ = self._owners.victim()
            self._owners.pop(victim)
            del self._entries[victim]
            self.evicted += 1
        return key in self._entries

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> int:
        """Drop the entries of ``namespace`` (or all). Returns how many were dropped."""
        drop = [k for k, e in self._entries.items() if all_namespaces or e.namespace == namespace]
        for k in drop:
            del self._entries[k]
            self._owners.pop(k)
        return len(drop)

    def stats(self) -> SegmentStoreStats:
        return SegmentStoreStats(
            len(self._entries), self.used_bytes, self.capacity_bytes,
            self.hits, self.misses, self.hit_tokens, self.evicted,
        )  # fmt: skip

    def check_integrity(self) -> None:
        total = 0
        for key, e in self._entries.items():
            n = len(e.token_ids)
            assert len(key) == 16, "segment key of wrong length"
            assert e.k.shape == e.v.shape and e.k.shape[2] == n, "entry shape != its token count"
            total += e.nbytes
        assert total == self.used_bytes, f"used_bytes {self.used_bytes} != sum of entries {total}"
        assert self.used_bytes <= self.capacity_bytes, "segment store over its capacity"
        assert set(self._owners.records()) == set(self._entries), "owner map != entries"
        self._owners.check()
