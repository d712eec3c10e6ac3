"""``adaptive`` (ours, docs/design.md "Eviction policy"): set dueling over lru, lru-demote and
hit-density, made fully associative. All three keep the same forest and the victim is the one
of whichever wins on *miniatures*: a fixed sample of block keys (a quarter) through a
quarter-size instance of each policy, fed by the same calls, scored by decayed hits. Never worse
than LRU by more than the miniatures' error, as good as the best of the three where they differ.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable

from prefixcache.cache.eviction.hit_density import HitDensityPolicy
from prefixcache.cache.eviction.lru import LRUPolicy
from prefixcache.cache.eviction.lru_demote import DemotePolicy
from prefixcache.cache.eviction.policy import Block, EvictionPolicy

# The members by class, not through registry.make_policy: the registry imports this module.
_MEMBERS = {c.name: c for c in (LRUPolicy, DemotePolicy, HitDensityPolicy)}


def _sample_hash(block: Block) -> int:
    """A 32-bit hash of a block id that is the same in every process (``hash()`` of bytes is
    not): the trace's hash ids are ints, the engine's keys bytes that are hashes already."""
    if isinstance(block, int):
        return (block * 0x9E3779B1) & 0xFFFFFFFF
    if isinstance(block, bytes):
        return int.from_bytes(block[:4], "little")
    return zlib.crc32(repr(block).encode())


class AdaptivePolicy(EvictionPolicy):
    """The winner of lru, lru-demote and hit-density on a miniature of the cache (module
    docstring): set dueling, fully associative.

    Each member policy keeps the whole forest (the same blocks, references and candidates in
    all of them); ``evict`` takes the victim of the member followed now and the others evict
    that block as if they had chosen it (``evict_block``: their ghosts and statistics learn
    from it). Miniatures: the blocks whose key hashes to 0 mod ``rate`` (a fixed sample,
    so a sampled block is sampled at every use), run through one small instance of each member
    (capacity / rate, each sampled block the child of its nearest sampled ancestor), see the
    same uses; each counts its hits (a request's leading run of sampled blocks found), decayed
    by ``decay`` per tick. lru is followed unless another miniature leads lru's by more than
    ``margin`` (relative) and by ``z`` times the spread of the per-tick differences (the
    miniatures see the same requests, so their difference is a paired comparison): then the
    largest such lead. ``z`` keeps a cold or short run from following noise (tuned: z = 1 kept
    300-request windows within 0.005 of LRU; z = 0 lost up to 0.012 there but gained more at
    10-20% over hours). ``rate`` shrinks for small caches so a miniature keeps ``min_mini``
    blocks.
    Cost: every operation three times, plus the miniatures' share (about 3 / rate).
    """

    name = "adaptive"
    MEMBERS = ("lru", "lru-demote", "hit-density")

    def __init__(self, capacity: int | None = None, rate: int = 4, min_mini: int = 256,
                 decay: float = 0.999, margin: float = 0.0, z: float = 1.0) -> None:
        super().__init__(capacity)
        if rate < 1 or min_mini < 1 or not 0.0 < decay <= 1.0 or margin < 0 or z < 0:
            raise ValueError("rate >= 1, min_mini >= 1, decay in (0, 1], margin >= 0, z >= 0")
        self.margin = margin
        self.z = z
        self.rate = max(1, min(rate, (capacity or 0) // min_mini))
        self.decay = decay
        self.members = [_MEMBERS[n](capacity) for n in self.MEMBERS]
        mini_cap = None if capacity is None else max(1, capacity // self.rate)
        self.minis = [_MEMBERS[n](mini_cap) for n in self.MEMBERS]
        self.scores = [0.0] * len(self.members)
        self._spread = [0.0] * len(self.members)  # decayed sum of (hits - lru's hits)^2
        self.follow = 0  # index of the member whose victims are taken
        self._tick_hits = [0] * len(self.members)
        self._leading = [True] * len(self.members)
        self._visited: list[Block] = []  # sampled blocks used since the last tick, in order

    @property
    def following(self) -> str:
        return self.MEMBERS[self.follow]

    # ---- queries: the members agree, the first answers ---------------------------------------
    def __len__(self) -> int:
        return len(self.members[0])

    def __contains__(self, block: Block) -> bool:
        return block in self.members[0]

    def is_evictable(self, block: Block) -> bool:
        return self.members[0].is_evictable(block)

    def is_reclaimable(self, block: Block) -> bool:
        return self.members[0].is_reclaimable(block)

    @property
    def num_reclaimable(self) -> int:
        return self.members[0].num_reclaimable

    def refs(self, block: Block) -> int:
        return self.members[0].refs(block)

    def parent(self, block: Block) -> Block | None:
        return self.members[0].parent(block)

    def depth(self, block: Block) -> int:
        return self.members[0].depth(block)

    def is_tail(self, block: Block) -> bool:
        return self.members[0].is_tail(block)

    def group(self, block: Block):
        return self.members[0].group(block)

    def priority(self, block: Block) -> int:
        return self.members[0].priority(block)

    # ---- updates: every member, and the sampled uses to the miniatures ------------------------
    def tick(self) -> int:
        rev = self._visited[::-1]
        for i, mini in enumerate(self.minis):
            if rev:  # the last request is done: its sampled blocks go back, the mini evicts
                mini.release_all(rev, tail=True)
                while mini.capacity is not None and len(mini) > mini.capacity:
                    mini.evict()
            self.scores[i] = self.scores[i] * self.decay + self._tick_hits[i]
            d = self._tick_hits[i] - self._tick_hits[0]
            self._spread[i] = self._spread[i] * self.decay + d * d
            self._leading[i] = True
            mini.tick()
        for i in range(len(self.minis)):
            self._tick_hits[i] = 0
        self._visited = []
        # Another member than lru only when its miniature leads lru's by the margin and by z
        # times the spread of the per-tick differences (the miniatures see the same requests:
        # a paired comparison); the largest such lead wins.
        best, best_lead = 0, 0.0
        for i in range(1, len(self.scores)):
            lead = self.scores[i] - self.scores[0] * (1 + self.margin)
            if lead > best_lead and lead > self.z * math.sqrt(self._spread[i]):
                best, best_lead = i, lead
        self.follow = best
        for p in self.members:
            p.tick()
        self._clock = self.members[0]._clock
        return self._clock

    def insert(self, block: Block, parent: Block | None = None, held: bool = False,
               group=None) -> None:  # fmt: skip
        for p in self.members:
            p.insert(block, parent, held, group)
        self._visit(block)

    def set_priority(self, block: Block, priority: int) -> None:
        for p in self.members:  # each member ranks within groups (the miniatures do not)
            p.set_priority(block, priority)

    def touch(self, block: Block) -> None:
        for p in self.members:
            p.touch(block)
        self._visit(block)

    def mark_tail(self, block: Block, tail: bool = True) -> None:
        for p in self.members:
            p.mark_tail(block, tail)

    def acquire_all(self, blocks: Iterable[Block], touch: bool = False) -> None:
        blocks = list(blocks)
        for p in self.members:
            p.acquire_all(blocks, touch)
        if touch:
            for b in blocks:
                self._visit(b)

    def release_all(self, blocks: Iterable[Block], tail: bool = False) -> None:
        blocks = list(blocks)
        for p in self.members:
            p.release_all(blocks, tail)

    def evict(self) -> Block:
        chooser = self.members[self.follow]
        victim = chooser.evict()
        for p in self.members:
            if p is not chooser:
                p.evict_block(victim)
        return victim

    def evict_block(self, block: Block) -> None:
        for p in self.members:
            p.evict_block(block)

    def remove(self, block: Block) -> None:
        for p in self.members:
            p.remove(block)

    def forget(self, block: Block) -> None:
        for p in self.members:
            p.forget(block)

    def check_integrity(self) -> None:
        first = self.members[0]
        for p in self.members + self.minis:
            p.check_integrity()
        for p in self.members[1:]:
            assert set(p._meta) == set(first._meta), "members hold different blocks"
            for b, m in p._meta.items():
                m0 = first._meta[b]
                assert (m.refs, m.children, m.depth) == (m0.refs, m0.children, m0.depth), (
                    f"members disagree on {b!r}")

    # ---- the miniatures --------------------------------------------------------------------
    def _visit(self, block: Block) -> None:
        rate = self.rate
        if _sample_hash(block) % rate:
            return
        sampled_parent = None  # nearest sampled ancestor in the full forest
        pm = self.parent_meta(self.members[0]._meta[block])
        while pm is not None:
            if _sample_hash(pm.block) % rate == 0:
                sampled_parent = pm.block
                break
            pm = self.parent_meta(pm)
        for i, mini in enumerate(self.minis):
            if block in mini:
                if self._leading[i]:
                    self._tick_hits[i] += 1
                mini.acquire_all((block,), touch=True)
            else:
                self._leading[i] = False
                parent = sampled_parent if sampled_parent in mini else None
                mini.insert(block, parent, held=True)
        self._visited.append(block)
