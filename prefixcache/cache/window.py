"""Window parts: the sliding-window layers' K/V of blocks, held apart from the blocks (no torch).

A model with both kinds of attention layer (Gemma 3: 5 local layers of a 512-token window to
each global one) keeps two kinds of KV. Every block of the pool holds the *global* layers' K/V
of its tokens, as any block does. The local layers' K/V of a block live in a *part* of a second,
smaller pool (kv/pool.py), and only while something can read them: a query at position p of a
local layer reads keys ``(p - W, p]`` only, so once a sequence has computed past a block by the
window, the block's part is of no use to it (vLLM's hybrid KV cache manager keeps one block table
per attention type for the same reason). At a 16k-token context that is 3 of Gemma 3's 18 layers
for every token and the other 15 for the last ~512 only.

What a prefix hit needs (the contract: cold == warm bit for bit). A hit of P tokens computes
from position P; its first query reads the global layers' keys [0, P) and the local layers'
keys [P - W + 1, P). So the hit needs the blocks of [0, P) (the prefix index) and the parts of
the blocks holding [max(0, P - W + 1), P): ``usable_hit`` shortens a match to the longest such P
at a block boundary. The parts hold the bits the computing run stored, so a hit through them
reads exactly what a cold run computes (and a shorter hit computes the rest the same way).

Holders and idle parts. A sequence holds the parts of its blocks from ``first_needed`` of its
computed length on (``Sequence.window_from``: the manager's to write); a partial block to be
copied holds its part until the copy ran. A part nobody holds is *idle*: kept while its block is
in the prefix index (a later hit may need it), evicted oldest first when a part is wanted, and
given back at once when its block leaves the index (``forget``) or was never in it. Eviction of
an idle part never touches its block: the block's global K/V stay cached and serve hits shorter
by up to a window. The pool evicting a block forgets its part.

Tiers store whole blocks (every layer, the bytes a full-KV engine stores), written right after
the step that computed them, while the part is still there; a restored block gets a part when
one is free or idle, else it comes back with its global K/V only.

Part 0 is never given out: it is the null part that the block tables of the local layers name
for blocks whose part was dropped (never read: they lie before every query's window).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


def first_needed(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_tokens`` reads in a local layer (keys from
    ``num_tokens - window + 1`` on)."""
    return max(0, num_tokens - window + 1) // block_size


class WindowParts:
    def __init__(self, num_parts: int, window: int, block_size: int):
        """``num_parts`` parts of the local layers' pool, part 0 the null one; ``window`` W in
        tokens (a query at p sees keys (p - W, p])."""
        if num_parts < 2:
            raise ValueError(f"a window pool needs at least 2 parts (one is the null part), got {num_parts}")
        self.num_parts = num_parts
        self.window = window
        self.block_size = block_size
        self._part: dict[int, int] = {}  # block id -> its part
        self._holds: dict[int, int] = {}  # block id -> holders (absent: none)
        self._idle: OrderedDict[int, None] = OrderedDict()  # parts held by nobody, oldest first
        self._free: list[int] = list(range(num_parts - 1, 0, -1))  # popped from the end: 1 first
        self.evicted_parts = 0

    # ---- queries ------------------------------------------------------------------------------
    def first_needed(self, num_tokens: int) -> int:
        return first_needed(num_tokens, self.window, self.block_size)

    def part_of(self, block_id: int) -> int | None:
        return self._part.get(block_id)

    def table(self, block_table: Sequence[int]) -> list[int]:
        """The local layers' block table of a sequence: each block's part, the null part 0 where
        it has none (a block before the window)."""
        get = self._part.get
        return [get(b, 0) for b in block_table]

    @property
    def num_used(self) -> int:
        """Parts holding K/V (held or idle)."""
        return len(self._part)

    @property
    def num_available(self) -> int:
        """Parts that can be had now: free ones and idle ones."""
        return len(self._free) + len(self._idle)

    def num_missing(self, block_ids: Iterable[int]) -> int:
        """How many parts holding ``block_ids`` costs: a block without one needs a part, an idle
        one stops being available."""
        return sum(1 for b in block_ids if b not in self._part or b in self._idle)

    def usable_hit(self, block_ids: Sequence[int]) -> int:
        """How many of the leading ``block_ids`` (a prefix index match, block 0 first) a hit can
        use: the most k such that every block of k's window, [first_needed(k * bs), k), has its
        part. 0 always qualifies (nothing before it)."""
        k = len(block_ids)
        part = self._part
        while k > 0:
            lo = self.first_needed(k * self.block_size)
            missing = [i for i in range(lo, k) if block_ids[i] not in part]
            if not missing:
                return k
            # any k' in (missing[-1], k) has that block in its window too (a window only moves right)
            k = missing[-1]
        return 0

    # ---- holding ------------------------------------------------------------------------------
    def hold(self, block_ids: Sequence[int]) -> bool:
        """One hold on each block's part, giving a part (free, else the oldest idle one's) to the
        blocks without; all or nothing. A block given a part must be one whose local K/V are
        about to be computed (or copied, or restored) into it."""
        if self.num_missing(block_ids) > self.num_available:
            return False
        for b in block_ids:
            if b in self._part:
                self._idle.pop(b, None)
            else:
                self._part[b] = self._take()
            self._holds[b] = self._holds.get(b, 0) + 1
        return True

    def release(self, block_ids: Iterable[int], cached: Callable[[int], bool]) -> None:
        """Drop one hold on each; a part left unheld stays (idle, newest) if its block is
        ``cached`` (in the prefix index), else goes back free. Released in the order given: a
        sequence's earlier blocks first, so they are also evicted first."""
        for b in block_ids:
            n = self._holds[b] - 1
            if n:
                self._holds[b] = n
                continue
            del self._holds[b]
            if cached(b):
                self._idle[b] = None
            else:
                self._free.append(self._part.pop(b))

    def adopt(self, block_id: int) -> int | None:
        """Give an unheld, cached block a part nobody holds (a block restored from a tier: its
        local K/V are written into the part); None when no part is available."""
        assert block_id not in self._part, f"block {block_id} has a part already"
        if not self.num_available:
            return None
        p = self._part[block_id] = self._take()
        self._idle[block_id] = None
        return p

    def move(self, src: int, dst: int) -> None:
        """``src``'s holds and part become ``dst``'s, which has none: the same K/V (a sequence's
        private block swapped for the cached block of equal content; both hold the bits a
        cold run computes, so either part serves)."""
        assert dst not in self._part, f"block {dst} has a part already"
        self._part[dst] = self._part.pop(src)
        self._holds[dst] = self._holds.pop(src)

    def forget(self, block_id: int) -> None:
        """``block_id`` left the prefix index (evicted, or invalidated even while in use): an
        idle part of it no longer holds K/V anyone can name, and goes back free. A held part
        stays with its holders; their release frees it (the block is no longer cached)."""
        if block_id in self._idle:
            del self._idle[block_id]
            self._free.append(self._part.pop(block_id))

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._idle.popitem(last=False)
        self.evicted_parts += 1
        return self._part.pop(b)

    # ---- invariants ---------------------------------------------------------------------------
    def check_integrity(self, indexed: set[int], holds: Iterable[int] | None = None) -> None:
        """Parts 1.. are each free or a block's, once; the held and the idle parts are exactly
        the blocks' parts; an idle part's block is in the prefix index (``indexed``); ``holds``
        (every hold, one block id per hold) gives each block its count."""
        owned = list(self._part.values())
        every = owned + self._free
        assert len(every) == len(set(every)), "a part given twice"
        assert set(every) == set(range(1, self.num_parts)), "parts lost or the null part given"
        assert set(self._holds) | set(self._idle) == set(self._part), "a part neither held nor idle"
        assert not set(self._holds) & set(self._idle), "a held part is idle"
        assert all(n > 0 for n in self._holds.values()), "a hold count of 0 kept"
        for b in self._idle:
            assert b in indexed, f"idle part of block {b}, which is not cached"
        if holds is not None:
            want: dict[int, int] = {}
            for b in holds:
                want[b] = want.get(b, 0) + 1
            assert want == self._holds, f"part holds {self._holds} != live holds {want}"
