"""Token-exact reuse (docs/design.md §4 "Token-exact reuse"): when a prompt diverges inside a
cached block, the block's leading tokens are copied (K/V and their scales, as stored) into the
new sequence's own block, so the hit is the whole common prefix, and the outputs are the bits a
cold run computes.

Every check is ``torch.equal`` / ``==`` on the numbers, never a tolerance: the stored K/V (and
scales) of every token the warm run computed *or copied*, the logits of every sampled position,
the logprobs and the generated tokens, against a cold run, at every offset 1..15 inside a block,
in batches with companions, under chunked prefill, preemption and eviction, and with the int8
and fp8 KV dtypes. Records are keyed by the token ids up to the position (a token's K/V and the
logits after it are functions of exactly those), as in test_exact.py.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from _helpers import BYTES_PER_TOKEN, PROSE, shared_default_weights, token_budget

from prefixcache import LLM, SamplingParams, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the exact path needs the CPU kernels")

B = 16
OFFSETS = range(1, B)  # every offset inside a block
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)


def _key(ids) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int32).numpy().tobytes()


def _salt(tag: str) -> str:
    return f"partial-{tag}-{os.urandom(8).hex()}"


class Recorder:
    """Wraps an engine's runner: per token, its stored K, V (and scales) as computed by a
    forward (``kv``) or copied from a cached block (``copied``); per sampled row, its logits."""

    def __init__(self, engine):
        self.engine = engine
        self.kv: dict[bytes, tuple] = {}
        self.copied: list[tuple[bytes, tuple]] = []  # every copied token, repeats included
        self.logits: dict[bytes, torch.Tensor] = {}
        self.copies = 0

    def _slots(self, ids, table, start: int, n: int) -> list[tuple[bytes, tuple]]:
        cache, bs = self.engine.runner.kv, self.engine.runner.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + n)])
        parts = [*cache.stored(slots), *(t.index_select(2, slots) for t in (cache.k_scale, cache.v_scale)
                                         if t is not None)]  # fmt: skip
        return [(_key(ids[: start + j + 1]), tuple(p[:, :, j].clone() for p in parts))
                for j in range(n)]  # fmt: skip

    def __enter__(self):
        runner = self.engine.runner
        self._execute, self._copy = runner.execute, runner.copy_kv

        def execute(pieces):  # the step's one forward (sequence.Piece)
            out = self._execute(pieces)
            row = 0
            for p in pieces:
                self.kv.update(self._slots(p.token_ids, p.block_table, p.start, p.n))
                if p.samples:
                    self.logits[_key(p.token_ids[: p.start + p.n])] = out.logits[row].clone()
                    row += 1
            return out

        def copy_kv(copies):
            self._copy(copies)
            live = self.engine.scheduler.running + self.engine.scheduler.waiting
            for src, dst, n in copies:
                # a fresh block of the sequence admitted with this copy, never a cached one
                assert self.engine.kv.pool.index.key_of(dst) is None
                assert self.engine.kv.pool.index.key_of(src) is not None
                seq = next(s for s in live if dst in s.kv.block_table)
                self.copied += self._slots(seq.all_token_ids, seq.kv.block_table,
                                           seq.kv.block_table.index(dst) * B, n)  # fmt: skip
                self.copies += 1

        runner.execute, runner.copy_kv = execute, copy_kv
        return self

    def __exit__(self, *exc):
        self.engine.runner.execute, self.engine.runner.copy_kv = self._execute, self._copy


def assert_same(cold: Recorder, warm: Recorder, min_kv: int, min_copied: int, min_logits: int):
    """Every number the warm run computed or copied equals the cold run's, bit for bit."""
    assert {k for k, _ in warm.copied} <= cold.kv.keys(), "a copied token cold never computed"
    kv = cold.kv.keys() & warm.kv.keys()
    lg = cold.logits.keys() & warm.logits.keys()
    assert len(kv) >= min_kv and len(warm.copied) >= min_copied and len(lg) >= min_logits, (
        len(kv), len(warm.copied), len(lg))  # fmt: skip
    for key, parts in [*((k, warm.kv[k]) for k in kv), *warm.copied]:
        ref = cold.kv[key]
        assert len(ref) == len(parts)
        for a, b in zip(ref, parts):
            assert torch.equal(a, b), "K/V differ"
    for key in lg:
        assert torch.equal(cold.logits[key], warm.logits[key]), "logits differ"


def _outputs(outs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _cases(base: list[int], seed: int, block: int = 2):
    """Per offset o: a prompt that caches ``base`` up to block ``block`` + o and goes on with
    other tokens (filling that block), and the warm prompt that shares exactly that much."""
    rng = random.Random(seed)
    cache, warm, shared = [], [], []
    for o in OFFSETS:
        n = block * B + o
        nxt = base[n]
        filler = [rng.choice([t for t in range(2000, 2100) if t != nxt]) for _ in range(20)]
        tail = [rng.choice([t for t in range(3000, 3100) if t != nxt]) for _ in range(9)]
        cache.append(base[:n] + filler)
        warm.append(base[:n] + tail)
        shared.append(n)
    return cache, warm, shared


def _cold(llm, prompts, params=PARAMS) -> tuple[Recorder, list]:
    """Each prompt in a namespace of its own: nothing cached, nothing shared."""
    outs = []
    with Recorder(llm.engine) as rec:
        for p in prompts:
            outs += llm.generate([p], params, cache_salt=_salt("cold"))
    assert rec.copies == 0
    return rec, outs


@pytest.fixture(scope="module")
def prose_ids(llm):
    return llm.get_tokenizer().encode(PROSE * 20)


@pytest.mark.parametrize("budget", [None, 13])
def test_partial_block_reuse_equals_cold_at_every_offset_with_companions(llm, prose_ids, budget):
    """Offsets 1..15 inside block 2, all in one batch with unrelated companions (and, with a
    budget, chunked prefill starting mid-block): the hit is the whole shared part, and every
    computed and copied number equals a cold run's."""
    cache, warm, shared = _cases(prose_ids[:80], seed=budget or 0)
    cold, cold_out = _cold(llm, warm)
    salt = _salt("warm")
    llm.generate(cache, PARAMS, cache_salt=salt)
    rng = random.Random(5)
    companions = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 40, 23)]
    batch = companions[:2] + warm + companions[2:]
    copied = llm.engine.kv.partial_hit_tokens
    with token_budget(llm, budget), Recorder(llm.engine) as rec:
        outs = llm.generate(batch, PARAMS, cache_salt=salt)[2:-1]
    assert [o.num_cached_tokens for o in outs] == shared  # not their floor to a block
    assert llm.engine.kv.partial_hit_tokens - copied == sum(OFFSETS)
    assert rec.copies == len(OFFSETS)
    assert _outputs(outs) == _outputs(cold_out)
    assert_same(cold, rec, min_kv=len(OFFSETS) * 12, min_copied=sum(OFFSETS), min_logits=60)
    llm.check_integrity()


def test_partial_reuse_off_recomputes_the_block(prose_ids):
    """The flag: off, a hit is its floor to a block (the tests above fail without the feature)."""
    with shared_default_weights():
        off = LLM(kv_cache_memory="16MiB", partial_block_reuse=False, seed=0)
    cache, warm, shared = _cases(prose_ids[:80], seed=1)
    off.generate(cache[6:7], PARAMS)
    out = off.generate(warm[6:7], PARAMS)[0]
    assert out.num_cached_tokens == shared[6] // B * B == 2 * B
    assert off.engine.kv.partial_hit_tokens == 0


@pytest.fixture(scope="module")
def crowded():
    """20 blocks (16 unpinnable): requests preempt each other and blocks are evicted."""
    with shared_default_weights():
        return LLM(kv_cache_memory=20 * B * BYTES_PER_TOKEN, seed=0)


def test_partial_reuse_under_preemption_and_eviction(llm, crowded, prose_ids):
    cache, warm, _shared = _cases(prose_ids[100:200], seed=3)
    picks = [0, 4, 8, 14]  # offsets 1, 5, 9, 15
    prompts = [warm[i] + prose_ids[300:340] for i in picks]
    params = dataclasses.replace(PARAMS, max_tokens=24)  # four grow past the 16 blocks
    cold, cold_out = _cold(llm, prompts, params)
    crowded.generate([cache[i] for i in picks], params, cache_salt="crowd")
    before = crowded.engine.scheduler.counters.num_preemptions
    evicted = crowded.cache_stats()["evicted_blocks"]
    with Recorder(crowded.engine) as rec:
        outs = crowded.generate(prompts, params, cache_salt="crowd")
    assert crowded.engine.scheduler.counters.num_preemptions > before
    assert crowded.cache_stats()["evicted_blocks"] > evicted
    assert rec.copies >= 1
    assert _outputs(outs) == _outputs(cold_out)
    assert_same(cold, rec, min_kv=40, min_copied=1, min_logits=24)
    crowded.check_integrity()
    assert not crowded.engine.kv.copy_sources()  # every planned copy ran or was let go


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_partial_reuse_copies_quantized_kv_and_its_scales(prose_ids, name):
    """Scaled KV dtypes: the copy carries each token's scales with its bytes."""
    with shared_default_weights():
        warm_llm = LLM(kv_cache_dtype=name, kv_cache_memory="24MiB", seed=0)
    cache, warm, shared = _cases(prose_ids[200:300], seed=7)
    cold, cold_out = _cold(warm_llm, warm)
    salt = _salt(name)
    warm_llm.generate(cache, PARAMS, cache_salt=salt)
    with Recorder(warm_llm.engine) as rec:
        outs = warm_llm.generate(warm, PARAMS, cache_salt=salt)
    assert [o.num_cached_tokens for o in outs] == shared
    assert all(len(parts) == 4 for _, parts in rec.copied)  # K, V and their scales
    assert _outputs(outs) == _outputs(cold_out)
    assert_same(cold, rec, min_kv=len(OFFSETS) * 12, min_copied=sum(OFFSETS), min_logits=60)
    warm_llm.check_integrity()


def test_a_partial_match_never_crosses_namespaces(llm, prose_ids):
    """Alice's block holds the first tokens of Bob's next block: Bob still computes them."""
    cache, warm, shared = _cases(prose_ids[:80], seed=11)
    alice, bob = _salt("alice"), _salt("bob")
    llm.generate(cache[9:10], PARAMS, cache_salt=alice)
    assert llm.generate(warm[9:10], PARAMS, cache_salt=bob)[0].num_cached_tokens == 0
    assert llm.generate(warm[9:10], PARAMS, cache_salt=alice)[0].num_cached_tokens == shared[9]
