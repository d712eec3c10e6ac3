"""``belady``: the offline optimum for the simulator; the caller passes each block's next use.

An analysis tool, not a policy the engine could run (it needs the future): it lives beside the
trace simulator (``trace_sim.py``) that gives it each block's next use, over the same base as
the online policies (``cache/eviction/policy.py``), so it keeps their invariants (never a block
in use, leaves before parents).
"""

from __future__ import annotations

from prefixcache.cache.eviction.policy import Block, EvictionPolicy, _Meta


class BeladyPolicy(EvictionPolicy):
    """Offline optimum: the candidate needed furthest in the future goes first.

    The caller sets each block's next use (``set_next_use``) before the access that touches it
    ends; a child's next use is never before its parent's, so evicting leaves first loses
    nothing against Belady's MIN over all blocks.
    """

    name = "belady"

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self._next: dict[Block, int] = {}

    def set_next_use(self, block: Block, when: int) -> None:
        self._next[block] = when
        m = self._meta.get(block)
        if m is not None:
            self._offer(block, m)

    def _rank(self, m: _Meta) -> tuple[int, object]:
        return 0, 0  # unused: see _offer

    def _offer(self, block: Block, m: _Meta) -> None:
        m.version = next(self._seq)
        if m.refs == 0 and m.children == 0:
            # furthest next use first: heap on its negation
            self._push(block, m, 0, -self._next.get(block, 1 << 62))
