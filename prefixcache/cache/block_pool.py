"""Block pool: ref counts, the free list, and eviction of cached blocks through an eviction
policy (docs/design.md §4). What keeps blocks beyond their references, owners' pins and
retention deadlines, is decided in cache/holds.py; the pool tells the policy.

    free ──allocate──▶ in use (ref ≥ 1) ──last ref released──▶ cached (ref 0) ──evict──▶ free
                              ▲                                   │
                              └──── cache hit (acquire): ref 0 → 1 ─┘

Every block is either free (``_free``: ref 0, no key), cached (ref 0, a key in the index), or
in use (ref ≥ 1, with or without a key). Every block with a key, in use or not, is known to the
eviction policy (``cache/eviction/``, the same classes the trace simulator runs) under its
*key*, as a child of the block before it in its prompt; a pin counts there as one more
reference. The policy picks the victims: never a block in use or pinned, never a block with a
cached child (leaves go first), the deeper block on ties. Allocation takes free blocks first and
asks the policy for a victim only when none are left.

Retention priorities: each indexed block belongs to a *group* (the engine's: the tenant whose
namespace it is in; a shared namespace is a group of its own) and may be ranked 0-100 for a
while (``set_retention``; a deadline on the pool's clock, as pins). The policy evicts its own
victim's group's lowest-ranked candidate first (``cache/eviction/policy.py``), so a group's ranks
decide which of *its* blocks go, never whose.

Time for the policy: one tick per admitted request (``tick``, from the cache manager: hit
density's ages count requests, as in the trace simulator), and a block's recency is its last
use, its release included; blocks released together are one use, and among them the deeper
goes first (a sequence's tail before its head). With ``lru`` that is exactly the order of the
OrderedDict LRU the pool had before (oldest release first, tail before head).

Pure Python, no tensors: block ids index the KV tensors owned by ``kv/pool.py``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prefixcache.api.keys import BlockHash
from prefixcache.api.request import DEFAULT_RETENTION_PRIORITY
from prefixcache.cache.eviction import EvictionPolicy, make_policy
from prefixcache.cache.holds import PinHolds, RankDeadlines
from prefixcache.cache.prefix_index import PrefixIndex, PrefixMatch


@dataclass(frozen=True)
class PoolCounts:
    free: int
    cached: int
    in_use: int
    pinned: int
    total: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, max_pinned_blocks: int | None = None,
                 eviction_policy: str = "lru"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_pinned_blocks = num_blocks if max_pinned_blocks is None else max_pinned_blocks
        self.index = PrefixIndex(block_size)
        # The keys of every indexed block (in use or cached), as a forest; a pin is a reference.
        self.policy: EvictionPolicy = make_policy(eviction_policy, num_blocks)
        self.eviction_policy = eviction_policy
        self._ref = [0] * num_blocks
        self._num_in_use = 0
        self._free: deque[int] = deque(range(num_blocks))
        # Owners' pins and retention deadlines (cache/holds.py): the pool tells the policy
        # what they decide (a pin is one more reference there).
        self.pins = PinHolds(self.max_pinned_blocks)
        self.rank_deadlines = RankDeadlines()
        self.evicted_blocks = 0
        # Told of each block that leaves the index (evicted; invalidated, in use or not): the
        # window parts (cache/window.py) give its idle part back. None: nobody listens.
        self.on_forget: Callable[[int], None] | None = None

    # ---- queries ----------------------------------------------------------------------------
    def counts(self) -> PoolCounts:
        free = len(self._free)
        cached = self.num_blocks - free - self._num_in_use
        return PoolCounts(free, cached, self._num_in_use, len(self.pins), self.num_blocks)

    @property
    def num_allocatable(self) -> int:
        """Blocks an allocation can take now: free ones plus the cached ones the policy can
        evict before it runs out (unreferenced, unpinned, with no such block below them)."""
        return len(self._free) + self.policy.num_reclaimable

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_evictable(self, block_id: int) -> bool:
        """Cached and reclaimable by eviction: counted in ``num_allocatable``."""
        key = self.index.key_of(block_id)
        return key is not None and self.policy.is_reclaimable(key)

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are ``is_evictable`` (an admission's hits that it takes out
        of ``num_allocatable``)."""
        reclaimable = self.policy.is_reclaimable
        return sum(1 for k in self.index.keys_of(block_ids) if k is not None and reclaimable(k))

    def match(self, keys: Sequence[BlockHash], token_ids: Sequence[int], root: BlockHash) -> PrefixMatch:
        """Cached leading blocks of a prompt. Does not modify the pool; acquire before allocating."""
        return self.index.match(keys, token_ids, root)

    def match_tokens(
        self, token_ids: Sequence[int], root: BlockHash, num_tokens: int | None = None
    ) -> PrefixMatch:
        """``match`` of ``token_ids[:num_tokens]``, hashing its chain from ``root`` while walking
        (stops hashing at the first miss). Does not modify the pool."""
        return self.index.match_tokens(token_ids, root, num_tokens)

    # ---- lifecycle --------------------------------------------------------------------------
    def tick(self) -> None:
        """A request begins to use the cache (the manager's admission): one tick of the
        eviction policy's clock."""
        self.policy.tick()

    def acquire(self, block_ids: Iterable[int], touch: bool = True) -> None:
        """Take a reference on cached or in-use blocks. ``touch``: a use of their content (a
        cache hit), else only a hold (a connector keeping a prefix while it extends it)."""
        ids = list(block_ids)
        keys = self.index.keys_of(ids)
        ref = self._ref
        for b, key in zip(ids, keys):
            if ref[b] == 0:
                if key is None:
                    raise AssertionError(f"acquire of block {b} that is free (not cached)")
                self._num_in_use += 1
            ref[b] += 1
        self.policy.acquire_all([k for k in keys if k is not None], touch)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ref 1, or None (and no change) if fewer can be had."""
        if n > self.num_allocatable:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                key = self.policy.evict()
                b = self.index.entry(key).block_id
                self.index.remove_block(b, evicted=True)
                self.rank_deadlines.forget(key)
                self.evicted_blocks += 1
                if self.on_forget is not None:
                    self.on_forget(b)
            self._ref[b] = 1
            out.append(b)
        self._num_in_use += n
        return out

    def register(
        self,
        block_id: int,
        key: BlockHash,
        parent: BlockHash,
        token_ids: Sequence[int],
        namespace: str | None,
        parent_block: int | None = None,
        group=None,
    ) -> int | None:
        """Make a full, computed, in-use block findable by its key. Returns the block holding it
        (None: the key collides with other content, see ``PrefixIndex.insert``).

        For the eviction policy the block is a child of the cached block whose key is
        ``parent``, or, where ``parent`` names no block (the join after a shared prefix), of
        ``parent_block`` (the block before it in the caller's table) if that one is indexed.
        ``group``: whose block it is, for retention priorities (``set_retention``)."""
        assert self._ref[block_id] >= 1, "only in-use blocks are registered"
        holder = self.index.insert(key, block_id, parent, token_ids, namespace)
        if holder == block_id:
            policy = self.policy
            if parent in policy:
                pkey: BlockHash | None = parent
            else:
                pkey = None if parent_block is None else self.index.key_of(parent_block)
            policy.insert(key, pkey, held=True, group=group)
            for _ in range(self._ref[block_id] - 1):
                policy.acquire(key)
        return holder

    def release(self, block_ids: Sequence[int], tail: bool = True) -> None:
        """Drop one reference on each block: one use (released together, the deeper block goes
        first, so a sequence's tail is evicted before its head). ``tail``: ``block_ids`` is a
        request's block table, its last cached block ends its path (the policies rank such
        prompt ends apart); False for a hold (``acquire(touch=False)``)."""
        ids = block_ids[::-1]
        keys = self.index.keys_of(ids)
        ref, free = self._ref, self._free
        for b, key in zip(ids, keys):
            assert ref[b] > 0, f"release of block {b} with ref 0"
            ref[b] -= 1
            if ref[b] == 0:
                self._num_in_use -= 1
                if key is None:
                    free.append(b)
        self.policy.release_all([k for k in keys if k is not None], tail)

    # ---- retention priorities -----------------------------------------------------------------
    def set_retention(
        self, block_ids: Iterable[int], priority: int, until: float | None, group
    ) -> int:
        """Rank the cached blocks among ``block_ids`` that belong to ``group`` at ``priority``
        until ``until`` (the pool's clock; None: while they stay cached), then back at the
        default; the last call for a block wins. Blocks of another group are left as they are:
        a request ranks only its own tenant's blocks. Returns the blocks ranked."""
        policy, keys = self.policy, self.index.keys_of(block_ids)
        n = 0
        for key in keys:
            if key is None or policy.group(key) != group:
                continue
            policy.set_priority(key, priority)
            self.rank_deadlines.set(key, None if priority == DEFAULT_RETENTION_PRIORITY else until)
            n += 1
        return n

    def priority_of(self, block_id: int) -> int | None:
        """A cached block's retention priority (None: not cached)."""
        key = self.index.key_of(block_id)
        return None if key is None else self.policy.priority(key)

    def expire_ranks(self, now: float) -> int:
        """Retention priorities whose time ended go back to the default. Returns how many."""
        ended = self.rank_deadlines.expire(now)
        for key in ended:
            self.policy.set_priority(key, DEFAULT_RETENTION_PRIORITY)
        return len(ended)

    # ---- pins, invalidation (the bookkeeping and its rules: cache/holds.py) -----------------
    def set_pin_quotas(self, quotas: Mapping[str | None, int]) -> None:
        """``PinHolds.set_quotas``: owners not named are bound by the ceiling only."""
        self.pins.set_quotas(quotas)

    def pin_quota(self, owner: str | None) -> int | None:
        """Blocks ``owner`` may hold pinned (None: no quota of its own, only the ceiling)."""
        return self.pins.quota(owner)

    def pin(
        self,
        block_ids: Sequence[int],
        ttl_seconds: float | None,
        now: float | None = None,
        *,
        owner: str | None = None,
    ) -> int:
        """Keep cached blocks from eviction until the TTL ends (None: until unpinned).

        Raises ValueError if the pool's pin budget, or ``owner``'s quota (``set_pin_quotas``),
        would be exceeded; a failed call pins nothing. Returns the number of blocks that were
        not pinned before.
        """
        now = time.monotonic() if now is None else now
        for b in block_ids:  # validate all before pinning any: a failed call changes nothing
            if self.index.key_of(b) is None:
                raise ValueError(f"block {b} holds no cached content and cannot be pinned")
        deadline = float("inf") if ttl_seconds is None else now + ttl_seconds
        new = self.pins.pin(block_ids, deadline, owner)
        for b in new:  # a pin holds the block: one reference more
            self.policy.acquire(self.index.key_of(b))
        return len(new)

    def pinned_by(self, owner: str | None) -> int:
        """Blocks ``owner`` holds a pin on (what its quota is charged)."""
        return self.pins.pinned_by(owner)

    def expire_pins(self, now: float | None = None) -> int:
        """End the pins whose deadline passed; a block whose last pin ended becomes evictable
        (idle ones at the most recent end). Retention priorities whose time ended go back to
        the default too (``expire_ranks``). Returns the number of blocks unpinned."""
        now = time.monotonic() if now is None else now
        self.expire_ranks(now)
        unpinned = self.pins.expire(now)
        if not unpinned:
            return 0
        # One use for all of them: the blocks unpinned now rank as used now, deeper ones first.
        self.policy.release_all([self.index.key_of(b) for b in unpinned])
        return len(unpinned)

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> int:
        """Drop cached content of a namespace (or all). In-use blocks lose their key now and
        return to the free list when released. Returns the number of blocks dropped."""
        blocks = self.index.all_blocks() if all_namespaces else self.index.blocks_in_namespace(namespace)
        for b in blocks:
            if self.pins.unpin(b):  # the pin's reference in the policy
                self.policy.release(self.index.key_of(b))
            key = self.index.remove_block(b, evicted=False)
            self.rank_deadlines.forget(key)
            self.policy.forget(key)
            if self._ref[b] == 0:
                self._free.append(b)
            if self.on_forget is not None:  # (in use too: its key is gone either way)
                self.on_forget(b)
        return len(blocks)

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self, live_block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """free + cached + in use == total; the free list holds unindexed unreferenced blocks;
        the eviction policy knows exactly the indexed blocks, each with its references plus
        one for a pin, and its own state is consistent (``EvictionPolicy.check_integrity``);
        ref counts match live block tables."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate in free list"
        in_use = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert len(in_use) == self._num_in_use, "in-use count drifted"
        assert not (in_use & free), "referenced block is free"
        indexed = set(self.index.all_blocks())
        assert not (free & indexed), "free block still indexed"
        assert len(free) + len(in_use) + len(indexed - in_use) == self.num_blocks, "blocks lost"
        for b in free:
            assert self.index.key_of(b) is None, f"free block {b} still indexed"
        policy = self.policy
        assert len(policy) == len(indexed), "policy and index hold different blocks"
        for b in indexed:
            key = self.index.key_of(b)
            assert key in policy, f"cached block {b} unknown to the eviction policy"
            want = self._ref[b] + (b in self.pins)
            assert policy.refs(key) == want, f"block {b}: policy refs {policy.refs(key)} != {want}"
        self.pins.check_integrity(indexed)
        self.rank_deadlines.check_integrity(policy)
        policy.check_integrity()
        self.index.check_integrity()
        if live_block_tables is not None:
            expected = [0] * self.num_blocks
            for table in live_block_tables:
                for b in table:
                    expected[b] += 1
            for b in range(self.num_blocks):
                assert expected[b] == self._ref[b], (
                    f"block {b}: ref {self._ref[b]} but {expected[b]} live references"
                )
