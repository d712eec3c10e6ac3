"""Eviction policies over a forest of cached prefix blocks: which cached block goes next.

Torch-free and pool-agnostic: a policy sees block ids (any hashable), each with its parent (the
block before it in the prompt, ``None`` for a first block), and answers ``evict()`` with one
victim. The engine's block pool and the trace simulator (``analyze/trace_sim.py``) drive the
same classes, so what the simulator measures is what the pool would do.

Invariants every policy keeps (checked by the tests):

- **never a block in use**: ``acquire``/``release`` count references; a block with a
  reference is not a candidate;
- **leaves before parents**: a block with a cached child is not a candidate (a child is useless
  without its parent, so evicting the parent first would strand it);
- ties go to the deeper block (the tail of a prompt first), as the engine's LRU does.

Candidates (unreferenced leaves) live in binary heaps with lazy deletion: each block carries a
version, a heap entry whose version is stale is skipped when it reaches the top. Every operation
is O(log n) amortized.

Policies:

- ``lru``: least recently used first (what vLLM, SGLang and the engine do).
- ``lru-demote`` (ours, docs/design.md "Eviction policy"): LRU with *quick demotion* of blocks
  never reused. What predicts reuse in both Mooncake traces (docs/benchmarks-journal.md "Real traces:
  eviction"): a block that has been hit once is reused again with probability 0.42-0.84, a
  block seen once only 0.24-0.42, and the last block of a prompt (a leaf no later request
  extended) 0.01-0.05. So blocks enter a *probation* queue and move to the *main* LRU on their
  first hit; probation is evicted first while it holds more than ``probation_fraction`` of the
  capacity (S3-FIFO's small queue, SOSP'23); evicted blocks are remembered (*ghosts*, ids
  only, at most ``capacity`` per queue) so that a return enters main directly (it was reused,
  just late), and which queue the returns come from moves probation's share (ARC's
  adaptation). Leaves no request has extended are ranked first in probation.
- ``hit-density`` (ours, docs/design.md "Eviction policy"): LHD-style (NSDI'18, "least hit
  density") ranking learned online. A block's state is a *class* (a prompt's last block; never
  hit; hit once; hit twice or more) and an *age* (ticks since its last use); per class, online
  histograms of the ages at which blocks were hit and at which they left give each (class,
  age) a hit density, P(hit later) / expected remaining time in the cache, and the victim is the
  least dense of a few sampled candidates. What makes it work on prefix blocks is *learning past
  the cache's horizon*: evicted blocks become ghosts (ids, at most 4x the capacity), a ghost
  that is requested again counts as a hit at the age it would have had, and the eviction is
  only counted when the ghost is forgotten. Without that, the histograms only ever see the
  reuses that LRU-length lifetimes allow and the policy cannot learn to keep anything longer.
- ``adaptive`` (ours, docs/design.md "Eviction policy"): set dueling over the three above,
  made fully associative. All three keep the same forest and the victim is the one of whichever
  wins on *miniatures*: a fixed sample of block keys (a quarter) through a quarter-size instance
  of each policy, fed by the same calls, scored by decayed hits. Never worse than LRU by more
  than the miniatures' error, as good as the best of the three where they differ.
- ``belady``: the offline optimum for the simulator; the caller passes each block's next use.

**Retention priority, within a group** (every policy; docs/design.md §4): a block may belong to
a *group* (the engine's: a tenant) and carry a priority (0-100, default 35, TensorRT-LLM's
scale). ``evict`` first takes the policy's own victim; that decides *whose* block goes. Then,
within the victim's group, the lowest priority among the group's candidates goes first, the
policy's order deciding among equals. So priorities reorder a group's own blocks only: how
many blocks each group loses is what the policy alone would take, and a group ranking all
its blocks at 100 takes nobody else's. The layer costs nothing until a priority other than
the default is set (``set_priority``); from then on each candidate is also kept per group (a
heap of ``(priority, rank)`` per group and queue; sampled policies: a list per group and
priority).

The engine's pool (``block_pool.py``) names blocks by key (content, as the trace's hash ids),
holds a reference for each user and one for a pin, ticks once per admitted request and releases
a request's blocks as one use; ``num_reclaimable`` (blocks neither referenced nor above a
referenced one) is what it may allocate by evicting.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from prefixcache.api.request import DEFAULT_RETENTION_PRIORITY
from prefixcache.config import EVICTION_POLICIES

Block = Hashable

# The online policies (the engine's choices); "belady" is offline (simulator only).
POLICY_NAMES = EVICTION_POLICIES


class EvictionError(RuntimeError):
    """A call that breaks the policy's contract (unknown block, evicting with no candidate)."""


class NoEvictableBlock(EvictionError):
    """Every cached block is in use or has a cached child."""


class _Meta:
    __slots__ = (
        "block",
        "children",
        "depth",
        "gone",
        "group",
        "gslot",
        "held_below",
        "hits",
        "last",
        "parent",
        "pmeta",
        "prio",
        "queue",
        "refs",
        "slot",
        "stamp",
        "tail",
        "version",
    )

    def __init__(self, block: Block, pmeta: _Meta | None, depth: int) -> None:
        self.block = block
        self.pmeta = pmeta  # the parent's record (None: a root); see ``parent_meta``
        self.parent = None if pmeta is None else pmeta.block
        self.depth = depth
        self.children = 0  # cached children
        self.refs = 0
        self.held_below = 0  # children that are held or have a held descendant
        self.hits = 0  # touches after the insert
        self.last = 0  # clock of the last use (touch, or release): ages count ticks
        self.stamp = 0  # order of the last use: recency (several uses may share a tick)
        self.queue = 0  # which heap the block is a candidate in
        self.version = 0  # bumped whenever the block's heap entry becomes stale
        self.tail = False  # ended the path of the last access that touched it
        self.slot = -1  # index in a sampling policy's candidate list (-1: not a candidate)
        self.gone = False  # forgotten (``forget``): its children are roots now
        self.group = None  # whose block it is: priorities rank within a group
        self.prio = DEFAULT_RETENTION_PRIORITY
        self.gslot = -1  # index in its group's candidate list (sampling policies; -1: none)


class EvictionPolicy:
    """Base: the block forest, references, and candidate heaps. Subclasses rank candidates.

    ``_rank(meta)`` gives ``(queue, key)``: the heap a candidate is in and its order there
    (smallest first); ``_pick_queue()`` chooses the heap the next victim comes from.

    Besides the candidates (evictable now), the policy counts the blocks that are *held*: a
    block with a reference, or one with a held descendant (it cannot go before that
    descendant does). Every other block is evicted before an ``evict`` can fail, so
    ``num_reclaimable = len - num_held`` is exactly how many ``evict`` calls succeed in a row
    (the engine's pool admits requests by it). Kept up to date by walking up from a block whose
    held state changes, as far as the first ancestor whose own state does not: O(1) when
    requests hold whole prefixes (their ancestors are held already), O(depth) at worst.
    """

    name = "base"
    num_queues = 1

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._meta: dict[Block, _Meta] = {}
        self._heaps: list[list] = [[] for _ in range(self.num_queues)]
        self._sizes = [0] * self.num_queues  # cached blocks per queue, candidates or not
        self._clock = 0
        self._stamp = 0  # advances with every tick and every release_all: recency order
        self._seq = itertools.count(1)  # versions: unique, so heap entries never compare blocks
        self._num_held = 0
        # Retention priorities (module docstring): off until a block gets a non-default one.
        self._ranked = False
        self._gheaps: dict[tuple, list] = {}  # (group, queue) -> heap of (prio, rank..., block)
        self._gsizes: dict = {}  # group -> its cached blocks (bounds its heaps' stale entries)

    # ---- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, block: Block) -> bool:
        return block in self._meta

    def is_evictable(self, block: Block) -> bool:
        """A candidate now: cached, unreferenced, no cached child."""
        m = self._meta.get(block)
        return m is not None and m.refs == 0 and m.children == 0

    def is_reclaimable(self, block: Block) -> bool:
        """Neither referenced nor above a referenced block: evicted before ``evict`` fails."""
        m = self._meta.get(block)
        return m is not None and m.refs == 0 and m.held_below == 0

    @property
    def num_reclaimable(self) -> int:
        """How many ``evict`` calls would succeed in a row now."""
        return len(self._meta) - self._num_held

    def refs(self, block: Block) -> int:
        return self._get(block).refs

    def parent(self, block: Block) -> Block | None:
        pm = self._get(block).pmeta
        return None if pm is None or pm.gone else pm.block

    def depth(self, block: Block) -> int:
        return self._get(block).depth

    def is_tail(self, block: Block) -> bool:
        return self._get(block).tail

    def group(self, block: Block):
        return self._get(block).group

    def priority(self, block: Block) -> int:
        return self._get(block).prio

    # ---- updates -----------------------------------------------------------------------------
    def tick(self) -> int:
        """Advance the clock: touches at one tick are simultaneous (one request's blocks).

        Ages (``hit-density``) count ticks, recency counts *uses*: a tick is one, and so is
        every ``release_all`` (blocks released together are one use, ranked among themselves
        by depth), so blocks released one call after another keep their order within a tick
        (the engine ticks once per admitted request and releases many times in between)."""
        self._clock += 1
        self._stamp += 1
        return self._clock

    def insert(self, block: Block, parent: Block | None = None, held: bool = False,
               group=None) -> None:  # fmt: skip
        """A block newly cached, as a child of ``parent`` (which must be cached); ``held``: with
        one reference already (a block computed by a running request, as the engine inserts).
        ``group``: whose block it is (retention priorities rank within a group); its priority
        starts at the default."""
        if block in self._meta:
            raise EvictionError(f"block {block!r} is already cached")
        pm = None
        if parent is not None:
            pm = self._get(parent)
            if pm.children == 0:
                self._withdraw(pm)
            pm.children += 1
        m = self._meta[block] = _Meta(block, pm, 0 if pm is None else pm.depth + 1)
        m.group = group
        self._gsizes[group] = self._gsizes.get(group, 0) + 1
        m.last = self._clock
        m.stamp = self._stamp
        self._on_insert(block, m)
        self._sizes[m.queue] += 1
        if held:  # in use: no candidate, held (and so is every ancestor)
            m.refs = 1
            if pm is not None and pm.refs:
                self._num_held += 1
                pm.held_below += 1
            else:
                self._held_changed(m, 1)
        else:
            self._offer(block, m)

    def touch(self, block: Block) -> None:
        """A cache hit on ``block`` at the current tick."""
        self._touch(block, self._get(block))

    def mark_tail(self, block: Block, tail: bool = True) -> None:
        """Whether ``block`` ended the path of the access that just touched it."""
        m = self._get(block)
        if m.tail != tail:
            m.tail = tail
            self._offer(block, m)

    def set_priority(self, block: Block, priority: int) -> None:
        """``block``'s retention priority (higher: kept longer than its group's lower ones)."""
        m = self._get(block)
        if m.prio == priority:
            return
        if not self._ranked:
            self._enable_ranking()
        self._withdraw(m)  # out of its group's candidates under the old priority
        m.prio = priority
        self._offer(block, m)

    def acquire(self, block: Block) -> None:
        """One more reference: the block is in use and no candidate until released."""
        self.acquire_all((block,))

    def acquire_all(self, blocks: Iterable[Block], touch: bool = False) -> None:
        """``acquire`` each block, in order, and with ``touch`` count it as a hit too (the
        engine's admission: one call for a request's hits)."""
        meta = self._meta
        for b in blocks:
            m = meta.get(b)
            if m is None:
                raise EvictionError(f"block {b!r} is not cached")
            if m.refs == 0:
                self._withdraw(m)
                if m.held_below == 0:
                    pm = m.pmeta
                    if pm is not None and pm.refs and not pm.gone:  # a held prefix: no walk
                        self._num_held += 1
                        pm.held_below += 1
                    else:
                        self._held_changed(m, 1)
            m.refs += 1
            if touch:
                self._touch(b, m)

    def release(self, block: Block) -> None:
        """One reference less. The release is a use: the block's recency is the current tick
        (the engine's LRU orders blocks by when their last user let go, as vLLM's does)."""
        self.release_all((block,))

    def release_all(self, blocks: Iterable[Block], tail: bool = False) -> None:
        """``release`` each block, in order, as one use (the engine releases a block table tail
        first). ``tail``: the blocks are a request's path, deepest first, that it is done with:
        the first ends the path (``mark_tail``), the others do not."""
        self._stamp += 1
        meta, clock, stamp = self._meta, self._clock, self._stamp
        for b in blocks:
            m = meta.get(b)
            if m is None:
                raise EvictionError(f"block {b!r} is not cached")
            if m.refs == 0:
                raise EvictionError(f"block {b!r} released more often than acquired")
            m.refs -= 1
            m.last = clock
            m.stamp = stamp
            if tail:
                m.tail, tail = True, False
            elif m.tail:
                m.tail = False
            if m.refs == 0:
                if m.held_below == 0:
                    pm = m.pmeta
                    if pm is not None and pm.refs and not pm.gone:  # a held prefix: no walk
                        self._num_held -= 1
                        pm.held_below -= 1
                    else:
                        self._held_changed(m, -1)
                if m.children == 0:  # a candidate again (no other block has a live entry)
                    self._offer(b, m)

    def evict(self) -> Block:
        """Remove and return the next victim: an unreferenced block without cached children;
        with priorities, the lowest-ranked candidate of the policy's victim's group."""
        if self.num_queues == 1 and not self._ranked:  # one heap: pop until a live entry
            heap, meta = self._heaps[0], self._meta
            while heap:
                _, _, version, block = heapq.heappop(heap)
                m = meta.get(block)
                if m is None or m.version != version:
                    continue  # stale entry
                if m.refs or m.children:  # cannot happen (entries go stale first)
                    raise EvictionError(f"candidate {block!r} is in use or has cached children")
                self._drop(block, m)
                self._on_evict(block, m)
                return block
            raise NoEvictableBlock(f"none of {len(meta)} cached blocks is evictable")
        return self._evict_chosen()

    def _evict_chosen(self) -> Block:
        """Evict the policy's choice, within its group by priority when ranked."""
        block = self._choose()
        if self._ranked:
            block = self._choose_in_group(block)
        m = self._meta[block]
        if m.refs or m.children:  # cannot happen (entries go stale first); never evict one
            raise EvictionError(f"candidate {block!r} is in use or has cached children")
        self._drop(block, m)
        self._on_evict(block, m)
        return block

    def _choose(self) -> Block:
        """The policy's own next victim, left in place (stale heap tops are discarded)."""
        q = self._pick_queue()
        if q is None:
            raise NoEvictableBlock(f"none of {len(self._meta)} cached blocks is evictable")
        return self._heaps[q][0][-1]

    def _choose_in_group(self, victim: Block) -> Block:
        """Among the candidates of ``victim``'s group, the lowest priority: ``victim`` itself
        when it is at that priority, else the first of that priority in the policy's order
        (the preferred queue first, then each queue's rank)."""
        m = self._meta[victim]
        best = None
        for q in self._queue_order():
            e = self._group_top(m.group, q)
            if e is not None and (best is None or e[0] < best[0]):
                best = e
        return victim if best is None or best[0] >= m.prio else best[-1]

    def _queue_order(self) -> list[int]:
        """The queues in the order the policy would take victims from them now."""
        return list(range(self.num_queues))

    def _group_top(self, group, q: int):
        """The live top entry of ``group``'s heap for queue ``q`` (None: no candidate there)."""
        heap = self._gheaps.get((group, q))
        if not heap:
            return None
        meta = self._meta
        while heap:
            e = heap[0]
            m = meta.get(e[-1])
            if m is not None and m.version == e[-2] and m.queue == q:
                return e
            heapq.heappop(heap)
        return None

    def _enable_ranking(self) -> None:
        """The first non-default priority: from now on every candidate is also kept in its
        group's structure; the current ones enter it now."""
        self._ranked = True
        for b, m in list(self._meta.items()):
            if m.refs == 0 and m.children == 0:
                self._offer(b, m)

    def evict_block(self, block: Block) -> None:
        """Evict ``block``, a candidate another ranking chose (``AdaptivePolicy``), as ``evict``
        would have: ghosts and statistics learn from it."""
        m = self._get(block)
        if m.refs or m.children:
            raise EvictionError(f"block {block!r} is in use or has cached children")
        self._drop(block, m)
        self._on_evict(block, m)

    def remove(self, block: Block) -> None:
        """Drop a cached block on the owner's decision: it must be a candidate."""
        m = self._get(block)
        if m.refs or m.children:
            raise EvictionError(f"block {block!r} is in use or has cached children")
        self._drop(block, m)

    def forget(self, block: Block) -> None:
        """Drop ``block`` whatever its references and children (the engine's invalidation: its
        key is gone, its users keep the memory until they release it, outside the policy). Its
        cached children become roots. Not an eviction: no ghost is kept."""
        m = self._get(block)
        if m.refs or m.held_below:
            self._held_changed(m, -1)  # stops counting as held, here and above
        self._withdraw(m)
        m.children = 0
        self._drop(block, m)
        m.gone = True  # children find their parent gone (``parent_meta``): they are roots

    def access(self, path: Sequence[Block]) -> int:
        """One request over ``path`` (root first), as the simulator drives it: returns how many
        leading blocks were cached (the hit), touches them, inserts the rest and marks the tail.
        References are the caller's (``acquire``/``release``); nothing is evicted here."""
        self.tick()
        hit = 0
        for b in path:
            if b not in self:
                break
            hit += 1
        for i in range(hit):
            self.touch(path[i])
        for i in range(hit, len(path)):
            self.insert(path[i], path[i - 1] if i else None)
        if path:
            for b in path[:-1]:
                if self.is_tail(b):
                    self.mark_tail(b, False)
            self.mark_tail(path[-1], True)
        return hit

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The forest, the held counts, the queue sizes and the candidates agree (tests, the
        engine's ``check_integrity``). O(n log n)."""
        meta = self._meta
        children: dict[int, int] = {}
        held_below: dict[int, int] = {}
        sizes = [0] * self.num_queues
        for b, m in meta.items():
            assert m.block == b and not m.gone, f"record of {b!r} is not its own"
            pm = self.parent_meta(m)
            if pm is not None:
                assert meta.get(pm.block) is pm, f"parent of {b!r} is not cached"
                assert m.depth == pm.depth + 1, f"depth of {b!r}"
                children[id(pm)] = children.get(id(pm), 0) + 1
                if m.refs or m.held_below:
                    held_below[id(pm)] = held_below.get(id(pm), 0) + 1
            sizes[m.queue] += 1
        for b, m in meta.items():
            assert m.children == children.get(id(m), 0), f"children of {b!r}"
            assert m.held_below == held_below.get(id(m), 0), f"held count below {b!r}"
            assert m.refs >= 0
        held = sum(1 for m in meta.values() if m.refs or m.held_below)
        assert held == self._num_held, f"{self._num_held} counted held, {held} are"
        assert sizes == self._sizes, f"queue sizes {self._sizes}, counted {sizes}"
        self._check_candidates({b for b, m in meta.items() if m.refs == 0 and m.children == 0})

    def _check_candidates(self, cands: set) -> None:
        live = set()
        for q, heap in enumerate(self._heaps):
            for entry in heap:
                m = self._meta.get(entry[-1])
                if m is not None and m.version == entry[-2] and m.queue == q:
                    live.add(entry[-1])
        assert live == cands, f"heap candidates {len(live)}, unreferenced leaves {len(cands)}"
        if self._ranked:
            glive = set()
            for (g, q), heap in self._gheaps.items():
                for e in heap:
                    m = self._meta.get(e[-1])
                    if m is not None and m.version == e[-2] and m.queue == q:
                        assert m.group == g and m.prio == e[0], f"group entry of {e[-1]!r}"
                        glive.add(e[-1])
            assert glive == cands, f"group candidates {len(glive)}, candidates {len(cands)}"

    # ---- internals ---------------------------------------------------------------------------
    def _get(self, block: Block) -> _Meta:
        m = self._meta.get(block)
        if m is None:
            raise EvictionError(f"block {block!r} is not cached")
        return m

    @staticmethod
    def parent_meta(m: _Meta) -> _Meta | None:
        pm = m.pmeta
        if pm is not None and pm.gone:
            m.pmeta = pm = None  # its parent was forgotten: a root from now on
        return pm

    def _held_changed(self, m: _Meta, d: int) -> None:
        """``m`` became held (+1) or stopped being held (-1); tell its ancestors."""
        while True:
            self._num_held += d
            pm = self.parent_meta(m)
            if pm is None:
                return
            was = bool(pm.refs or pm.held_below)
            pm.held_below += d
            if was == bool(pm.refs or pm.held_below):  # its own state did not change
                return
            m = pm

    def _touch(self, block: Block, m: _Meta) -> None:
        m.hits += 1
        m.last = self._clock
        m.stamp = self._stamp
        self._on_touch(block, m)
        if m.refs == 0 and m.children == 0:
            self._offer(block, m)
        elif self.num_queues > 1:  # no heap entry to renew; its queue may change (hits)
            q = self._rank(m)[0]
            if q != m.queue:
                self._sizes[m.queue] -= 1
                self._sizes[q] += 1
                m.queue = q

    def _withdraw(self, m: _Meta) -> None:
        m.version = next(self._seq)

    def _offer(self, block: Block, m: _Meta) -> None:
        """(Re)enter ``block`` in its heap if it is a candidate; its old entry goes stale."""
        m.version = next(self._seq)
        q, key = self._rank(m)
        if q != m.queue:
            self._sizes[m.queue] -= 1
            self._sizes[q] += 1
            m.queue = q
        if m.refs == 0 and m.children == 0:
            self._push(block, m, q, key)

    def _push(self, block: Block, m: _Meta, q: int, key) -> None:
        """Enter a candidate in heap ``q`` at ``key`` (and in its group's, when ranked)."""
        heap = self._heaps[q]
        heapq.heappush(heap, (key, -m.depth, m.version, block))
        if len(heap) > 2 * len(self._meta) + 64:
            self._compact(q)
        if self._ranked:
            gk = (m.group, q)
            gheap = self._gheaps.get(gk)
            if gheap is None:
                gheap = self._gheaps[gk] = []
            heapq.heappush(gheap, (m.prio, key, -m.depth, m.version, block))
            if len(gheap) > 2 * self._gsizes.get(m.group, 0) + 64:
                self._compact_group(gk)

    def _compact(self, q: int) -> None:
        """Drop the stale entries of heap ``q`` (amortized O(1) a push: the heap never holds
        more than about twice the live entries, however long nothing is evicted)."""
        meta = self._meta
        live = []
        for entry in self._heaps[q]:
            m = meta.get(entry[-1])
            if m is not None and m.version == entry[-2] and m.queue == q:
                live.append(entry)
        heapq.heapify(live)
        self._heaps[q] = live

    def _compact_group(self, gk: tuple) -> None:
        meta, q = self._meta, gk[1]
        live = [e for e in self._gheaps[gk]
                if (m := meta.get(e[-1])) is not None and m.version == e[-2] and m.queue == q]
        if live:
            heapq.heapify(live)
            self._gheaps[gk] = live
        else:
            del self._gheaps[gk]

    def _drop(self, block: Block, m: _Meta) -> None:
        del self._meta[block]
        n = self._gsizes[m.group] - 1
        if n:
            self._gsizes[m.group] = n
        else:  # the group's last block: its structures go too (groups come and go)
            del self._gsizes[m.group]
            for q in range(self.num_queues):
                self._gheaps.pop((m.group, q), None)
        self._sizes[m.queue] -= 1
        m.version = next(self._seq)
        pm = self.parent_meta(m)
        if pm is not None:
            pm.children -= 1
            if pm.children == 0:
                self._offer(pm.block, pm)

    def _top_valid(self, q: int) -> bool:
        """Whether heap ``q`` has a live candidate (stale tops are popped on the way)."""
        heap = self._heaps[q]
        meta = self._meta
        while heap:
            _, _, version, block = heap[0]
            m = meta.get(block)
            if m is not None and m.version == version and m.queue == q:
                return True
            heapq.heappop(heap)
        return False

    def _pick_queue(self) -> int | None:
        return 0 if self._top_valid(0) else None

    def _rank(self, m: _Meta) -> tuple[int, object]:
        return 0, m.stamp

    def _on_insert(self, block: Block, m: _Meta) -> None:
        pass

    def _on_touch(self, block: Block, m: _Meta) -> None:
        pass

    def _on_evict(self, block: Block, m: _Meta) -> None:
        pass


class LRUPolicy(EvictionPolicy):
    """Least recently used first; among blocks touched together the deeper one."""

    name = "lru"


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
        self.members = [make_policy(n, capacity) for n in self.MEMBERS]
        mini_cap = None if capacity is None else max(1, capacity // self.rate)
        self.minis = [make_policy(n, mini_cap) for n in self.MEMBERS]
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


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """An online policy by name (``POLICY_NAMES``)."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "lru-demote":
        return DemotePolicy(capacity)
    if name == "hit-density":
        return HitDensityPolicy(capacity)
    if name == "adaptive":
        return AdaptivePolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def parse_policies(spec: str, offline: bool = True) -> list[str]:
    """``"all"`` or comma-separated names → the list, in a stable order; belady is offline."""
    names = list(POLICY_NAMES) + (["belady"] if offline else [])
    if spec.strip() == "all":
        return names
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if part not in names:
            raise ValueError(f"unknown eviction policy {part!r}; choose from "
                             f"{', '.join(names)} or all")
        if part not in out:
            out.append(part)
    if not out:
        raise ValueError("no eviction policy given")
    return out
