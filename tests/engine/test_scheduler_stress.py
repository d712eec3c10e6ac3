"""Differential stress of the scheduler on the real model: caching, chunked prefill, eviction and
preemption never change a greedy output, never corrupt the pool, never leak a block.

Requests are drawn from a random tree of shared prefixes whose lengths sit on and around block
boundaries (k*16 - 1, k*16, k*16 + 1), submitted at random engine steps into a pool so small
that running requests preempt each other and cached blocks are evicted, with a token budget that
splits prefills into chunks. Every output is compared with the same prompt run with caching off.
"""

from __future__ import annotations

import functools
import random
from unittest import mock

import pytest
from _helpers import BYTES_PER_TOKEN

from prefixcache.api.request import SamplingParams
from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.model.loader import load_weights

B = 16
MAX_TOKENS = 8

TEXT = (
    "Prefix caching stores the attention keys and values of a prompt so that a later request "
    "which starts with the same tokens does not compute them again. The river rose through the "
    "night and by morning the lower town was under water; the baker rowed his bread to the "
    "church steps. In 1869 the Suez Canal opened, cutting the sea route from London to Bombay "
    "by nearly seven thousand kilometres. To reset the router, hold the button for ten seconds "
    "until the light blinks amber, then wait two minutes. She said the recipe needs three eggs, "
    "a cup of flour, half a cup of milk and a pinch of salt. Photosynthesis turns carbon dioxide "
    "and water into glucose and oxygen using the energy of sunlight. def fib(n): return n if "
    "n < 2 else fib(n - 1) + fib(n - 2). The committee will meet on Thursday to review the "
    "budget, the hiring plan and the new office lease. Mount Everest is 8,849 metres tall. "
)


@functools.cache
def _default_weights():
    return load_weights(None)


def make_engine(**kw) -> LLMEngine:
    """An engine on the default model; the weights are read from the GGUF file once per module."""
    with mock.patch("prefixcache.engine.llm_engine.load_weights", lambda model: _default_weights()):
        return LLMEngine(EngineConfig(**kw))


# ---- workload ------------------------------------------------------------------------------------
def _prefix_tree(rng: random.Random, corpus: list[int]) -> list[list[int]]:
    """Nodes of a random tree of prefixes: each child extends its parent by a random stretch of
    real text to a length on or next to a block boundary."""

    def seg(n: int) -> list[int]:
        start = rng.randrange(len(corpus) - n)
        return corpus[start : start + n]

    def length(k: int) -> int:
        return k * B + rng.choice((-1, 0, 1))

    nodes: list[list[int]] = []

    def grow(tokens: list[int], k: int, depth: int) -> None:
        nodes.append(tokens)
        if depth == 2:
            return
        for _ in range(rng.randint(1, 3 - depth)):
            kc = k + rng.randint(1, 2)
            grow(tokens + seg(length(kc) - len(tokens)), kc, depth + 1)

    for _ in range(3):
        k = rng.randint(1, 2)
        grow(seg(length(k)), k, 0)
    return nodes


def _workload(tok, n: int, seed: int) -> list[tuple[str, list[int], int]]:
    """(request id, prompt ids, max_tokens) for ``n`` requests."""
    rng = random.Random(seed)
    corpus = tok.encode(TEXT)
    nodes = _prefix_tree(rng, corpus)
    out = []
    for i in range(n):
        suffix_len = rng.choice((0, 0, 0, 1, 2, 3, 5))  # 0: the prompt is a whole tree node
        start = rng.randrange(len(corpus) - 8)
        prompt = rng.choice(nodes) + corpus[start : start + suffix_len]
        out.append((f"r{i}", prompt, rng.randint(4, MAX_TOKENS)))
    return out


@pytest.fixture(scope="module")
def cold_refs(llm_cold):
    """prompt -> greedy tokens with caching off (MAX_TOKENS of them); computed in batches,
    memoised across the tests of this module."""
    memo: dict[tuple[int, ...], list[int]] = {}
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def get(prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
        missing = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in memo))
        if missing:
            outs = llm_cold.generate([list(p) for p in missing], sp)
            for p, o in zip(missing, outs):
                memo[p] = o.outputs[0].token_ids
        return memo

    return get


def _near_tie_report(llm_cold, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where two greedy outputs diverge, the cold top-2 logprob margin at that position: a
    margin near float32 noise (< ~1e-4) points to a numeric near-tie, a large one to a cache bug."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=2)
    lp = llm_cold.generate([prompt + want[:i]], sp)[0].outputs[0].logprobs[0]
    top = sorted(lp.values(), reverse=True)
    margin = top[0] - top[1] if len(top) > 1 else float("nan")
    return (
        f"diverged at output token {i}: got {got[i]}, cold {want[i]}; cold logprobs {lp}, "
        f"top-2 margin {margin:.3g}"
    )


# ---- the run -------------------------------------------------------------------------------------
def _run_stress(engine: LLMEngine, reqs, seed: int, abort_fraction: float):
    """Submit ``reqs`` at random steps, abort a random subset midway, check integrity after every
    step. Returns (sequences by id, ids aborted, finish events by id)."""
    rng = random.Random(seed + 1)
    queue = list(reqs)
    seqs = {}
    abort_at: dict[str, int] = {}  # request id -> step at which it is aborted
    aborted: set[str] = set()
    finished: dict[str, int] = {}
    step = 0
    cfg = engine.config
    schedule = engine.scheduler.schedule

    def checked_schedule():
        out = schedule()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert (
            len(out.scheduled) <= cfg.max_num_seqs
            and len(engine.scheduler.running) <= cfg.max_num_seqs
        )
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        return out

    engine.scheduler.schedule = checked_schedule

    def one_step() -> None:
        nonlocal step
        step += 1
        for s in engine.step():
            if s.finished:
                finished[s.request_id] = finished.get(s.request_id, 0) + 1
        engine.check_integrity()
        for rid, at in list(abort_at.items()):
            if at <= step:
                del abort_at[rid]
                if engine.abort(rid) is not None:
                    aborted.add(rid)
                engine.check_integrity()

    while queue:
        for _ in range(min(len(queue), rng.choice((0, 0, 1, 1, 2, 3, 6)))):
            rid, prompt, max_tokens = queue.pop(0)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            seqs[rid] = engine.add_request(rid, prompt, sp)
            if rng.random() < abort_fraction:
                abort_at[rid] = step + rng.randint(0, 10)  # waiting, mid-prefill or mid-decode
        for _ in range(rng.randint(1, 3)):
            one_step()
    while engine.has_unfinished():
        one_step()
    return seqs, aborted, finished


def _stress(engine: LLMEngine, llm_cold, cold_refs, n: int, seed: int, abort_fraction: float):
    reqs = _workload(engine.tokenizer, n, seed)
    refs = cold_refs([p for _, p, _ in reqs])
    seqs, aborted, finished = _run_stress(engine, reqs, seed, abort_fraction)

    mismatches = []
    for rid, prompt, max_tokens in reqs:
        seq = seqs[rid]
        want = refs[tuple(prompt)][:max_tokens]
        got = seq.out.output_token_ids
        if rid in aborted:
            assert seq.out.finish_reason == "abort"
            assert rid not in finished, f"{rid} finished and was aborted"
            assert len(got) < max_tokens
            want = want[: len(got)]  # what it produced before the abort is still right
        else:
            # No request is lost or duplicated.
            assert finished.get(rid) == 1, f"{rid} finished {finished.get(rid, 0)} times"
            assert seq.out.finish_reason == "length" and len(got) == max_tokens
        if got != want:
            mismatches.append(
                f"{rid} (prompt {len(prompt)} tokens, cached {seq.num_cached_tokens}, "
                f"preempted {seq.num_preemptions}x): "
                + _near_tie_report(llm_cold, prompt, got, want)
            )
    assert not mismatches, "\n".join(mismatches)

    # Nothing leaks: every block is free or cached, the queues are empty.
    c = engine.kv.pool.counts()
    assert c.in_use == 0, c
    assert c.free + c.cached == c.total, c
    assert not engine.seqs and not engine.scheduler.waiting and not engine.scheduler.running
    engine.check_integrity()

    # The run exercised what it claims to: preemption, eviction, chunked prefill, cache hits,
    # aborts.
    assert engine.scheduler.counters.num_preemptions > 0
    assert engine.kv.pool.evicted_blocks > 0
    assert engine.kv.hit_tokens > 0
    assert max(len(p) for _, p, _ in reqs) > engine.config.max_num_batched_tokens  # chunked
    if abort_fraction:
        assert aborted
    return seqs


def _stress_engine(policy: str, num_blocks: int, eviction: str = "lru") -> LLMEngine:
    # A request holds up to 6 blocks of 16 tokens: 8 running requests cannot all fit, so they
    # preempt each other; the prefix tree holds far more blocks than the pool, so blocks are
    # evicted. A quarter of the pool is the pin budget (unused here).
    return make_engine(
        kv_cache_memory=num_blocks * B * BYTES_PER_TOKEN,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        scheduling_policy=policy,
        eviction_policy=eviction,
        lpm_max_wait_steps=8,
        seed=0,
    )


@pytest.mark.parametrize("policy, eviction", [("fcfs", "lru"), ("lpm", "lru"),
                                              ("fcfs", "lru-demote"), ("lpm", "hit-density"),
                                              ("fcfs", "adaptive")])
def test_stress_small(policy, eviction, llm_cold, cold_refs):
    """Every eviction policy too: cold == warm under preemption and eviction, nothing leaks,
    ``check_integrity`` (the policy's state included) holds at the end."""
    engine = _stress_engine(policy, num_blocks=12, eviction=eviction)
    assert engine.kv.pool.eviction_policy == eviction
    _stress(engine, llm_cold, cold_refs, n=24, seed=8, abort_fraction=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_stress_200_requests(policy, llm_cold, cold_refs):
    engine = _stress_engine(policy, num_blocks=16)
    _stress(engine, llm_cold, cold_refs, n=200, seed=7, abort_fraction=0.1)
