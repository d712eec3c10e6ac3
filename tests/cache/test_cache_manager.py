"""KV cache manager (no torch): matching, admission, commit/dedup, explanations, and a randomized
run that checks the pool's invariants and the cold == warm property at the block level after
every operation.

The "model" here is a shadow dict: block id -> the token ids written into its slots. A sequence
"computes" a token by writing it into its block table, exactly where the runner would write its
KV. A hit is correct iff the shadow content of every hit block equals the prompt slice it stands
for; that is cold == warm for the cache core.
"""

from __future__ import annotations

import random

import pytest

from prefixcache.api.request import SamplingParams, SharedPrefix
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.eviction import EvictionPolicy
from prefixcache.cache.manager import blocks_needed, kv_cache_manager
from prefixcache.sequence import Sequence

B = 16
FP = "test-model-fingerprint"
REASONS = {
    "full_hit",
    "partial_block",
    "no_prior_request",
    "diverged",
    "evicted",
    "other_namespace",
    "caching_disabled",
}


def _tokens(n: int, seed: int, lo: int = 1, hi: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _next_token(tokens: list[int]) -> int:
    """Deterministic "greedy decoding": the same context always yields the same token."""
    return 1000 + (sum(tokens[-5:]) * 7 + len(tokens)) % 97


def _pool_state(pool: BlockPool) -> tuple:
    """What a call without effects must leave as it was: counts, evictions, and the eviction
    policy's clock and per-block state (references, recency, hits)."""
    pol = pool.policy
    blocks = sorted((k, m.refs, m.last, m.hits) for k, m in pol._meta.items())
    return pool.counts(), pool.num_allocatable, pool.evicted_blocks, pol._clock, blocks


class Sim:
    """A manager, its pool and the shadow KV; plays the scheduler and the model runner."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, max_pinned: int | None = None,
                 eviction_policy: str = "lru"):
        self.pool = BlockPool(num_blocks, B, max_pinned_blocks=max_pinned,
                              eviction_policy=eviction_policy)
        self.mgr = kv_cache_manager(self.pool, FP, enable_caching=enable_caching)
        self.shadow: dict[int, list[int | None]] = {}
        self.live: list[Sequence] = []
        self.n = 0
        self.dedups = 0  # blocks swapped for an already cached copy at commit
        self.integrity = True  # check_integrity in check() (off: the shadow KV alone)

    def seq(self, prompt: list[int], ns: str | None = None, max_tokens: int = 16) -> Sequence:
        self.n += 1
        return Sequence.of(
            f"r{self.n}",
            list(prompt),
            SamplingParams(max_tokens=max_tokens, temperature=0),
            root=self.mgr.root(ns),
            namespace=ns,
        )

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> None:
        if self.integrity:
            self.pool.check_integrity([s.kv.block_table for s in self.live] + self.mgr.copy_sources())
        for s in self.live:
            self.check_kv(s)
        # Every block the index serves holds exactly the tokens it is indexed under.
        idx = self.pool.index
        for blk in idx.all_blocks():
            assert self.shadow[blk] == list(idx.entry(idx.key_of(blk)).token_ids), blk

    def check_kv(self, s: Sequence) -> None:
        """Every computed position of a live sequence reads the token it stands for."""
        toks = s.all_token_ids
        assert s.kv.num_computed_tokens <= s.num_tokens
        assert len(s.kv.block_table) >= blocks_needed(s.kv.num_computed_tokens, B)
        for pos in range(s.kv.num_computed_tokens):
            blk = s.kv.block_table[pos // B]
            assert self.shadow[blk][pos % B] == toks[pos], (
                f"{s.request_id}: position {pos} in block {blk} holds "
                f"{self.shadow[blk][pos % B]}, expected {toks[pos]}"
            )

    def check_match(self, s: Sequence, m) -> None:
        toks = s.all_token_ids
        assert m.num_tokens <= s.num_tokens - 1, "match must leave the last token to compute"
        full = len(m.block_ids) * B
        assert len(set(m.block_ids)) == len(m.block_ids)
        for i, blk in enumerate(m.block_ids):
            assert self.shadow[blk] == toks[i * B : (i + 1) * B], f"hit block {blk} holds other KV"
        if m.partial_block is None:
            assert m.num_tokens == full
        else:  # its leading tokens are the prompt's next ones, and fewer than a block
            assert full < m.num_tokens < full + B and m.partial_block not in m.block_ids
            n = m.num_tokens - full
            assert self.shadow[m.partial_block][:n] == toks[full : full + n], "partial hit"
            assert self.pool.index.key_of(m.partial_block) is not None

    def copy(self, copies) -> None:
        """The model runner's copy_kv on the shadow KV: the first n slots of src into dst."""
        for src, dst, n in copies:
            assert self.pool.ref_count(src) >= 1, "the copy's source is held"
            assert self.pool.ref_count(dst) == 1 and self.pool.index.key_of(dst) is None
            self.shadow[dst] = list(self.shadow[src][:n]) + [None] * (B - n)

    # -- engine actions ----------------------------------------------------------------------
    def admit(self, s: Sequence, num_new: int | None = None) -> bool:
        m = self.mgr.match(s)
        self.check_match(s, m)
        if not s.out.output_token_ids:
            assert self.mgr.lookup(s.prompt_token_ids, s.namespace) == m.num_tokens
        remaining = s.num_tokens - m.num_tokens
        n = remaining if num_new is None else min(num_new, remaining)
        before = _pool_state(self.pool)
        if not self.mgr.admit(s, m, n):
            assert not s.kv.block_table
            assert _pool_state(self.pool) == before
            return False
        assert s.kv.block_table[: len(m.block_ids)] == m.block_ids
        assert s.kv.num_computed_tokens == m.num_tokens
        self.mgr.copy_partial_blocks(self.copy)  # what the engine does before the forward
        self.live.append(s)
        self.run(s, n)
        return True

    def compute(self, s: Sequence, n: int) -> None:
        toks = s.all_token_ids
        c = s.kv.num_computed_tokens
        assert c + n <= s.num_tokens
        for pos in range(c, c + n):
            blk = s.kv.block_table[pos // B]
            # Never write into a block another sequence reads or the index serves.
            assert self.pool.ref_count(blk) == 1, f"write into shared block {blk}"
            assert self.pool.index.key_of(blk) is None, f"write into cached block {blk}"
            slot = self.shadow.setdefault(blk, [None] * B)
            if pos % B == 0:
                slot[:] = [None] * B  # a reused block: its old content is garbage
            slot[pos % B] = toks[pos]
        s.kv.num_computed_tokens += n

    def run(self, s: Sequence, n: int) -> None:
        """One step of ``s`` over ``n`` tokens whose slots are allocated: compute, sample, commit."""
        self.compute(s, n)
        if s.kv.num_computed_tokens == s.num_tokens:
            s.out.output_token_ids.append(_next_token(s.all_token_ids))
        before = list(s.kv.block_table)
        self.mgr.commit(s)
        assert len(s.kv.block_table) == len(before)
        self.dedups += sum(1 for x, y in zip(before, s.kv.block_table) if x != y)

    def step(self, s: Sequence, n: int) -> bool:
        n = min(n, s.num_tokens - s.kv.num_computed_tokens)
        if not self.mgr.allocate_slots(s, n):
            return False
        self.run(s, n)
        return True

    def free(self, s: Sequence) -> None:
        self.live.remove(s)
        self.mgr.free(s)

    def serve(self, prompt: list[int], ns: str | None = None, decode: int = 0) -> Sequence:
        """Admit, prefill, decode ``decode`` tokens, free. Returns the finished sequence."""
        s = self.seq(prompt, ns)
        assert self.admit(s)
        for _ in range(decode):
            assert self.step(s, 1)
        self.check()
        self.free(s)
        self.check()
        return s


# ---- block math in simple cases ------------------------------------------------------------------
def exact_hit(common: int, cached_len: int) -> int:
    """What a prompt sharing its first ``common`` usable tokens with one earlier prompt of
    ``cached_len`` computed tokens gets: the whole blocks, then the tokens of the next block too
    when that block was full (registered) in the earlier prompt (token-exact reuse)."""
    full = common // B * B
    return common if full + B <= cached_len else full


SHARED = [k * B + d for k in (1, 2, 3) for d in (-1, 0, 1)]


@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("tails", [(0, 0), (0, 1), (0, 20), (1, 0), (5, 1), (5, 20), (1, 1)])
def test_num_cached_tokens_block_math(shared, tails):
    base = _tokens(80, seed=1)
    t1, t2 = tails
    p1 = base[:shared] + _tokens(t1, seed=2, lo=600, hi=700)
    p2 = base[:shared] + _tokens(t2, seed=3, lo=700, hi=800)  # differs from p1 right after
    sim = Sim(64)
    first = sim.serve(p1)
    assert first.num_cached_tokens == 0
    common = shared if p1 != p2 else len(p2)
    expect = exact_hit(min(common, len(p2) - 1), len(p1))
    assert sim.mgr.lookup(p2, None) == expect
    second = sim.serve(p2)
    assert second.num_cached_tokens == expect
    assert sim.mgr.hit_tokens == expect
    assert sim.mgr.query_tokens == len(p1) + len(p2)


@pytest.mark.parametrize("n", [B - 1, B, B + 1, 2 * B, 2 * B + 1, 3 * B])
def test_identical_prompt_caps_at_len_minus_one(n):
    sim = Sim(32)
    p = _tokens(n, seed=5)
    sim.serve(p)
    s = sim.serve(p)
    # the last token is always computed; the rest of its block is copied when it was full
    assert s.num_cached_tokens == (n - 1 if n % B == 0 else ((n - 1) // B) * B)
    assert s.num_cached_tokens == exact_hit(n - 1, n) < n


def test_next_turn_hits_on_previous_answer():
    sim = Sim(32)
    p1 = _tokens(20, seed=1)
    s1 = sim.serve(p1, decode=30)
    assert len(s1.out.output_token_ids) == 31
    # The last sampled token was never computed; the KV of the first 50 tokens was.
    p2 = p1 + s1.out.output_token_ids[:30] + _tokens(5, seed=9, lo=600, hi=700)
    assert sim.mgr.lookup(p2, None) == 48
    s2 = sim.serve(p2)
    assert s2.num_cached_tokens == 48


def test_chunked_prefill_registers_blocks_as_they_complete():
    sim = Sim(32)
    p = _tokens(70, seed=1)
    a = sim.seq(p)
    assert sim.admit(a, num_new=20)
    assert sim.mgr.lookup(p, None) == 16  # one full block so far, already a hit for others
    assert sim.step(a, 20)
    assert sim.mgr.lookup(p, None) == 32
    b = sim.seq(p)
    assert sim.admit(b, num_new=10)
    assert b.num_cached_tokens == 32
    assert b.kv.block_table[:2] == a.kv.block_table[:2]
    assert sim.pool.ref_count(a.kv.block_table[0]) == 2
    sim.check()


# ---- dedup -------------------------------------------------------------------------------------
def test_two_sequences_computing_the_same_block_share_it_after_commit():
    sim = Sim(16)
    p = _tokens(40, seed=1)
    a, b = sim.seq(p), sim.seq(p)
    ma, mb = sim.mgr.match(a), sim.mgr.match(b)
    assert ma.num_tokens == mb.num_tokens == 0
    assert sim.mgr.admit(a, ma, 40) and sim.mgr.admit(b, mb, 40)
    sim.live += [a, b]
    assert not set(a.kv.block_table) & set(b.kv.block_table)
    assert sim.pool.counts().in_use == 6
    sim.compute(a, 40)
    sim.compute(b, 40)
    sim.mgr.commit(a)
    sim.mgr.commit(b)
    assert b.kv.block_table[:2] == a.kv.block_table[:2]
    assert b.kv.block_table[2] != a.kv.block_table[2]  # the partial tail stays private
    assert [sim.pool.ref_count(x) for x in a.kv.block_table] == [2, 2, 1]
    c = sim.pool.counts()
    assert (c.in_use, c.free, c.cached) == (4, 12, 0)
    sim.check()
    sim.free(a)
    sim.free(b)
    sim.check()
    assert sim.pool.counts().cached == 2


def test_a_key_collision_on_insert_shares_nothing_and_ends_the_chain():
    """A block whose key is already indexed for *other* content (a hash collision, forced here
    by indexing a block under the key of the prompt's second block) is never shared: the
    sequence keeps its own block and registers nothing after it, since the keys of its later
    blocks chain from the colliding one and would serve KV computed after other tokens."""
    sim = Sim(16)
    p = _tokens(3 * B + 5, seed=7)
    keys = sim.mgr.keys_for(p, None)
    other = _tokens(B, seed=8)
    forged = sim.pool.allocate(1)[0]
    sim.shadow[forged] = list(other)
    # The colliding entry: block 1's key, stored for block 0's key followed by other tokens.
    assert sim.pool.register(forged, keys[1], keys[0], other, None) == forged
    sim.pool.release([forged])
    s = sim.serve(p)  # checks every position reads its own token, and the index's contents
    assert forged not in s.kv.block_table
    assert sim.pool.index.entry(keys[1]).block_id == forged  # the first owner keeps its key
    assert keys[2] not in sim.pool.index  # nothing chained on the collision is findable
    assert sim.mgr.lookup(p, None) == B  # block 0 only: the collision costs a miss
    # Whoever hashes to the colliding key (other tokens) gets the forged block, then a miss.
    m = sim.pool.match(keys, p[:B] + other + p[2 * B : 3 * B], sim.mgr.root(None))
    assert len(m.block_ids) == 2 and m.block_ids[1] == forged
    sim.check()


def test_fully_cached_prompt_recomputes_last_block_privately_then_shares():
    sim = Sim(16)
    p = _tokens(32, seed=1)
    sim.serve(p)
    cached = sim.mgr.match(sim.seq(p + [1])).block_ids
    assert len(cached) == 2
    b = sim.seq(p)
    m = sim.mgr.match(b)
    assert m.block_ids == cached[:1]  # the last token is always computed,
    assert (m.partial_block, m.num_tokens) == (cached[1], 31)  # the 15 before it are copied
    assert sim.admit(b)  # Sim.compute asserts it never wrote into the cached block 1
    # Block 1 was computed into a private block and then swapped for the cached copy.
    assert b.kv.block_table == cached
    c = sim.pool.counts()
    assert (c.in_use, c.cached, c.free) == (2, 0, 14)
    sim.check()


# ---- admission -------------------------------------------------------------------------------
def test_admit_is_all_or_nothing():
    sim = Sim(4)
    held = sim.seq(_tokens(33, seed=1))
    assert sim.admit(held)  # 3 blocks
    big = sim.seq(_tokens(40, seed=2))
    assert not sim.admit(big)
    sim.check()
    assert sim.mgr.query_tokens == 33  # a refused admission is not counted


def test_admission_with_pinned_hits():
    # Pinned idle blocks are not allocatable, so a hit on them must not be charged as if it took
    # an evictable block out of the LRU.
    sim = Sim(10, max_pinned=4)
    sys_prompt = _tokens(4 * B, seed=1)
    sim.serve(sys_prompt + [7])
    hits = sim.mgr.match(sim.seq(sys_prompt + [8])).block_ids
    assert len(hits) == 4
    sim.pool.pin(hits, ttl_seconds=None, now=0.0)
    assert sim.pool.num_allocatable == 6
    s = sim.seq(sys_prompt + _tokens(80, seed=2))  # 4 hits + 5 new blocks
    assert sim.admit(s)
    assert s.num_cached_tokens == 4 * B
    sim.check()


def test_preempted_sequence_readmits_with_its_own_blocks():
    sim = Sim(16)
    p = _tokens(40, seed=1)
    s = sim.seq(p, max_tokens=64)
    assert sim.admit(s)
    for _ in range(20):
        assert sim.step(s, 1)
    assert (s.num_tokens, s.kv.num_computed_tokens) == (61, 60)
    table = list(s.kv.block_table)
    sim.free(s)  # preemption: computed full blocks stay cached
    sim.check()
    assert sim.pool.counts().cached == 3
    assert sim.admit(s, num_new=1)
    assert s.kv.block_table[:3] == table[:3]
    assert s.kv.num_computed_tokens == 49  # 3 blocks from cache + 1 recomputed
    assert s.num_cached_tokens == 0  # what the user sees is decided at first admission
    sim.check()


# ---- token-exact reuse -------------------------------------------------------------------------
def _shared_seq(sim: Sim, prompt: list[int], ns: str, shared_ns: str, k: int) -> Sequence:
    """A sequence whose first ``k`` blocks are declared shared in ``shared_ns``."""
    s = sim.seq(prompt, ns)
    s.kv.shared_namespace, s.kv.num_shared_blocks, s.kv.root = shared_ns, k, sim.mgr.root(shared_ns)
    return s


@pytest.mark.parametrize("offset", range(1, B))
def test_partial_match_at_every_offset_copies_exactly_those_tokens(offset):
    sim = Sim(16)
    p = _tokens(48, seed=1)
    sim.serve(p)  # blocks 0-1 cached, block 2 holds 15 tokens: not cached
    q = p[: B + offset] + [999] * 10
    s = sim.seq(q)
    m = sim.mgr.match(s)
    assert (len(m.block_ids), m.num_tokens, m.partial_tokens(B)) == (1, B + offset, offset)
    sim.check_match(s, m)  # the source's first tokens are q's next ones, and it is cached
    assert sim.admit(s)  # Sim.copy and Sim.compute check the source is held, dst fresh
    assert s.num_cached_tokens == B + offset
    assert sim.mgr.partial_hit_tokens == offset
    sim.check()
    sim.free(s)
    sim.check()


def test_partial_reuse_off_matches_whole_blocks_only():
    pool = BlockPool(16, B)
    mgr = kv_cache_manager(pool, FP, partial_reuse=False)
    sim = Sim(16)
    sim.pool, sim.mgr = pool, mgr
    p = _tokens(48, seed=1)
    sim.serve(p)
    q = p[:20] + [999] * 10
    assert mgr.lookup(q, None) == 16 and mgr.match(sim.seq(q)).partial_block is None


def test_freed_before_its_copy_ran_lets_the_source_go():
    """Admitted, then freed in the same step (an abort, a preemption) before the engine ran the
    copy: the planned copy is dropped with its reference, and the source is evictable again."""
    sim = Sim(4)
    p = _tokens(40, seed=1)
    sim.serve(p)  # 2 blocks cached
    s = sim.seq(p[:20] + [999] * 5)
    m = sim.mgr.match(s)
    assert m.partial_block is not None and sim.mgr.admit(s, m, s.num_tokens - m.num_tokens)
    assert sim.pool.ref_count(m.partial_block) == 1  # held for the copy
    assert sim.mgr.copy_sources() == [[m.partial_block]]
    sim.pool.check_integrity([s.kv.block_table, *sim.mgr.copy_sources()])
    sim.mgr.free(s)
    assert sim.mgr.copy_sources() == [] and sim.pool.ref_count(m.partial_block) == 0
    assert sim.mgr.copy_partial_blocks(lambda copies: pytest.fail("a freed sequence's copy ran")) == 0
    sim.pool.check_integrity([])
    assert sim.pool.allocate(4) is not None  # everything, the source included, is evictable


def test_partial_match_never_crosses_namespaces():
    sim = Sim(16)
    p = _tokens(48, seed=1)
    sim.serve(p, ns="alice")
    q = p[:20] + [999] * 10
    assert sim.mgr.lookup(q, "bob") == 0
    assert sim.mgr.match(sim.seq(q, "bob")).partial_block is None
    assert sim.mgr.lookup(q, "alice") == 20
    e = sim.mgr.explain(q, "bob", [])
    assert e.cached_tokens == 0 and e.diverged_at is None


def test_no_partial_match_inside_a_shared_prefix_or_into_anothers_suffix():
    """A declared shared prefix is hit whole blocks at a time (a partial copy would let a tenant
    test a guess of a shared block token by token); past it, the chain is the tenant's own."""
    sim = Sim(16)
    p = _tokens(64, seed=1)  # 2 shared blocks, then alice's own
    a = _shared_seq(sim, p, "alice", "pub", 2)
    assert sim.admit(a)
    sim.check()
    sim.free(a)
    share = SharedPrefix("pub", 2 * B)
    guess = p[:20] + [999] * 30  # diverges inside shared block 1
    assert sim.mgr.lookup(guess, "bob", share) == B
    replay = p[:40] + [999] * 10  # alice's block 2 holds its tokens 32..39
    assert sim.mgr.lookup(replay, "bob", share) == 2 * B
    assert sim.mgr.lookup(replay, "alice", share) == 40  # hers: token-exact
    b = _shared_seq(sim, replay, "bob", "pub", 2)
    m = sim.mgr.match(b)
    assert (m.num_tokens, m.partial_block) == (2 * B, None)


def test_an_explanation_inside_a_shared_prefix_tells_whole_blocks_only():
    """Issue #37: ``diverged_at`` counted the tokens a guess shared with a cached shared block,
    a token-by-token oracle for every tenant of the salt (partial reuse is kept out of shared
    prefixes for the same reason). Inside the shared run it is now a block's start."""
    sim = Sim(16)
    p = _tokens(64, seed=1)
    a = _shared_seq(sim, p, "alice", "pub", 2)
    assert sim.admit(a)
    sim.free(a)
    share = SharedPrefix("pub", 2 * B)
    answers = set()
    for cut in (B + 1, B + 4, 2 * B - 1):  # guesses right up to different tokens of block 1
        guess = p[:cut] + [999] * (50 - cut)
        e = sim.mgr.explain(guess, "bob", [], share)
        answers.add((e.reason, e.diverged_at, e.cached_tokens))
    assert answers == {("diverged", B, B)}
    # A miss at the shared run's first block is no divergence at all (nothing to count).
    e = sim.mgr.explain(p[:3] + [999] * 47, "bob", [], share)
    assert (e.reason, e.diverged_at, e.cached_tokens) == ("no_prior_request", None, 0)


# ---- caching disabled --------------------------------------------------------------------------
def test_caching_disabled_never_hits_and_registers_nothing():
    sim = Sim(16, enable_caching=False)
    p = _tokens(40, seed=1)
    sim.serve(p, decode=5)
    s = sim.serve(p)
    assert s.num_cached_tokens == 0
    assert len(sim.pool.index) == 0
    assert sim.pool.counts().free == 16
    assert sim.mgr.lookup(p, None) == 0
    e = sim.mgr.explain(p, None, [])
    assert (e.reason, e.cached_tokens) == ("caching_disabled", 0)


# ---- explanations ------------------------------------------------------------------------------
def _explain(sim: Sim, prompt: list[int], ns: str | None = None, others=("a", "b", None)):
    before = (_pool_state(sim.pool), len(sim.pool.index))
    e = sim.mgr.explain(prompt, ns, list(others))
    assert (_pool_state(sim.pool), len(sim.pool.index)) == before  # no effects
    assert e.reason in REASONS
    assert e.cached_tokens == sim.mgr.lookup(prompt, ns)
    return e


def test_explain_full_hit():
    sim = Sim(16)
    p = _tokens(33, seed=1)
    sim.serve(p)
    e = _explain(sim, p)
    assert (e.reason, e.cached_tokens, e.diverged_at) == ("full_hit", 32, None)


def test_explain_partial_block():
    sim = Sim(16)
    p = _tokens(40, seed=1)
    sim.serve(p)
    e = _explain(sim, p)
    assert (e.reason, e.cached_tokens) == ("partial_block", 32)


def test_explain_no_prior_request_on_empty_cache():
    sim = Sim(16)
    e = _explain(sim, _tokens(40, seed=1))
    assert (e.reason, e.cached_tokens) == ("no_prior_request", 0)


def test_explain_no_prior_request_with_unrelated_prompts_cached():
    sim = Sim(16)
    sim.serve(_tokens(40, seed=1, lo=1, hi=100))
    e = _explain(sim, _tokens(40, seed=2, lo=200, hi=300))
    assert (e.reason, e.cached_tokens) == ("no_prior_request", 0)


@pytest.mark.parametrize("at", [0, 5, 15, 16, 17, 37, 47])
def test_explain_diverged_at_exact_token(at):
    sim = Sim(16)
    base = _tokens(64, seed=1)
    sim.serve(base[:48])
    p = base[:at] + [t + 1000 for t in base[at:]] + [1]  # 4 full blocks to compare
    e = _explain(sim, p)
    if at == 0:
        # Nothing shared at all: no earlier prompt with this prefix.
        assert (e.reason, e.cached_tokens) == ("no_prior_request", 0)
        return
    assert e.reason == "diverged"
    assert e.diverged_at == at
    assert e.cached_tokens == at  # token-exact: the cached block's first tokens are reused


def test_explain_evicted():
    sim = Sim(4)
    p = _tokens(40, seed=1)
    sim.serve(p)
    assert sim.pool.allocate(4) is not None  # evicts everything
    e = _explain(sim, p)
    assert (e.reason, e.cached_tokens) == ("evicted", 0)


def test_explain_evicted_tail_while_a_sibling_is_cached():
    # p's second block was evicted; q shares p's first block and is still cached. The exact
    # prefix of p was cached before: that is the reason, not a divergence from q.
    sim = Sim(5)
    base = _tokens(48, seed=1)
    p = base + [1]
    q = base[:20] + [t + 1000 for t in base[20:]] + [1]
    sim.serve(p)
    sim.serve(q)
    assert sim.pool.allocate(2) is not None  # evicts the tail of p: blocks 2 then 1
    assert sim.mgr.lookup(q, None) == 48
    e = _explain(sim, p)
    # q's block 1 still starts with p's next 4 tokens: those are reused (token-exact)
    assert (e.reason, e.cached_tokens) == ("evicted", 20)


def test_explain_other_namespace():
    sim = Sim(16)
    p = _tokens(40, seed=1)
    sim.serve(p, ns="a")
    e = _explain(sim, p, ns="b", others=("a", "b"))
    assert (e.reason, e.cached_tokens) == ("other_namespace", 0)
    assert sim.mgr.lookup(p, "a") == 32
    # Namespaces never share: serving it in "b" computes everything.
    assert sim.serve(p, ns="b").num_cached_tokens == 0


def _fill(sim: Sim, prompts, ns: str | None = None) -> None:
    """Serve each prompt (admit, compute, commit, free) without the per-step checks: many
    cached blocks, cheaply."""
    for prompt in prompts:
        s = sim.seq(prompt, ns)
        m = sim.mgr.match(s)
        assert sim.mgr.admit(s, m, s.num_tokens - m.num_tokens)
        sim.mgr.copy_partial_blocks(sim.copy)
        sim.live.append(s)
        sim.run(s, s.num_tokens - s.kv.num_computed_tokens)
        sim.free(s)


def _scanned_divergence(sim: Sim, prompt: list[int], parent) -> int:
    """The longest common prefix of the prompt's first block and every cached child of
    ``parent``, scanned one by one (what explanations computed before issue #37)."""
    best = -1
    for e in sim.pool.index.children(parent):
        n = 0
        for x, y in zip(e.token_ids, prompt[:B]):
            if x != y:
                break
            n += 1
        best = max(best, n)
    return best


def test_explaining_a_miss_bisects_the_siblings_and_answers_as_a_scan(monkeypatch):
    """Issue #37: a tenant caching thousands of one-block prompts made each explanation of a
    miss under them scan every sibling under the engine lock. The answer is one bisection of
    the sorted children, and it equals what the scan said."""
    rng = random.Random(5)
    sim = Sim(700)
    siblings = [[7] * 15 + [1000 + j] for j in range(300)] + [
        [rng.randrange(1, 60) for _ in range(B)] for _ in range(300)
    ]
    _fill(sim, [x + [1] for x in siblings])
    root = sim.mgr.root(None)
    probes = [[7] * 15 + [5000], [7] * 3 + [9] * 13, [8] * B, *siblings[:5]]
    probes += [[rng.randrange(1, 60) for _ in range(B)] for _ in range(50)]
    probes += [x[: rng.randrange(1, B)] + [rng.randrange(1, 60) for _ in range(B)] for x in siblings[300:340]]
    expected = {}
    for q in probes:
        q = q[:B] + [3, 4]
        expected[tuple(q)] = (_scanned_divergence(sim, q, root), sim.mgr.lookup(q, None))
    calls = []
    monkeypatch.setattr(type(sim.pool.index), "children", lambda *a: calls.append(a) or [])
    for q, (best, hit) in expected.items():
        e = _explain(sim, list(q), others=())
        if best == B:  # a sibling is this very block
            assert e.reason == "partial_block" or e.reason == "full_hit"
        elif best > 0:
            assert (e.reason, e.diverged_at, e.cached_tokens) == ("diverged", best, hit)
        else:
            assert e.reason == "no_prior_request"
    assert not calls  # never a scan of the siblings


def test_an_admins_explanation_is_bounded_in_namespaces(monkeypatch):
    """Any tenant can make namespaces (one per cache_salt): an admin's explanation of a miss
    looks at most the first blocks it needs in at most MAX_EXPLAIN_NAMESPACES of them, not the
    whole prompt in every one."""
    from prefixcache.cache import hashing, manager, prefix_index

    n_ns = manager.MAX_EXPLAIN_NAMESPACES + 200
    sim = Sim(n_ns + 8)
    for k in range(n_ns):
        _fill(sim, [_tokens(B + 1, seed=k)], ns=f"t/{k}")
    p = _tokens(40 * B, seed=10**6)  # 40 blocks, cached nowhere
    hashed = [0]
    real = hashing.key_hash

    def counting(data):
        hashed[0] += 1
        return real(data)

    monkeypatch.setattr(hashing, "key_hash", counting)
    monkeypatch.setattr(prefix_index, "key_hash", counting)
    e = _explain(sim, p, ns="admin", others=sim.pool.index.namespaces())
    assert e.reason == "no_prior_request"
    # The prompt's own chain (40 keys), then at most one block per examined namespace.
    assert hashed[0] <= 40 + manager.MAX_EXPLAIN_NAMESPACES + 1, hashed[0]
    # A namespace holding the prompt's first block is still found.
    monkeypatch.undo()
    _fill(sim, [p[: 2 * B + 1]], ns="t/0")
    e = _explain(sim, p, ns="admin", others=sim.pool.index.namespaces())
    assert e.reason == "other_namespace"


def test_explain_caching_disabled():
    sim = Sim(16, enable_caching=False)
    e = sim.mgr.explain(_tokens(40, seed=1), None, [])
    assert e.reason == "caching_disabled"


# ---- randomized operations -----------------------------------------------------------------------
NAMESPACES = (None, None, None, "t1")


def _prompt_source(rng: random.Random):
    bases = [_tokens(64, seed=100 + f) for f in range(3)]
    suffixes = [[], [901], [902, 903, 904, 905, 906], _tokens(17, seed=7, lo=600, hi=700)]
    history: list[list[int]] = []

    def make() -> list[int]:
        if history and rng.random() < 0.25:
            return list(rng.choice(history))
        k = rng.choice((1, 2, 3))
        length = k * B + rng.choice((-1, 0, 1))
        if rng.random() < 0.7:
            suffix = rng.choice(suffixes)
        else:
            suffix = [rng.randrange(600, 620) for _ in range(rng.randint(1, 10))]
        p = bases[rng.randrange(3)][:length] + suffix
        history.append(p)
        return p

    return make, history


@pytest.mark.parametrize(
    "seed, enable_caching, policy",
    [(1234, True, "lru"), (7, True, "lru"), (2024, True, "lru"), (1234, False, "lru"),
     (1234, True, "lru-demote"), (7, True, "lru-demote"),
     (1234, True, "hit-density"), (7, True, "hit-density"), (1234, True, "adaptive"),
     (7, True, "adaptive")],
)
def test_randomized_operations_keep_invariants_and_cold_equals_warm(seed, enable_caching, policy):
    """Every eviction policy: the shadow KV a live sequence reads is always its own tokens (a
    policy that evicted a referenced block would hand its memory to another sequence, whose
    writes the check sees; test_a_policy_evicting_a_referenced_block_is_caught)."""
    _randomized_run(seed, enable_caching, policy)


def _randomized_run(seed: int, enable_caching: bool, policy: str | BlockPool,
                    integrity: bool = True) -> None:
    rng = random.Random(seed)
    sim = Sim(24, enable_caching=enable_caching, max_pinned=4,
              eviction_policy=policy if isinstance(policy, str) else "lru")
    if not isinstance(policy, str):
        sim.pool = sim.mgr.pool = policy
    sim.integrity = integrity
    pool, mgr = sim.pool, sim.mgr
    make_prompt, history = _prompt_source(rng)
    waiting: list[Sequence] = []
    stats = dict.fromkeys(
        ("hits", "refused", "preempt", "pins", "pin_errors", "expired", "invalidated",
         "aborted_copies"), 0
    )
    clock = 0.0
    ops = ["arrive"] * 30 + ["step"] * 60 + ["finish"] * 12 + ["preempt"] * 5
    ops += ["retry"] * 8 + ["pin"] * 3 + ["expire"] * 3 + ["explain"] * 5 + ["abort"] * 3
    ops += ["invalidate"] + ["invalidate_all"] * (1 if rng.random() < 0.5 else 0)

    def try_admit(s: Sequence) -> None:
        first = s.num_cached_tokens is None
        chunk = rng.choice((None, 8, 16, 20))
        if sim.admit(s, num_new=chunk):
            if first:
                assert s.num_cached_tokens <= s.num_prompt_tokens - 1
                stats["hits"] += s.num_cached_tokens
        else:
            stats["refused"] += 1
            waiting.append(s)

    for i in range(2000):
        clock += 1.0
        op = rng.choice(ops)
        if op == "arrive" or (op == "step" and not sim.live):
            if len(waiting) > 8:
                continue
            s = sim.seq(make_prompt(), ns=rng.choice(NAMESPACES), max_tokens=rng.randint(1, 40))
            try_admit(s)
        elif op == "retry" and waiting:
            try_admit(waiting.pop(0))
        elif op == "abort":  # admitted, then freed in the same step, before its copy ran
            s = sim.seq(make_prompt(), ns=rng.choice(NAMESPACES))
            m = mgr.match(s)
            sim.check_match(s, m)
            if mgr.admit(s, m, s.num_tokens - m.num_tokens):
                stats["aborted_copies"] += m.partial_block is not None
                if sim.integrity:
                    pool.check_integrity([x.kv.block_table for x in sim.live] + [s.kv.block_table]
                                         + mgr.copy_sources())  # fmt: skip
                mgr.free(s)
        elif op == "step":
            s = rng.choice(sim.live)
            n = rng.choice((1, 1, 1, 8, 16, 20))
            if not sim.step(s, n):
                victim = rng.choice(sim.live)  # out of blocks: preempt someone
                sim.free(victim)
                waiting.append(victim)
                stats["preempt"] += 1
            elif len(s.out.output_token_ids) >= s.params.max_tokens:
                sim.free(s)
        elif op in ("finish", "preempt") and sim.live:
            s = rng.choice(sim.live)
            sim.free(s)
            if op == "preempt":
                waiting.append(s)
                stats["preempt"] += 1
        elif op == "pin" and history:
            p = rng.choice(history)
            ns = rng.choice(NAMESPACES)
            m = mgr.match(sim.seq(p, ns))
            sim.check_match(sim.seq(p, ns), m)
            if m.block_ids:
                try:
                    pool.pin(m.block_ids, ttl_seconds=rng.choice((5.0, 50.0, None)), now=clock)
                    stats["pins"] += 1
                except ValueError as e:
                    assert "pin budget exceeded" in str(e)
                    stats["pin_errors"] += 1
            if rng.random() < 0.2:  # unbounded pins must not starve the run
                pool.expire_pins(now=float("inf"))
        elif op == "expire":
            stats["expired"] += pool.expire_pins(now=clock)
        elif op == "explain" and history:
            p = rng.choice(history) if rng.random() < 0.8 else make_prompt()
            e = _explain(sim, p, ns=rng.choice(NAMESPACES), others=("t1", None))
            if not enable_caching:
                assert e.reason == "caching_disabled"
            elif e.reason == "diverged":
                assert e.cached_tokens <= e.diverged_at < e.cached_tokens + B
            elif e.reason == "full_hit":
                assert e.cached_tokens == len(p) - 1
        elif op == "invalidate":
            stats["invalidated"] += pool.invalidate(rng.choice(NAMESPACES))
        elif op == "invalidate_all":
            stats["invalidated"] += pool.invalidate(None, all_namespaces=True)
        sim.check()
        for s in waiting:
            assert not s.kv.block_table
        if i % 100 == 0:
            assert len(pool.index) <= pool.num_blocks

    for s in list(sim.live):
        sim.free(s)
    sim.check()
    pool.expire_pins(now=float("inf"))
    c = pool.counts()
    assert c.in_use == 0 and c.free + c.cached == c.total
    assert pool.num_allocatable == c.total
    # The run exercised what it claims to test.
    # (44-47 on the seeds here since aborts joined the mix: they take steps' share of ops)
    assert (pool.evicted_blocks > 30) if enable_caching else (pool.evicted_blocks == 0), (
        pool.evicted_blocks, stats)
    assert stats["preempt"] > 0 and stats["refused"] > 0
    if enable_caching:
        assert stats["hits"] > 500, stats
        assert sim.dedups > 0, stats
        assert stats["pins"] > 0 and stats["expired"] > 0, stats
        assert stats["invalidated"] > 0, stats
        assert stats["aborted_copies"] > 0 and mgr.partial_hit_tokens > 0, stats
    else:
        assert stats["hits"] == 0 and len(pool.index) == 0


class _EvictsInUse(EvictionPolicy):
    """A broken policy: its victim is the least recently used block *in use* when one is."""

    def evict(self):
        held = [m for m in self._meta.values() if m.refs and not m.children]
        if not held:
            return super().evict()
        m = min(held, key=lambda m: m.last)
        m.refs = 0
        m.held_below = 0
        self._num_held -= 1
        self._drop(m.block, m)
        return m.block


def test_a_policy_evicting_a_referenced_block_is_caught():
    """The randomized run above fails when the pool's policy evicts a block in use: the
    differential check is what guards every policy."""
    for integrity in (True, False):  # the pool's own check, and the shadow KV without it
        pool = BlockPool(24, B, max_pinned_blocks=4)
        pool.policy = _EvictsInUse(24)
        with pytest.raises(AssertionError, match="drifted" if integrity else "holds|write into"):
            _randomized_run(1234, True, pool, integrity=integrity)
