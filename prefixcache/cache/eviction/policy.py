"""The base every eviction policy shares: the forest of cached prefix blocks, references,
candidate heaps, the held counts, and retention priority within a group. A policy (one module
each: ``lru.py``, ``lru_demote.py``, ``hit_density.py``, ``adaptive.py``) ranks the candidates.

Invariants every policy keeps (checked by the tests):

- **never a block in use**: ``acquire``/``release`` count references; a block with a
  reference is not a candidate;
- **leaves before parents**: a block with a cached child is not a candidate (a child is useless
  without its parent, so evicting the parent first would strand it);
- ties go to the deeper block (the tail of a prompt first), as the engine's LRU does.

Candidates (unreferenced leaves) live in binary heaps with lazy deletion: each block carries a
version, a heap entry whose version is stale is skipped when it reaches the top. Every operation
is O(log n) amortized.

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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Sequence

from prefixcache.api.request import DEFAULT_RETENTION_PRIORITY

Block = Hashable


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
