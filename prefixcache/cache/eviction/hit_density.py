"""``hit-density`` (ours, docs/design.md "Eviction policy"): LHD-style (NSDI'18, "least hit
density") ranking learned online. A block's state is a *class* (a prompt's last block; never
hit; hit once; hit twice or more) and an *age* (ticks since its last use); per class, online
histograms of the ages at which blocks were hit and at which they left give each (class,
age) a hit density, P(hit later) / expected remaining time in the cache, and the victim is the
least dense of a few sampled candidates. What makes it work on prefix blocks is *learning past
the cache's horizon*: evicted blocks become ghosts (ids, at most 4x the capacity), a ghost
that is requested again counts as a hit at the age it would have had, and the eviction is
only counted when the ghost is forgotten. Without that, the histograms only ever see the
reuses that LRU-length lifetimes allow and the policy cannot learn to keep anything longer.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from prefixcache.cache.eviction.policy import Block, EvictionPolicy, NoEvictableBlock, _Meta


class HitDensityPolicy(EvictionPolicy):
    """Least hit density first, learned online per block class (module docstring).

    Candidates (unreferenced leaves) are kept in a list (O(1) add and swap-remove); ``evict``
    ranks ``samples`` of them drawn with a seeded generator, so the policy is deterministic for
    a given sequence of calls. Every ``capacity`` evictions the densities are recomputed from
    the histograms (classes x age buckets, a constant) and the histograms decay by ``decay``,
    so the statistics follow a changing workload. Per operation: O(1), ``evict`` O(samples).

    Ages are bucketed logarithmically (``per_octave`` buckets per doubling), so no age scale
    has to be chosen per trace. Until the first recompute every class has the same density,
    decreasing with age: a sampled LRU.
    """

    name = "hit-density"
    TAIL, NEW, ONCE, MORE = 0, 1, 2, 3  # classes
    NUM_CLASSES = 4
    NUM_BUCKETS = 96

    def __init__(self, capacity: int | None = None, samples: int = 32,
                 ghost_multiple: float = 4.0, decay: float = 0.9, per_octave: int = 4,
                 seed: int = 0) -> None:
        super().__init__(capacity)
        if samples < 1 or ghost_multiple < 0 or not 0.0 < decay <= 1.0 or per_octave < 1:
            raise ValueError("samples >= 1, ghost_multiple >= 0, decay in (0, 1], "
                             "per_octave >= 1")
        self.samples = samples
        self.ghost_multiple = ghost_multiple
        self.decay = decay
        self.per_octave = per_octave
        self._rng = random.Random(seed)
        self._cands: list[Block] = []
        nb, po = self.NUM_BUCKETS, per_octave
        # bucket b covers ages [lo(b), lo(b + 1)): 0..3 one each, then per_octave per doubling
        lo = [float(b) if b < 4 else 2.0 ** ((b - 4) / po + 2) for b in range(nb + 1)]
        self._width = [lo[b + 1] - lo[b] for b in range(nb)]
        self._hits = [[0.0] * nb for _ in range(self.NUM_CLASSES)]
        self._ends = [[0.0] * nb for _ in range(self.NUM_CLASSES)]  # lifetimes ended unhit
        self._density = [[1.0 / (1 + b) for b in range(nb)] for _ in range(self.NUM_CLASSES)]
        # evicted block -> (hits, last use, class): its return is a hit it would have had
        self._ghosts: OrderedDict[Block, tuple[int, int, int]] = OrderedDict()
        self._evictions = 0
        self._glists: dict = {}  # group -> priority -> candidates (ranked only)

    # ---- classes and ages --------------------------------------------------------------------
    def _class(self, m: _Meta) -> int:
        if m.tail:
            return self.TAIL
        return self.NEW if m.hits == 0 else self.ONCE if m.hits == 1 else self.MORE

    def _bucket(self, age: int) -> int:
        if age < 4:
            return max(age, 0)
        b = int(self.per_octave * (math.log2(age) - 2)) + 4
        return b if b < self.NUM_BUCKETS else self.NUM_BUCKETS - 1

    def _cap(self) -> int:
        return self.capacity if self.capacity is not None else max(len(self._meta), 1)

    # ---- candidate list (replaces the heaps) -------------------------------------------------
    # Ranked (retention priorities): each candidate is also in the list of its group and
    # priority, ``_glists[group][prio]`` (empty lists are removed), at ``gslot``.
    def _withdraw(self, m: _Meta) -> None:
        i = m.slot
        if i < 0:
            return
        m.slot = -1
        last = self._cands.pop()
        if i < len(self._cands):
            self._cands[i] = last
            self._meta[last].slot = i
        j = m.gslot
        if j >= 0:
            m.gslot = -1
            levels = self._glists[m.group]
            lst = levels[m.prio]
            last = lst.pop()
            if j < len(lst):
                lst[j] = last
                self._meta[last].gslot = j
            elif not lst:
                del levels[m.prio]
                if not levels:
                    del self._glists[m.group]

    def _offer(self, block: Block, m: _Meta) -> None:
        if m.refs == 0 and m.children == 0:
            if m.slot < 0:
                m.slot = len(self._cands)
                self._cands.append(block)
            if self._ranked and m.gslot < 0:
                lst = self._glists.setdefault(m.group, {}).setdefault(m.prio, [])
                m.gslot = len(lst)
                lst.append(block)
        else:
            self._withdraw(m)

    def _drop(self, block: Block, m: _Meta) -> None:
        self._withdraw(m)
        super()._drop(block, m)

    def _check_candidates(self, cands: set) -> None:
        assert set(self._cands) == cands and len(self._cands) == len(cands), "candidate list"
        assert all(self._meta[b].slot == i for i, b in enumerate(self._cands)), "slots"
        if self._ranked:
            seen = []
            for g, levels in self._glists.items():
                for p, lst in levels.items():
                    assert lst, "empty priority list kept"
                    for j, b in enumerate(lst):
                        m = self._meta[b]
                        assert (m.group, m.prio, m.gslot) == (g, p, j), f"group list of {b!r}"
                    seen += lst
            assert len(seen) == len(cands) and set(seen) == cands, "group lists"

    # ---- learning ----------------------------------------------------------------------------
    def _touch(self, block: Block, m: _Meta) -> None:
        age = self._clock - m.last
        if age > 0:  # a second touch in the same tick is the same use
            self._hits[self._class(m)][self._bucket(age)] += 1
            super()._touch(block, m)
        else:
            self._offer(block, m)

    def _on_insert(self, block: Block, m: _Meta) -> None:
        g = self._ghosts.pop(block, None)
        if g is not None:  # evicted, wanted again: a hit at the age it would have had
            hits, last, cls = g
            self._hits[cls][self._bucket(self._clock - last)] += 1
            m.hits = hits + 1

    def evict(self) -> Block:
        return self._evict_chosen()

    def _choose(self) -> Block:
        if not self._cands:
            raise NoEvictableBlock(f"none of {len(self._meta)} cached blocks is evictable")
        return self._least_dense(self._cands)

    def _choose_in_group(self, victim: Block) -> Block:
        m = self._meta[victim]
        levels = self._glists[m.group]
        low = min(levels)
        return victim if low >= m.prio else self._least_dense(levels[low])

    def _least_dense(self, cands: list) -> Block:
        """The least dense of ``samples`` candidates drawn from ``cands`` (all if fewer)."""
        n = len(cands)
        meta, clock, density = self._meta, self._clock, self._density
        rnd = self._rng.random
        best: Block = None
        best_key: tuple | None = None
        for i in range(min(n, self.samples)):
            b = cands[int(rnd() * n)] if n > self.samples else cands[i]
            m = meta[b]
            # least dense first; ties: the deeper block, then the older one
            key = (density[self._class(m)][self._bucket(clock - m.last)], -m.depth, m.stamp)
            if best_key is None or key < best_key:
                best, best_key = b, key
        return best

    def _on_evict(self, block: Block, m: _Meta) -> None:
        clock = self._clock
        if self.ghost_multiple > 0:
            self._ghosts[block] = (m.hits, m.last, self._class(m))
            while len(self._ghosts) > self.ghost_multiple * self._cap():
                _, (_, last, cls) = self._ghosts.popitem(last=False)
                self._ends[cls][self._bucket(clock - last)] += 1  # never came back
        else:
            self._ends[self._class(m)][self._bucket(clock - m.last)] += 1
        self._evictions += 1
        if self._evictions % self._cap() == 0:
            self._recompute()

    def _recompute(self) -> None:
        """density(c, a) = hits after age a / block-ticks spent after age a (LHD's estimator)."""
        width = self._width
        for c in range(self.NUM_CLASSES):
            hits, ends, dens = self._hits[c], self._ends[c], self._density[c]
            hits_above = events_above = life = 0.0
            for b in range(self.NUM_BUCKETS - 1, -1, -1):
                hits_above += hits[b]
                events_above += hits[b] + ends[b]
                life += events_above * width[b]
                dens[b] = hits_above / life if life > 0 else 0.0
                hits[b] *= self.decay
                ends[b] *= self.decay
