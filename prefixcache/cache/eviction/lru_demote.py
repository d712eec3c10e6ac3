"""``lru-demote`` (ours, docs/design.md "Eviction policy"): LRU with *quick demotion* of blocks
never reused. What predicts reuse in both Mooncake traces (docs/benchmarks-journal.md "Real traces:
eviction"): a block that has been hit once is reused again with probability 0.42-0.84, a
block seen once only 0.24-0.42, and the last block of a prompt (a leaf no later request
extended) 0.01-0.05. So blocks enter a *probation* queue and move to the *main* LRU on their
first hit; probation is evicted first while it holds more than ``probation_fraction`` of the
capacity (S3-FIFO's small queue, SOSP'23); evicted blocks are remembered (*ghosts*, ids
only, at most ``capacity`` per queue) so that a return enters main directly (it was reused,
just late), and which queue the returns come from moves probation's share (ARC's
adaptation). Leaves no request has extended are ranked first in probation.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixcache.cache.eviction.policy import Block, EvictionPolicy, _Meta


class DemotePolicy(EvictionPolicy):
    """LRU with quick demotion of blocks never reused, adaptive split (module docstring).

    Probation's share of the capacity is a *target* that moves as in ARC: a block that returns
    after eviction from probation (a probation ghost) says probation was too small, one that
    returns after eviction from main says main was; each moves the target by one block (more
    when the other ghost list is longer), within [5%, 90%] of the capacity.
    """

    name = "lru-demote"
    num_queues = 2
    PROBATION, MAIN = 0, 1

    def __init__(self, capacity: int | None = None, probation_fraction: float = 0.5) -> None:
        super().__init__(capacity)
        if not 0.0 < probation_fraction < 1.0:
            raise ValueError("probation_fraction must be in (0, 1)")
        self.probation_fraction = probation_fraction
        self._target = probation_fraction * (capacity or 0)
        self._ghosts: OrderedDict[Block, None] = OrderedDict()  # evicted from probation
        self._main_ghosts: OrderedDict[Block, None] = OrderedDict()  # evicted from main

    def _cap(self) -> int:
        return self.capacity if self.capacity is not None else max(len(self._meta), 1)

    def _on_insert(self, block: Block, m: _Meta) -> None:
        cap = self._cap()
        if block in self._ghosts:  # evicted from probation, then wanted: probation too small
            del self._ghosts[block]
            m.hits = 1
            step = max(1.0, len(self._main_ghosts) / max(1, len(self._ghosts)))
            self._target = min(0.9 * cap, self._target + step)
        elif block in self._main_ghosts:  # evicted from main, then wanted: main too small
            del self._main_ghosts[block]
            m.hits = 1
            step = max(1.0, len(self._ghosts) / max(1, len(self._main_ghosts)))
            self._target = max(0.05 * cap, self._target - step)
        m.queue = self.MAIN if m.hits else self.PROBATION

    def _rank(self, m: _Meta) -> tuple[int, object]:
        if m.hits:
            return self.MAIN, m.stamp
        # Probation: leaves no request extended (a prompt's last block) go first, then oldest.
        return self.PROBATION, (0 if m.tail else 1, m.stamp)

    def _on_evict(self, block: Block, m: _Meta) -> None:
        ghosts = self._ghosts if m.queue == self.PROBATION else self._main_ghosts
        ghosts[block] = None
        while len(ghosts) > self._cap():  # ids only: at most capacity of each
            ghosts.popitem(last=False)

    def _queue_order(self) -> list[int]:
        if self._sizes[self.PROBATION] > self._target:
            return [self.PROBATION, self.MAIN]
        return [self.MAIN, self.PROBATION]

    def _pick_queue(self) -> int | None:
        p_ok = self._top_valid(self.PROBATION)
        m_ok = self._top_valid(self.MAIN)
        if p_ok and m_ok:
            return self.PROBATION if self._sizes[self.PROBATION] > self._target else self.MAIN
        if p_ok:
            return self.PROBATION
        return self.MAIN if m_ok else None
