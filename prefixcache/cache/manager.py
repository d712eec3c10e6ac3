"""KV cache manager: maps a sequence's tokens onto blocks of the pool (no torch).

It owns the policy that joins the hash chain to the block pool:
- a prompt is matched on its first ``len - 1`` tokens, so a fully cached prompt still computes
  its last token (the logits are needed) into a private block, never into a shared one;
- after each step, the newly completed full blocks of a sequence are hashed (incrementally,
  extending the chain) and registered, so they are hits for others at once (chunked prefill,
  decode);
- when another request already registered the same key, the sequence swaps its private copy for
  the shared one, so equal content is held once.

A request may declare a shared prefix (``KeyScope``, from ``request.SharedPrefix``): its first
whole blocks are keyed in a shared namespace and every later block in its own, the chain going
on through ``hashing.join_hash``. Matching walks the shared run, then the owner's run; an
explanation scans siblings only where the caller's own chain is (the shared run is public by
declaration, the owner's run holds its blocks alone), so nothing it says reaches past the
shared part into another owner's blocks.

Token-exact reuse (``partial_reuse``): after the cached full blocks, a match goes on into the
next block when a cached block of the sequence's own namespace, a child of the last one hit,
starts with the prompt's next tokens (``PrefixIndex.longest_child``): those tokens' K/V are
copied into the sequence's own fresh block instead of being computed, so the hit is the true
common prefix, not its floor to a block. The manager only plans the copy (``BlockCopy``,
holding a reference on the source so nothing evicts it); the engine has it done by the model
runner (``copy_partial_blocks``) before the step's forward. A cold run computes the same bits
for those tokens (their K/V depend only on the tokens up to them, and the exact path is batch
invariant), so cold == warm still holds bit for bit. Not inside a declared shared prefix:
copying a block token by token would let a tenant test guesses of another's shared block one
token at a time; a whole-block hit needs all of its tokens.

Retention priorities (``request.RetentionPriority``, and a cache lease's implied one): the
blocks a sequence hits or registers in its own namespace are ranked for it, as blocks of its
tenant's group (``group_of``); a shared prefix's blocks are a group of their own, which no
request ranks.

With caching disabled the manager is ``NoCaching`` (``kv_cache_manager`` picks it): every
match is empty, nothing is registered, an explanation says caching is off; allocation and
freeing are the same, so the rest of the engine runs unchanged.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from prefixcache.api.request import CacheExplanation, SharedPrefix
from prefixcache.cache.block_pool import BlockPool, PoolCounts
from prefixcache.cache.hashing import (
    KEY_BYTES,
    BlockHash,
    block_chunks,
    chain_keys,
    hash_blocks,
    hash_blocks_after_shared,
    join_hash,
    root_hash,
)
from prefixcache.cache.prefix_index import PrefixMatch
from prefixcache.cache.window import WindowParts
from prefixcache.sequence import SeqKV, Sequence


@dataclass(frozen=True)
class CacheCounters:
    query_tokens: int
    hit_tokens: int


@dataclass(frozen=True)
class KeyScope:
    """Where a prompt's blocks are keyed: blocks 0..shared_blocks-1 in ``shared_namespace``'s
    chain, every later block in ``namespace``'s (the owner's), after the join."""

    namespace: str | None
    shared_namespace: str | None = None
    shared_blocks: int = 0


# Joins -> the shared key they follow, remembered for the KV events (a subscriber sees block
# k's parent as block k-1, as in any chain); bounded, a forgotten one is sent as it is.
MAX_JOINS = 65536

# Roots are cached per namespace to save one hash per request; the cache is bounded because
# every cache_salt is a namespace, and salts are chosen by clients. Hits do not reorder it: the
# server hashes request-log keys outside the engine lock, and insertion is the only mutation.
MAX_CACHED_ROOTS = 4096


# Namespaces an admin's explanation of a miss examines at most (explain_in).
MAX_EXPLAIN_NAMESPACES = 1024


class BlockCopy(NamedTuple):
    """Copy the K/V of block ``src``'s first ``num_tokens`` tokens into block ``dst`` (its
    slots 0..num_tokens-1): a partial block reused token-exactly (with window parts, both
    blocks' parts are held until it ran: the window layers' are copied between them)."""

    src: int
    dst: int
    num_tokens: int


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_cache_manager(
    pool: BlockPool,
    model_fingerprint: str,
    enable_caching: bool = True,
    clock: Callable[[], float] = time.monotonic,
    partial_reuse: bool = True,
    window: WindowParts | None = None,
):
    """The manager for the config: ``KVCacheManager``, or ``NoCaching`` with caching off."""
    cls = KVCacheManager if enable_caching else NoCaching
    return cls(pool, model_fingerprint, clock, partial_reuse, window)


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    model_fingerprint: str,
    *,
    max_pinned_blocks: int | None = None,
    eviction_policy: str = "lru",
    enable_caching: bool = True,
    clock: Callable[[], float] = time.monotonic,
    partial_reuse: bool = True,
    window: WindowParts | None = None,
):
    """A block pool of ``num_blocks`` and its manager (``kv_cache_manager``): the engine's one
    way into the cache core, which it then uses only through the manager."""
    pool = BlockPool(num_blocks, block_size, max_pinned_blocks=max_pinned_blocks,
                     eviction_policy=eviction_policy)  # fmt: skip
    return kv_cache_manager(pool, model_fingerprint, enable_caching, clock, partial_reuse, window)


def shared_group(namespace: str | None) -> tuple:
    """The retention group of a shared namespace's blocks (never a tenant's name: a tuple)."""
    return ("shared", namespace)


class KVCacheManager:
    enable_caching = True

    def __init__(
        self,
        pool: BlockPool,
        model_fingerprint: str,
        clock: Callable[[], float] = time.monotonic,
        partial_reuse: bool = True,
        window: WindowParts | None = None,
    ):
        """``clock``: what retention priorities' ends are measured on (the engine's);
        ``partial_reuse``: token-exact matches (a partial block's tokens copied); ``window``:
        the window parts of a model with sliding-window layers (cache/window.py), whose holds
        this manager keeps: a sequence holds the parts of
        ``seq.kv.block_table[seq.kv.window_from:]``."""
        self.pool = pool
        self.window = window
        if window is not None:
            pool.on_forget = window.forget
        self.clock = clock
        self.partial_reuse = partial_reuse
        # id(seq) -> (seq, its planned copy), from admission until the copy ran or seq freed;
        # each holds a reference on its source block.
        self._copies: dict[int, tuple[Sequence, BlockCopy]] = {}
        self.partial_hit_tokens = 0  # of hit_tokens, those copied from partial blocks
        self.block_size = pool.block_size
        self.model_fingerprint = model_fingerprint
        self._roots: OrderedDict[str | None, BlockHash] = OrderedDict()
        self._joins: OrderedDict[BlockHash, BlockHash] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0
        # tenant -> [prompt tokens looked up, tokens hit]; tenants are named by the server's
        # keys (a bounded set), None for the offline API.
        self.by_tenant: dict[str | None, list[int]] = {}

    # ---- keys ----------------------------------------------------------------------------------
    def root(self, namespace: str | None) -> BlockHash:
        r = self._roots.get(namespace)
        if r is None:
            r = self._roots[namespace] = root_hash(
                self.model_fingerprint, namespace, block_size=self.block_size
            )
            if len(self._roots) > MAX_CACHED_ROOTS:
                self._roots.popitem(last=False)  # oldest first; a dropped root is one hash away
        return r

    def scope(
        self, namespace: str | None, shared: SharedPrefix | None, num_tokens: int
    ) -> KeyScope:
        """The scope of a prompt of ``num_tokens`` tokens in ``namespace`` declaring ``shared``:
        its whole blocks within the declared prefix (and the prompt) are shared. A shared
        prefix in the request's own namespace, or shorter than a block, shares nothing."""
        if shared is None or shared.namespace == namespace:
            return KeyScope(namespace)
        k = min(shared.num_tokens, num_tokens) // self.block_size
        return KeyScope(namespace, shared.namespace, k) if k else KeyScope(namespace)

    def scope_of(self, seq: Sequence) -> KeyScope:
        return KeyScope(seq.namespace, seq.kv.shared_namespace, seq.kv.num_shared_blocks)

    def first_root(self, scope: KeyScope) -> BlockHash:
        """The parent of block 0."""
        return self.root(scope.shared_namespace if scope.shared_blocks else scope.namespace)

    def new_state(self, scope: KeyScope) -> SeqKV:
        """A new sequence's cache state (``Sequence.kv``, this manager's alone to write), keyed
        in ``scope``."""
        return SeqKV(self.first_root(scope), scope.shared_namespace, scope.shared_blocks)

    @staticmethod
    def restrict(seq: Sequence, max_registered_blocks: int | None, reserve_until: int,
                 scratch_tokens: int = 0) -> None:  # fmt: skip
        """At arrival, for a connector that fills some of ``seq``'s KV itself (segments): only
        its first ``max_registered_blocks`` full blocks may enter the index (None: all), its
        first ``reserve_until`` tokens' slots are allocated in one go, and ``scratch_tokens``
        tokens of temporary blocks are held with them until ``release_scratch``
        (sequence.SeqKV)."""
        seq.kv.max_registered_blocks = max_registered_blocks
        seq.kv.reserve_until = reserve_until
        seq.kv.scratch_tokens = scratch_tokens

    def _scratch_missing(self, seq: Sequence) -> int:
        """Scratch blocks ``seq`` still needs allocated (sequence.SeqKV.scratch_tokens)."""
        if seq.kv.scratch_done or not seq.kv.scratch_tokens:
            return 0
        return blocks_needed(seq.kv.scratch_tokens, self.block_size) - len(seq.kv.scratch)

    def release_scratch(self, seq: Sequence) -> None:
        """The connector is done with ``seq``'s scratch blocks: back to the free list (never
        registered: nothing of them is cached). Until a preemption re-arms the need."""
        self.pool.release(seq.kv.scratch, tail=False)
        seq.kv.scratch = []
        seq.kv.scratch_done = True

    def join(self, shared_key: BlockHash, namespace: str | None) -> BlockHash:
        j = join_hash(shared_key, self.root(namespace))
        self._joins[j] = shared_key
        if len(self._joins) > MAX_JOINS:
            self._joins.popitem(last=False)
        return j

    def event_parent(self, parent: BlockHash, namespace: str | None) -> BlockHash | None:
        """A registered block's parent as the KV events show it: None for a namespace's root,
        the last shared block for a join, else the key itself."""
        if parent == self.root(namespace):
            return None
        return self._joins.get(parent, parent)

    def keys_for(
        self, token_ids: list[int], namespace: str | None, shared: SharedPrefix | None = None
    ) -> list[BlockHash]:
        return self.keys_in(token_ids, self.scope(namespace, shared, len(token_ids)))

    def keys_in(self, token_ids: list[int], scope: KeyScope) -> list[BlockHash]:
        """Keys of the full blocks of ``token_ids`` in ``scope``."""
        own = self.root(scope.namespace)
        if not scope.shared_blocks:
            return hash_blocks(token_ids, self.block_size, own)
        shared = self.root(scope.shared_namespace)
        return hash_blocks_after_shared(token_ids, self.block_size, shared, scope.shared_blocks, own)

    def parent_of(self, seq: Sequence, i: int) -> BlockHash:
        """The parent key of block ``i`` of ``seq`` (its keys up to ``i - 1`` are hashed)."""
        if i == 0:
            return seq.kv.root
        if i == seq.kv.num_shared_blocks:
            if seq.kv.join is None:
                seq.kv.join = self.join(seq.kv.block_keys[i - 1], seq.namespace)
            return seq.kv.join
        return seq.kv.block_keys[i - 1]

    def extend_keys(self, seq: Sequence, upto_tokens: int) -> None:
        """Hash the full blocks of ``seq`` among its first ``upto_tokens`` tokens (incremental)."""
        n_full = upto_tokens // self.block_size
        start = len(seq.kv.block_keys)
        if start >= n_full:
            return
        upto = n_full * self.block_size
        tokens = seq.prompt_token_ids if upto <= seq.num_prompt_tokens else seq.all_token_ids
        chunks = block_chunks(tokens, self.block_size, start, num_tokens=upto)
        k = seq.kv.num_shared_blocks
        if start < k < n_full:  # the chain crosses from the shared prefix into the owner's part
            seq.kv.block_keys.extend(chain_keys(chunks[: k - start], self.parent_of(seq, start)))
            chunks, start = chunks[k - start :], k
        seq.kv.block_keys.extend(chain_keys(chunks, self.parent_of(seq, start)))

    # ---- retention priorities ----------------------------------------------------------------
    @staticmethod
    def group_of(seq: Sequence, i: int):
        """The retention group of ``seq``'s block ``i``: the shared namespace's own within a
        declared shared prefix, else its tenant's."""
        if i < seq.kv.num_shared_blocks:
            return shared_group(seq.kv.shared_namespace)
        return seq.tenant

    def rank(
        self,
        seq: Sequence,
        block_ids: list[int],
        priority: int,
        seconds: float | None,
        now: float | None = None,
    ) -> int:
        """Rank ``block_ids`` (blocks of ``seq``) of its tenant's group at ``priority`` for
        ``seconds`` from ``now`` (default: the clock's; None: while cached); blocks of a shared
        prefix are left alone."""
        if seconds is None:
            until = None
        else:
            until = (self.clock() if now is None else now) + seconds
        return self.pool.set_retention(block_ids, priority, until, seq.tenant)

    def _rank_own(self, seq: Sequence, block_ids: list[int]) -> None:
        r = seq.request.retention_priority
        if r is not None and block_ids:
            self.rank(seq, block_ids, r.priority, r.seconds)

    # ---- matching ------------------------------------------------------------------------------
    def _match(self, keys: list[BlockHash], token_ids: list[int], scope: KeyScope) -> PrefixMatch:
        """``pool.match`` of a chain that may cross from a shared prefix into its owner's part:
        the shared run from the shared root, then (when all of it is cached) the owner's run
        from the join. No side effects."""
        k = scope.shared_blocks
        root = self.first_root(scope)
        if not k or len(keys) <= k:
            return self.pool.match(keys, token_ids, root)
        head = self.pool.match(keys[:k], token_ids, root)
        if len(head.block_ids) < k:
            return head
        b = self.block_size
        parent = join_hash(keys[k - 1], self.root(scope.namespace))
        tail = self.pool.match(keys[k:], token_ids[k * b :], parent)
        return PrefixMatch(head.block_ids + tail.block_ids, head.num_tokens + tail.num_tokens)

    def _partial(self, m: PrefixMatch, token_ids: list[int], usable: int, scope: KeyScope) -> PrefixMatch:
        """``m`` (whole blocks) continued token-exactly into the next block, then cut to what
        the window parts allow (``_in_window``). No side effects."""
        return self._in_window(self._continued(m, token_ids, usable, scope))

    def _in_window(self, m: PrefixMatch) -> PrefixMatch:
        """``m`` cut to its longest part a hit can use with window parts: the window layers'
        K/V of the blocks before it, back by a window, still held (cache/window.py); a partial
        block needs its part too."""
        w = self.window
        if w is None:
            return m
        k = w.usable_hit(m.block_ids)
        if k < len(m.block_ids) or (m.partial_block is not None and w.part_of(m.partial_block) is None):
            return PrefixMatch(m.block_ids[:k], k * self.block_size)
        return m

    def _continued(self, m: PrefixMatch, token_ids: list[int], usable: int, scope: KeyScope) -> PrefixMatch:
        """``m`` continued by the cached child of its last block, in the scope's own namespace,
        that shares the most of the prompt's next tokens (up to ``usable``)."""
        i = len(m.block_ids)
        start = i * self.block_size
        if not self.partial_reuse or i < scope.shared_blocks or start >= usable:
            return m
        index = self.pool.index
        if i == 0:
            parent = self.root(scope.namespace)
        elif i == scope.shared_blocks:
            parent = join_hash(index.key_of(m.block_ids[-1]), self.root(scope.namespace))
        else:
            parent = index.key_of(m.block_ids[-1])
        hit = index.longest_child(parent, token_ids[start : min(usable, start + self.block_size)])
        if hit is None or hit[0].namespace != scope.namespace:  # (the chain says it is ours)
            return m
        return PrefixMatch(m.block_ids, start + hit[1], hit[0].block_id)

    def match(self, seq: Sequence) -> PrefixMatch:
        """Cached leading tokens usable by ``seq`` now (capped at len - 1 tokens): whole blocks,
        then a partial one's tokens. No side effects."""
        usable = seq.num_tokens - 1
        self.extend_keys(seq, usable)
        n_full = usable // self.block_size
        scope = self.scope_of(seq)
        tokens = seq.all_token_ids
        m = self._match(seq.kv.block_keys[:n_full], tokens, scope)
        return self._partial(m, tokens, usable, scope)

    def match_prompt(self, token_ids: list[int], scope: KeyScope) -> PrefixMatch:
        """Cached leading full blocks of ``token_ids`` (all of them, not capped). No side effects."""
        return self._match(self.keys_in(token_ids, scope), token_ids, scope)

    def lookup(
        self, token_ids: list[int], namespace: str | None, shared: SharedPrefix | None = None
    ) -> int:
        """Tokens of this prompt a request would get from the cache now. No side effects."""
        if len(token_ids) < 2:
            return 0
        usable = len(token_ids) - 1
        scope = self.scope(namespace, shared, len(token_ids))
        if scope.shared_blocks:
            m = self._match(self.keys_in(token_ids[:usable], scope), token_ids, scope)
        else:  # hash and walk in one loop over the first len - 1 tokens; stops at the first miss
            m = self.pool.match_tokens(token_ids, self.root(namespace), usable)
        return self._partial(m, token_ids, usable, scope).num_tokens

    def num_new_blocks_for_admission(self, seq: Sequence, m: PrefixMatch, num_new_tokens: int) -> int:
        """Allocatable blocks an admission with this match would consume (hits on evictable
        blocks take them out of the LRU, so they count too; pinned ones are not allocatable)."""
        fresh = blocks_needed(m.num_tokens + num_new_tokens, self.block_size) - len(m.block_ids)
        held = m.block_ids if m.partial_block is None else [*m.block_ids, m.partial_block]
        idle_hits = self.pool.num_evictable(held)
        return fresh + idle_hits + self._scratch_missing(seq)

    def admit(self, seq: Sequence, m: PrefixMatch, num_new_tokens: int) -> bool:
        """Take the hit blocks and allocate room for ``num_new_tokens`` more; all or nothing.
        With window parts: hold the parts of the hit's blocks in its window (``m`` is cut to
        where they all are), and of the copy's source, and give the new blocks parts."""
        assert not seq.kv.block_table, "admit of a sequence that holds blocks"
        if self.num_new_blocks_for_admission(seq, m, num_new_tokens) > self.pool.num_allocatable:
            return False
        w = self.window
        held: list[int] = []
        if w is not None:
            lo = w.first_needed(m.num_tokens)
            held = m.block_ids[lo:] + ([] if m.partial_block is None else [m.partial_block])
            fresh = blocks_needed(m.num_tokens + num_new_tokens, self.block_size) - len(m.block_ids)
            if w.num_missing(held) + fresh > w.num_available:
                return False
        self.pool.tick()  # a request's use of the cache begins (the eviction policy's clock)
        self.pool.acquire(m.block_ids)
        if m.partial_block is not None:  # the copy's source: held until the copy has run
            self.pool.acquire([m.partial_block])
        if w is not None:
            ok = w.hold(held)
            assert ok, "window parts short after the admission check"
            seq.kv.window_from = lo
        self._rank_own(seq, m.block_ids)
        seq.kv.block_table = list(m.block_ids)
        seq.kv.num_registered_blocks = len(m.block_ids)
        seq.kv.num_computed_tokens = m.num_tokens
        ok = self.allocate_slots(seq, num_new_tokens)
        assert ok, "allocation failed after the admission check"
        partial = m.partial_tokens(self.block_size)
        if m.partial_block is not None:
            copy = BlockCopy(m.partial_block, seq.kv.block_table[len(m.block_ids)], partial)
            self._copies[id(seq)] = (seq, copy)
        if seq.cache.num_cached_tokens is None:  # first admission: what the user sees as cached
            seq.cache.num_cached_tokens = m.num_tokens
            self.query_tokens += seq.num_prompt_tokens
            self.hit_tokens += m.num_tokens
            self.partial_hit_tokens += partial
            mine = self.by_tenant.setdefault(seq.tenant, [0, 0])
            mine[0] += seq.num_prompt_tokens
            mine[1] += m.num_tokens
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more tokens; all or nothing. With
        window parts, first let go of the parts the sequence has computed past by a window
        (no later query of it reads them), then give each new block a part."""
        w = self.window
        if w is not None:
            self._slide(seq)
        need = blocks_needed(seq.kv.num_computed_tokens + num_new_tokens, self.block_size)
        extra = max(0, need - len(seq.kv.block_table))
        scratch = self._scratch_missing(seq)  # (never with window parts: segments refuse those)
        if extra + scratch <= 0:
            return True
        if w is not None and extra > w.num_available:
            return False
        new = self.pool.allocate(extra + scratch)
        if new is None:
            return False
        if scratch:
            seq.kv.scratch.extend(new[extra:])
            new = new[:extra]
        if w is not None:  # (evicting a block for these forgot its part: still available)
            ok = w.hold(new)
            assert ok, "window parts short after the check"
        seq.kv.block_table.extend(new)
        return True

    def _slide(self, seq: Sequence) -> None:
        lo = self.window.first_needed(seq.kv.num_computed_tokens)
        if lo > seq.kv.window_from:
            self.window.release(seq.kv.block_table[seq.kv.window_from : lo], self.is_cached)
            seq.kv.window_from = lo

    def is_cached(self, block_id: int) -> bool:
        return self.pool.index.key_of(block_id) is not None

    def part_of(self, block_id: int) -> int | None:
        """The window part holding ``block_id``'s window layers (None: none, or no parts)."""
        return None if self.window is None else self.window.part_of(block_id)

    def adopt_part(self, block_id: int) -> int | None:
        """A part for a cached block just restored from a tier (its window layers are then
        written into it); None without window parts, or when none can be had."""
        if self.window is None or self.window.part_of(block_id) is not None:
            return None
        return self.window.adopt(block_id)

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks computed so far (called after each step that ran ``seq``)."""
        n_full = seq.kv.num_computed_tokens // self.block_size
        if seq.kv.max_registered_blocks is not None:  # segment KV: never in the index
            n_full = min(n_full, seq.kv.max_registered_blocks)
        if seq.kv.num_registered_blocks >= n_full:
            return
        self.extend_keys(seq, n_full * self.block_size)
        tokens = seq.all_token_ids
        b = self.block_size
        for i in range(seq.kv.num_registered_blocks, n_full):
            mine = seq.kv.block_table[i]
            holder = self.pool.register(
                mine, seq.kv.block_keys[i], self.parent_of(seq, i), tokens[i * b : (i + 1) * b],
                seq.namespace_of_block(i), parent_block=seq.kv.block_table[i - 1] if i else None,
                group=self.group_of(seq, i),
            )
            if holder is None:  # a key collision: ours stays private, and so does the rest
                seq.kv.max_registered_blocks = n_full = i  # (their keys chain from this one)
                break
            if holder != mine:  # same content already cached: share it, give ours back
                self.pool.acquire([holder])
                seq.kv.block_table[i] = holder
                if self.window is not None and i >= seq.kv.window_from:
                    self._swap_part(mine, holder)
                self.pool.release([mine])
        self._rank_own(seq, seq.kv.block_table[seq.kv.num_registered_blocks : n_full])
        seq.kv.num_registered_blocks = n_full

    def _swap_part(self, mine: int, holder: int) -> None:
        """The sequence's hold on its private block's part, now on the cached ``holder`` of the
        same content: ``holder``'s own part if it has one, else ours moves to it (equal K/V)."""
        w = self.window
        if w.part_of(holder) is None:
            w.move(mine, holder)
        else:
            ok = w.hold([holder])
            assert ok, "a held or idle part always serves a hold"
            w.release([mine], lambda b: False)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of ``seq``'s first ``num_tokens`` tokens is in its blocks now (after a step's
        forward, or a connector's work: a segments assembly). With ``admit`` and ``free``, the
        only writer of ``num_computed_tokens``."""
        assert num_tokens <= len(seq.kv.block_table) * self.block_size, "computed past the blocks"
        seq.kv.num_computed_tokens = num_tokens

    def copy_partial_blocks(self, copy: Callable[[list[BlockCopy]], None]) -> int:
        """Have the planned copies of partial blocks done (``copy``: the model runner's
        ``copy_kv``; the engine calls this after scheduling, before the forward), then let go
        of their sources. Returns how many ran."""
        if not self._copies:
            return 0
        planned, self._copies = list(self._copies.values()), {}
        try:
            copy([c for _, c in planned])
        finally:
            if self.window is not None:
                self.window.release([c.src for _, c in planned], self.is_cached)
            self.pool.release([c.src for _, c in planned], tail=False)
        return len(planned)

    def check_window(self, seqs) -> None:
        """``WindowParts.check_integrity`` with every hold ``seqs`` (every live sequence) and the
        planned copies have; nothing without window parts."""
        if self.window is None:
            return
        holds = [b for s in seqs for b in s.kv.block_table[s.kv.window_from :]]
        holds += [c.src for _, c in self._copies.values()]
        self.window.check_integrity(set(self.pool.index.all_blocks()), holds)

    def copy_sources(self) -> list[list[int]]:
        """The blocks held for planned copies, as one-block tables (the references they hold,
        for ``check_integrity``)."""
        return [[c.src] for _, c in self._copies.values()]

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finish, abort, preemption); computed ones stay cached."""
        planned = self._copies.pop(id(seq), None)
        if self.window is not None:
            held = seq.kv.block_table[seq.kv.window_from :]
            held += [] if planned is None else [planned[1].src]
            self.window.release(held, self.is_cached)
            seq.kv.window_from = 0
        if planned is not None:  # admitted and freed before its copy ran: nothing to copy
            self.pool.release([planned[1].src], tail=False)
        self.pool.release(seq.kv.block_table)
        seq.kv.block_table = []
        if seq.kv.scratch:
            self.pool.release(seq.kv.scratch, tail=False)
        seq.kv.scratch = []
        seq.kv.scratch_done = False  # (a preempted connector's work starts over)
        seq.kv.num_registered_blocks = 0
        seq.kv.num_computed_tokens = 0

    def install(self, seq: Sequence, first: int, found: list[tuple[bytes, bytes, object]],
                write: Callable[[int, object, int | None], None]) -> list[tuple[int, bool]]:
        """Install blocks a tier restored for ``seq``: ``found[j]`` is the (key, key input,
        payload) of its block ``first + j``. RAM may have gained or lost blocks since the
        restore was asked for: what it holds now is matched first, and only the blocks that
        extend it are installed, each registered exactly as if computed (its payload written by
        ``write(block_id, payload, part)`` before it is findable; ``part``: None for the block,
        else the window part adopted for its window layers). Returns (block index, whether
        this payload is now cached: False where RAM had the block already) for each block of
        the chain now registered; stops at a key collision (nothing chained on it)."""
        b, pool = self.block_size, self.pool
        m = self.match(seq)
        have = len(m.block_ids)
        if have < first:
            return []  # part of the prefix was evicted meanwhile: the restored blocks cannot chain
        todo = found[have - first :]
        if not todo:
            return []
        out = []
        pool.acquire(m.block_ids, touch=False)  # our allocation must not evict the prefix
        try:
            ids = pool.allocate(min(len(todo), pool.num_allocatable)) or []
            tokens = seq.all_token_ids
            prev = m.block_ids[-1] if m.block_ids else None  # the block each one extends
            for i, (bid, (key, key_input, payload)) in enumerate(zip(ids, todo), start=have):
                write(bid, payload, None)  # (a bad payload raises before it is findable)
                holder = pool.register(
                    bid, key, key_input[:KEY_BYTES], tokens[i * b : (i + 1) * b],
                    seq.namespace_of_block(i), parent_block=prev, group=self.group_of(seq, i),
                )  # fmt: skip
                if holder is None:
                    break  # a key collision: nothing chained on it is installed
                prev = holder
                if holder == bid:  # else RAM had this one already; ours goes back free
                    part = self.adopt_part(bid)  # with window parts, where one can be had:
                    if part is not None:  # the window layers too (the rest again, the same bytes)
                        write(bid, payload, part)
                out.append((i, holder == bid))
            pool.release(ids, tail=False)
        finally:
            pool.release(m.block_ids, tail=False)
        return out

    # ---- the pool's facts and controls: nothing outside cache/ reaches the pool or the index -----
    @property
    def usable_blocks(self) -> int:
        """Blocks one request may ever hold: the pool less what pins may take."""
        return self.pool.num_blocks - self.pool.max_pinned_blocks

    @property
    def pin_budget_blocks(self) -> int:
        return self.pool.max_pinned_blocks

    @property
    def evicted_blocks(self) -> int:
        return self.pool.evicted_blocks

    def counts(self) -> PoolCounts:
        return self.pool.counts()

    def record_events(self) -> None:
        """Keep the index's stored/removed events from now on (for ``take_events``)."""
        self.pool.index.record_events()

    def take_events(self) -> list:
        return self.pool.index.take_events()

    def expire(self, now: float) -> None:
        """Drop the pins whose TTL has passed (each step, on the engine's clock)."""
        self.pool.expire_pins(now)

    def pin(self, block_ids: list[int], ttl: float, now: float, owner: str | None = None) -> None:
        """Pin cached blocks for ``ttl`` seconds, charged to ``owner``'s quota; ValueError
        (nothing pinned) over the quota or the budget."""
        self.pool.pin(block_ids, ttl, now, owner=owner)

    def pin_quota(self, owner: str | None) -> int | None:
        return self.pool.pin_quota(owner)

    def pinned_by(self, owner: str | None) -> int:
        return self.pool.pinned_by(owner)

    def set_pin_quotas(self, quotas: dict[str | None, int]) -> None:
        self.pool.set_pin_quotas(quotas)

    def namespaces(self) -> list[str | None]:
        """The namespaces holding cached blocks now (a set bounded by the pool)."""
        return self.pool.index.namespaces()

    def blocks_in_namespace(self, namespace: str | None) -> int:
        return self.pool.index.num_blocks_in_namespace(namespace)

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> int:
        """Drop a namespace's cached blocks (or every namespace's); returns how many."""
        return self.pool.invalidate(namespace, all_namespaces)

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """The pool's and the window parts' invariants, with every reference ``seqs`` (every
        live sequence) and the planned copies hold."""
        seqs = list(seqs)
        self.pool.check_integrity(
            [s.kv.block_table for s in seqs] + [s.kv.scratch for s in seqs] + self.copy_sources()
        )
        for s in seqs:
            assert not (s.kv.scratch and s.kv.scratch_done), "scratch held after its release"
            keys = self.pool.index.keys_of(s.kv.scratch)
            assert all(k is None for k in keys), "a scratch block is registered"
        self.check_window(seqs)

    # ---- explanation -----------------------------------------------------------------------------
    def explain(
        self,
        token_ids: list[int],
        namespace: str | None,
        other_namespaces,
        shared: SharedPrefix | None = None,
    ) -> CacheExplanation:
        """Why this prompt would (not) hit now. No side effects.

        Everything up to the "other namespace" check reads only keys of the prompt's own chain
        (its declared shared prefix, then ``namespace``'s part), so its answer does not depend
        on other namespaces: where the prompt diverges inside the shared prefix the answer is
        at a block's start (whole blocks, as a hit: no token of a shared block is told apart),
        and past it the siblings compared are blocks of ``namespace`` alone, whose chain no
        other owner reaches (the join). So ``diverged_at`` never reports past the shared part
        into blocks the caller does not own. Its cost is one bisection of the siblings
        (``PrefixIndex.longest_child``), not a scan. Only ``other_namespaces`` (empty unless
        the caller is an admin; at most ``MAX_EXPLAIN_NAMESPACES`` examined) looks elsewhere."""
        return self.explain_in(token_ids, self.scope(namespace, shared, len(token_ids)), other_namespaces)

    def explain_in(self, token_ids: list[int], scope: KeyScope, other_namespaces) -> CacheExplanation:
        """``explain`` of a prompt in ``scope``."""
        n = len(token_ids)
        b = self.block_size
        namespace = scope.namespace
        usable = max(n - 1, 0)
        keys = self.keys_in(token_ids[:usable], scope)
        whole = self._continued(self._match(keys, token_ids, scope), token_ids, usable, scope)
        m = self._in_window(whole)
        cached = m.num_tokens  # what a request gets: whole blocks, then a partial one's tokens
        if m.num_tokens < whole.num_tokens:  # the window layers' K/V of its blocks were evicted
            return CacheExplanation(cached, cached, "evicted")
        if len(m.block_ids) == len(keys):
            reason = "full_hit" if cached == usable else "partial_block"
            return CacheExplanation(cached, cached, reason)
        i = len(m.block_ids)
        # This exact block was cached before: the precise answer, even if a sibling diverges.
        if self.pool.index.was_evicted(keys[i]):
            return CacheExplanation(cached, cached, "evicted")
        if i == 0:
            parent = self.first_root(scope)
        elif i == scope.shared_blocks:
            parent = join_hash(keys[i - 1], self.root(namespace))
        else:
            parent = keys[i - 1]
        index = self.pool.index
        if i < scope.shared_blocks:
            # Inside a declared shared prefix: whole blocks only, as a hit (no partial reuse
            # there either). A token count into a shared block would let a tenant test a guess
            # of its content token by token; a miss at block 0 is no divergence at all.
            best = 0 if i else -1
        else:
            # The cached child sharing the most of the next block's tokens: one bisection of
            # the sorted children (PrefixIndex.longest_child), however many siblings there
            # are; a scan of them all let a tenant with thousands of one-block prompts stall
            # every step (issue #37).
            hit = index.longest_child(parent, token_ids[i * b : (i + 1) * b])
            best = hit[1] if hit is not None else (0 if index.has_children(parent) else -1)
        # Sharing no token at all with any cached prompt is not a divergence.
        if best > 0 or (best == 0 and i > 0):
            return CacheExplanation(cached, cached, "diverged", diverged_at=i * b + best)
        # Admins: would another namespace hit more? Only whole blocks count there, so at most
        # the first i + 1 blocks are hashed per namespace, and the walk stops at its first miss
        # (one hash for a namespace that does not share block 0); namespaces holding fewer
        # blocks are skipped unhashed, and at most MAX_EXPLAIN_NAMESPACES are examined: any
        # tenant can make namespaces (one per cache_salt), so their number is the tenants'.
        need = i + 1
        examined = 0
        for ns in other_namespaces:
            if ns == namespace or index.num_blocks_in_namespace(ns) < need:
                continue
            examined += 1
            if examined > MAX_EXPLAIN_NAMESPACES:
                break
            other = self.pool.match_tokens(token_ids, self.root(ns), need * b)
            if other.num_tokens > cached:
                return CacheExplanation(cached, cached, "other_namespace")
        return CacheExplanation(cached, cached, "no_prior_request")


class NoCaching(KVCacheManager):
    """Prefix caching off (``enable_prefix_caching=False``): nothing matches, nothing enters the
    index, and an explanation says why; blocks are allocated and freed as with caching."""

    enable_caching = False

    def match(self, seq: Sequence) -> PrefixMatch:
        return PrefixMatch([], 0)

    def lookup(self, token_ids: list[int], namespace: str | None, shared: SharedPrefix | None = None) -> int:
        return 0

    def commit(self, seq: Sequence) -> None:
        return

    def explain_in(self, token_ids: list[int], scope: KeyScope, other_namespaces) -> CacheExplanation:
        return CacheExplanation(0, 0, "caching_disabled")
