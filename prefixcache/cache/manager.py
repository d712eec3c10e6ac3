"""KV cache manager: maps a sequence's tokens onto blocks of the pool (no torch).

It owns the policy that joins the hash chain to the block pool:
- a prompt is matched on its first ``len - 1`` tokens, so a fully cached prompt still computes
  its last token (the logits are needed) into a private block, never into a shared one;
- after each step, the newly completed full blocks of a sequence are hashed (incrementally,
  extending the chain) and registered, so they are hits for others at once (chunked prefill,
  decode);
- when another request already registered the same key, the sequence swaps its private copy for
  the shared one, so equal content is held once.

With caching disabled the strategy object ``_NoCaching`` answers every match with nothing and
registers nothing; the rest of the code runs unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.hashing import BlockHash, block_chunks, chain_keys, hash_blocks, root_hash
from prefixcache.cache.prefix_index import PrefixMatch
from prefixcache.request import CacheExplanation
from prefixcache.sequence import Sequence


@dataclass(frozen=True)
class CacheCounters:
    query_tokens: int
    hit_tokens: int


# Roots are cached per namespace to save one hash per request; the cache is bounded because
# every cache_salt is a namespace, and salts are chosen by clients. Hits do not reorder it: the
# server hashes request-log keys outside the engine lock, and insertion is the only mutation.
MAX_CACHED_ROOTS = 4096


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, model_fingerprint: str, enable_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_fingerprint = model_fingerprint
        self.enable_caching = enable_caching
        self._roots: OrderedDict[str | None, BlockHash] = OrderedDict()
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

    def keys_for(self, token_ids: list[int], namespace: str | None) -> list[BlockHash]:
        return hash_blocks(token_ids, self.block_size, self.root(namespace))

    def extend_keys(self, seq: Sequence, upto_tokens: int) -> None:
        """Hash the full blocks of ``seq`` among its first ``upto_tokens`` tokens (incremental)."""
        n_full = upto_tokens // self.block_size
        if len(seq.block_keys) >= n_full:
            return
        start = len(seq.block_keys)
        parent = seq.block_keys[-1] if seq.block_keys else seq.root
        upto = n_full * self.block_size
        tokens = seq.prompt_token_ids if upto <= seq.num_prompt_tokens else seq.all_token_ids
        chunks = block_chunks(tokens, self.block_size, start, num_tokens=upto)
        seq.block_keys.extend(chain_keys(chunks, parent))

    # ---- matching ------------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixMatch:
        """Cached leading blocks usable by ``seq`` now (capped at len - 1 tokens). No side effects."""
        if not self.enable_caching:
            return PrefixMatch([], 0)
        usable = seq.num_tokens - 1
        self.extend_keys(seq, usable)
        n_full = usable // self.block_size
        return self.pool.match(seq.block_keys[:n_full], seq.all_token_ids, seq.root)

    def lookup(self, token_ids: list[int], namespace: str | None) -> int:
        """Tokens of this prompt a request would get from the cache now. No side effects."""
        if not self.enable_caching or len(token_ids) < 2:
            return 0
        # Hash and walk in one loop over the first len - 1 tokens; stops at the first miss.
        m = self.pool.match_tokens(token_ids, self.root(namespace), len(token_ids) - 1)
        return m.num_tokens

    def num_new_blocks_for_admission(self, seq: Sequence, m: PrefixMatch, num_new_tokens: int) -> int:
        """Allocatable blocks an admission with this match would consume (hits on evictable
        blocks take them out of the LRU, so they count too; pinned ones are not allocatable)."""
        fresh = blocks_needed(m.num_tokens + num_new_tokens, self.block_size) - len(m.block_ids)
        idle_hits = sum(1 for b in m.block_ids if self.pool.is_evictable(b))
        return fresh + idle_hits

    def admit(self, seq: Sequence, m: PrefixMatch, num_new_tokens: int) -> bool:
        """Take the hit blocks and allocate room for ``num_new_tokens`` more; all or nothing."""
        assert not seq.block_table, "admit of a sequence that holds blocks"
        if self.num_new_blocks_for_admission(seq, m, num_new_tokens) > self.pool.num_allocatable:
            return False
        self.pool.acquire(m.block_ids)
        seq.block_table = list(m.block_ids)
        seq.num_registered_blocks = len(m.block_ids)
        seq.num_computed_tokens = m.num_tokens
        ok = self.allocate_slots(seq, num_new_tokens)
        assert ok, "allocation failed after the admission check"
        if seq.num_cached_tokens is None:  # first admission: what the user sees as cached
            seq.num_cached_tokens = m.num_tokens
            self.query_tokens += seq.num_prompt_tokens
            self.hit_tokens += m.num_tokens
            mine = self.by_tenant.setdefault(seq.tenant, [0, 0])
            mine[0] += seq.num_prompt_tokens
            mine[1] += m.num_tokens
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more tokens; all or nothing."""
        need = blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        extra = need - len(seq.block_table)
        if extra <= 0:
            return True
        new = self.pool.allocate(extra)
        if new is None:
            return False
        seq.block_table.extend(new)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks computed so far (called after each step that ran ``seq``)."""
        if not self.enable_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        if seq.max_registered_blocks is not None:  # segment KV: never in the index
            n_full = min(n_full, seq.max_registered_blocks)
        if seq.num_registered_blocks >= n_full:
            return
        self.extend_keys(seq, n_full * self.block_size)
        tokens = seq.all_token_ids
        b = self.block_size
        for i in range(seq.num_registered_blocks, n_full):
            parent = seq.block_keys[i - 1] if i else seq.root
            mine = seq.block_table[i]
            holder = self.pool.register(
                mine, seq.block_keys[i], parent, tokens[i * b : (i + 1) * b], seq.namespace
            )
            if holder is None:  # a key collision: ours stays private, and so does the rest
                seq.max_registered_blocks = n_full = i  # (their keys chain from this one)
                break
            if holder != mine:  # same content already cached: share it, give ours back
                self.pool.acquire([holder])
                seq.block_table[i] = holder
                self.pool.release([mine])
        seq.num_registered_blocks = n_full

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finish, abort, preemption); computed ones stay cached."""
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0
        seq.segment_job = None  # a segments assembly in progress lived in those blocks: void

    # ---- explanation -----------------------------------------------------------------------------
    def explain(self, token_ids: list[int], namespace: str | None, other_namespaces) -> CacheExplanation:
        """Why this prompt would (not) hit now. No side effects.

        Everything up to the "other namespace" check reads only keys of ``namespace``'s own
        chain, so its answer and its cost do not depend on other namespaces. Only
        ``other_namespaces`` (empty unless the caller is an admin) looks elsewhere."""
        n = len(token_ids)
        b = self.block_size
        if not self.enable_caching:
            return CacheExplanation(0, 0, "caching_disabled")
        usable = max(n - 1, 0)
        keys = self.keys_for(token_ids[:usable], namespace)
        root = self.root(namespace)
        m = self.pool.match(keys, token_ids, root)
        cached = m.num_tokens
        if len(m.block_ids) == len(keys):
            reason = "full_hit" if cached == usable else "partial_block"
            return CacheExplanation(cached, cached, reason)
        i = len(m.block_ids)
        # This exact block was cached before: the precise answer, even if a sibling diverges.
        if self.pool.index.was_evicted(keys[i]):
            return CacheExplanation(cached, cached, "evicted")
        parent = keys[i - 1] if i else root
        nxt = token_ids[i * b : (i + 1) * b]
        best = -1
        for e in self.pool.index.children(parent):
            common = 0
            for x, y in zip(e.token_ids, nxt):
                if x != y:
                    break
                common += 1
            best = max(best, common)
        # Sharing no token at all with any cached prompt is not a divergence.
        if best > 0 or (best == 0 and i > 0):
            return CacheExplanation(cached, cached, "diverged", diverged_at=cached + best)
        for ns in other_namespaces:
            if ns == namespace:
                continue
            other = self.pool.match(self.keys_for(token_ids[:usable], ns), token_ids, self.root(ns))
            if other.num_tokens > cached:
                return CacheExplanation(cached, cached, "other_namespace")
        return CacheExplanation(cached, cached, "no_prior_request")
