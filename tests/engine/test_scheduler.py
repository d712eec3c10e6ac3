"""Scheduler behaviour on the real model: in-batch sharing, admission, policies, abort.

Each test drives an ``LLMEngine`` step by step so that it can look at the queues between steps.
Engines are small (a few blocks) and built per test; the weights are read once per module.
"""

from __future__ import annotations

import pytest
from _helpers import BYTES_PER_TOKEN, PROSE, shared_default_weights

from prefixcache.api.request import RequestStatus, SamplingParams
from prefixcache.cache.manager import blocks_needed
from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.model.paths import resolve_model_path
from prefixcache.tokenizer.tokenizer import load_tokenizer

B = 16
GREEDY4 = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

TEXT = PROSE
OTHER = (
    "The river rose through the night and by morning the lower town was under water; the baker "
    "rowed his bread to the church steps while the mayor argued with the engineers. "
)


def make_engine(**kw) -> LLMEngine:
    """An engine on the default model; the weights are read from the GGUF file once per module."""
    kw.setdefault("seed", 0)
    with shared_default_weights():
        return LLMEngine(EngineConfig(**kw))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path(None))


def _text_ids(tok, text: str, n: int) -> list[int]:
    ids = tok.encode(text * (n // 20 + 1))
    assert len(ids) >= n
    return ids[:n]


def _run_to_end(engine: LLMEngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def _assert_no_leak(engine: LLMEngine) -> None:
    engine.check_integrity()
    c = engine.kv.pool.counts()
    assert c.in_use == 0, c
    assert c.free + c.cached == c.total, c


def _cold(llm_cold, prompts, sp=GREEDY8) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm_cold.generate(prompts, sp)]


# ---- chunked prefill -----------------------------------------------------------------------------
def test_chunked_prefill_keeps_decodes_flowing_and_publishes_blocks_per_chunk(tok, llm_cold):
    engine = make_engine(kv_cache_memory=32 * B * BYTES_PER_TOKEN, max_num_batched_tokens=32)
    short = _text_ids(tok, OTHER, 10)
    long = _text_ids(tok, TEXT, 150)
    d = engine.add_request("decode", short, GREEDY8)
    engine.step()  # prefills the short prompt, first token
    lp = engine.add_request("long", long, GREEDY4)
    published = []
    while lp.is_prefilling:
        n_out = len(d.out.output_token_ids)
        engine.step()
        engine.check_integrity()
        # The decode gets its token every step; the long prompt gets the rest of the budget.
        assert len(d.out.output_token_ids) == n_out + 1 or d.finished
        assert lp.kv.num_computed_tokens <= 150
        # Full blocks of every finished chunk are hits for others at once.
        published.append((lp.kv.num_computed_tokens, engine.lookup(long + [0]).num_cached_tokens))
    assert len(published) >= 150 // 32  # split across steps
    for computed, cached in published[:-1]:
        assert 0 < computed < 150 and cached == (computed // B) * B, published
    _run_to_end(engine)
    _assert_no_leak(engine)
    cold = _cold(llm_cold, [short, long])
    assert [d.out.output_token_ids, lp.out.output_token_ids] == [cold[0], cold[1][:4]]


# ---- in-batch sharing ----------------------------------------------------------------------------
N_SHARE = 4
PREFIX_LEN = 1000


def _sharing_prompts(tok) -> list[list[int]]:
    prefix = _text_ids(tok, TEXT, PREFIX_LEN)
    return [prefix + tok.encode(f" Question {i}: why?") for i in range(N_SHARE)]


def _run_sharing(engine: LLMEngine, prompts: list[list[int]]):
    """Two requests arrive together, two more while the first is halfway through the prefix."""
    seqs = [engine.add_request(f"s{i}", p, GREEDY4) for i, p in enumerate(prompts[:2])]
    for _ in range(2):
        engine.step()
        engine.check_integrity()
    assert 0 < seqs[0].kv.num_computed_tokens < PREFIX_LEN  # chunked: still mid-prefix
    seqs += [engine.add_request(f"s{i}", p, GREEDY4) for i, p in enumerate(prompts[2:], 2)]
    _run_to_end(engine)
    _assert_no_leak(engine)
    return seqs


def test_a_hit_runs_beside_a_long_cold_prefill_not_after_it(tok, llm_cold):
    """Short work first: a request whose prompt is cached (a few new tokens) is scheduled in the
    next step while a long cold prompt prefills, not after that whole prefill (its TTFT was the
    cold prompt's: 70 s at 16k tokens); the long prompt still gets at least half of every step;
    both outputs equal cold."""
    engine = make_engine(kv_cache_memory=64 * B * BYTES_PER_TOKEN, max_num_batched_tokens=64)
    prefix = _text_ids(tok, TEXT, 96)
    engine.add_request("warm", prefix, GREEDY4)
    _run_to_end(engine)
    cold_ids = _text_ids(tok, OTHER, 400)
    long = engine.add_request("long", cold_ids, GREEDY4)
    engine.step()
    hit_ids = prefix + _text_ids(tok, OTHER, 5)
    hit = engine.add_request("hit", hit_ids, GREEDY4)
    before = long.kv.num_computed_tokens
    engine.step()
    engine.check_integrity()
    assert hit.num_cached_tokens == 96 and len(hit.out.output_token_ids) == 1  # its first token
    assert long.kv.num_computed_tokens - before >= 32 and long.is_prefilling
    _run_to_end(engine)
    assert [long.out.output_token_ids, hit.out.output_token_ids] == _cold(llm_cold, [cold_ids, hit_ids], GREEDY4)
    _assert_no_leak(engine)


def test_a_hit_never_takes_the_slot_of_a_longer_request_before_it(tok, llm_cold):
    """Short work goes first within the budget, not in the queue for slots: with one slot free,
    a long cold request that arrived first is admitted and a prefix hit behind it waits (it
    would otherwise take the slot, and a stream of hits, maybe another tenant's, could keep a
    long prompt out for good)."""
    engine = make_engine(kv_cache_memory=64 * B * BYTES_PER_TOKEN, max_num_batched_tokens=64, max_num_seqs=2)
    prefix = _text_ids(tok, TEXT, 96)
    engine.add_request("warm", prefix, GREEDY4)
    _run_to_end(engine)
    engine.add_request("decode", _text_ids(tok, OTHER, 10), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    long = engine.add_request("long", _text_ids(tok, OTHER, 300), GREEDY4)
    hit = engine.add_request("hit", prefix + _text_ids(tok, TEXT, 5), GREEDY4)
    engine.step()
    engine.check_integrity()
    assert long.kv.num_computed_tokens > 0 and hit in engine.scheduler.waiting
    _run_to_end(engine)
    assert [long.out.output_token_ids, hit.out.output_token_ids] == _cold(
        llm_cold, [long.prompt_token_ids, hit.prompt_token_ids], GREEDY4)
    _assert_no_leak(engine)


def test_in_batch_sharing_computes_the_shared_prefix_once(tok):
    prompts = _sharing_prompts(tok)
    suffix = max(len(p) for p in prompts) - PREFIX_LEN
    engine = make_engine(kv_cache_memory=96 * B * BYTES_PER_TOKEN, max_num_batched_tokens=256)
    seqs = _run_sharing(engine, prompts)
    computed = engine.scheduler.counters.computed_prompt_tokens
    # The prefix once, plus per request its suffix and the prefix's partial last block.
    assert PREFIX_LEN <= computed <= PREFIX_LEN + N_SHARE * (suffix + B), computed
    full = (PREFIX_LEN // B) * B
    assert [s.num_cached_tokens for s in seqs] == [0] + [full] * (N_SHARE - 1)
    assert engine.scheduler.counters.num_preemptions == 0
    outs = [s.out.output_token_ids for s in seqs]
    assert all(len(o) == 4 for o in outs)


@pytest.mark.slow
def test_in_batch_sharing_control_caching_off(tok, llm_cold):
    """The same run with caching off computes the prefix once per request (so the count above
    measures sharing), and gives the outputs the shared run gives."""
    prompts = _sharing_prompts(tok)
    shared = make_engine(kv_cache_memory=96 * B * BYTES_PER_TOKEN, max_num_batched_tokens=256)
    warm = [s.out.output_token_ids for s in _run_sharing(shared, prompts)]
    engine = make_engine(
        kv_cache_memory=96 * B * BYTES_PER_TOKEN,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    seqs = _run_sharing(engine, prompts)
    assert engine.scheduler.counters.computed_prompt_tokens >= N_SHARE * PREFIX_LEN
    assert [s.out.output_token_ids for s in seqs] == warm


# ---- admission -----------------------------------------------------------------------------------
def test_admission_counts_cached_blocks_as_paid_for(tok, llm_cold):
    """A request whose prompt is mostly held by a running request is admitted next to it in a
    pool that could not hold its blocks uncached."""
    prefix = _text_ids(tok, TEXT, 8 * B)
    p1 = prefix + tok.encode(" First question?")
    p2 = prefix + tok.encode(" Second question!")
    # 11 blocks: the first request holds 9 (8 shared + its tail) for its whole life.
    engine = make_engine(kv_cache_memory=11 * B * BYTES_PER_TOKEN, pin_budget_fraction=0.0)
    r1 = engine.add_request("r1", p1, GREEDY8)
    while r1.is_prefilling or not r1.out.output_token_ids:
        engine.step()
    assert blocks_needed(len(p2) + GREEDY4.max_tokens, B) > engine.kv.pool.num_allocatable
    r2 = engine.add_request("r2", p2, GREEDY4)
    engine.step()
    engine.check_integrity()
    assert r2.status is RequestStatus.RUNNING and r1.status is RequestStatus.RUNNING
    assert r2.num_cached_tokens == 8 * B
    _run_to_end(engine)
    assert engine.scheduler.counters.num_preemptions == 0
    _assert_no_leak(engine)
    assert [r1.out.output_token_ids, r2.out.output_token_ids[:4]] == [
        _cold(llm_cold, [p1])[0],
        _cold(llm_cold, [p2])[0][:4],
    ]


# ---- preemption ----------------------------------------------------------------------------------
def test_preemption_takes_the_newest_and_resumes_on_its_cached_blocks(tok, llm_cold):
    # 5 blocks: two 30-token prompts hold 2 each; both need a third at the same decode step.
    engine = make_engine(kv_cache_memory=5 * B * BYTES_PER_TOKEN, pin_budget_fraction=0.0)
    p_old, p_new = _text_ids(tok, TEXT, 30), _text_ids(tok, OTHER, 30)
    old = engine.add_request("old", p_old, GREEDY8)
    new = engine.add_request("new", p_new, GREEDY8)
    schedule = engine.scheduler.schedule
    resumed_chunks = []

    def spy():
        out = schedule()
        resumed_chunks.extend(
            s.num_new_tokens for s in out.scheduled if s.seq is new and new.num_preemptions
        )
        return out

    engine.scheduler.schedule = spy
    _run_to_end(engine)
    _assert_no_leak(engine)
    assert (old.num_preemptions, new.num_preemptions) == (0, 1)
    assert engine.scheduler.counters.num_preemptions == 1
    # Resuming recomputes only what its cached blocks do not hold (32 of its 33 tokens).
    assert resumed_chunks[0] == 1, resumed_chunks
    # Nothing lost or duplicated; preemption changes no output.
    assert [old.out.output_token_ids, new.out.output_token_ids] == _cold(llm_cold, [p_old, p_new])


# ---- ordering policies ---------------------------------------------------------------------------
def _warm(engine: LLMEngine, prompt: list[int]) -> None:
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0))
    _run_to_end(engine)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_longest_cached_prefix_first(tok, policy):
    engine = make_engine(
        kv_cache_memory=32 * B * BYTES_PER_TOKEN, max_num_seqs=1, scheduling_policy=policy
    )
    prefix = _text_ids(tok, TEXT, 4 * B)
    _warm(engine, prefix)
    miss = engine.add_request("miss", _text_ids(tok, OTHER, 20), GREEDY4)  # arrives first
    hit = engine.add_request("hit", prefix + tok.encode(" Which city?"), GREEDY4)
    engine.step()
    first = engine.scheduler.running[0]
    assert first is (hit if policy == "lpm" else miss)
    _run_to_end(engine)
    _assert_no_leak(engine)
    assert hit.num_cached_tokens == 4 * B and miss.num_cached_tokens == 0
    order = sorted([miss, hit], key=lambda s: s.metrics.first_scheduled_time)
    assert order[0] is first


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_sjf_admits_the_least_uncached_work_first(tok, policy):
    """sjf orders by the prompt tokens the cache does not hold: a long prompt whose prefix is
    cached (8 tokens to compute) before a short uncached one (20), before a long uncached one
    (60), whatever their arrival order; fcfs keeps arrival order."""
    engine = make_engine(
        kv_cache_memory=32 * B * BYTES_PER_TOKEN, max_num_seqs=1, scheduling_policy=policy
    )
    prefix = _text_ids(tok, TEXT, 4 * B)
    _warm(engine, prefix)
    long = engine.add_request("long", _text_ids(tok, OTHER, 60), GREEDY4)
    short = engine.add_request("short", _text_ids(tok, OTHER[40:], 20), GREEDY4)
    cached = engine.add_request("cached", prefix + _text_ids(tok, OTHER[80:], 8), GREEDY4)
    _run_to_end(engine)
    _assert_no_leak(engine)
    assert cached.num_cached_tokens == 4 * B
    order = sorted([long, short, cached], key=lambda s: s.metrics.first_scheduled_time)
    assert order == ([cached, short, long] if policy == "sjf" else [long, short, cached])


def _starvation_wait(tok, max_wait_steps: int, steps: int, policy: str = "lpm") -> int | None:
    """Steps a no-hit request waits while hit requests keep arriving (None: never admitted).
    Under sjf too: the hits are less work than the miss (a few uncached tokens against 20)."""
    engine = make_engine(
        kv_cache_memory=32 * B * BYTES_PER_TOKEN,
        max_num_seqs=1,
        scheduling_policy=policy,
        lpm_max_wait_steps=max_wait_steps,
    )
    prefix = _text_ids(tok, TEXT, 4 * B)
    _warm(engine, prefix)
    suffixes = [tok.encode(f" Question {i}?") for i in range(steps + 4)]
    engine.add_request("hit-0", prefix + suffixes[0], GREEDY4)
    miss = engine.add_request("miss", _text_ids(tok, OTHER, 20), GREEDY4)
    n_hits = 1
    for step in range(1, steps + 1):
        # Keep two hit requests waiting: without the guard they always go before the miss.
        while sum(1 for s in engine.scheduler.waiting if s is not miss) < 2:
            engine.add_request(f"hit-{n_hits}", prefix + suffixes[n_hits], GREEDY4)
            n_hits += 1
        engine.step()
        engine.check_integrity()
        if miss.status is not RequestStatus.WAITING:
            for rid in list(engine.seqs):
                engine.abort(rid)
            _assert_no_leak(engine)
            return step
    return None


@pytest.mark.parametrize("policy", ["lpm", "sjf"])
def test_lpm_starvation_guard_bounds_the_wait_of_a_miss(tok, policy):
    # A hit request runs for 4 steps (prefill, 3 decodes); with max_num_seqs=1 the miss gets
    # in when the guard fires and the request running then finishes.
    wait = _starvation_wait(tok, max_wait_steps=3, steps=16, policy=policy)
    assert wait is not None and wait <= 3 + 1 + 4, wait
    # Control: without a guard in reach, the same stream of hits keeps the miss waiting.
    assert _starvation_wait(tok, max_wait_steps=1000, steps=16, policy=policy) is None


def test_priority_lower_value_goes_first_under_fcfs(tok):
    engine = make_engine(kv_cache_memory=32 * B * BYTES_PER_TOKEN, max_num_seqs=1)
    late_urgent_prompt = _text_ids(tok, OTHER, 20)
    early = engine.add_request("early", _text_ids(tok, TEXT, 20), GREEDY4, priority=5)
    late = engine.add_request("late", late_urgent_prompt, GREEDY4, priority=-1)
    engine.step()
    assert engine.scheduler.running == [late] and early.status is RequestStatus.WAITING
    _run_to_end(engine)
    _assert_no_leak(engine)
    assert early.metrics.first_scheduled_time > late.metrics.finished_time


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_mid_prefill_and_mid_decode_frees_every_block(tok, llm_cold):
    engine = make_engine(kv_cache_memory=32 * B * BYTES_PER_TOKEN, max_num_batched_tokens=32)
    prompt = _text_ids(tok, TEXT, 6 * B + 4)

    # Waiting: never admitted, holds nothing.
    engine.add_request("w", prompt, GREEDY8, namespace="waiting")
    assert engine.abort("w").out.finish_reason == "abort"
    _assert_no_leak(engine)
    assert engine.kv.pool.counts().cached == 0

    # Mid-prefill: two chunks of 32 tokens computed = 4 full blocks, which stay cached.
    a = engine.add_request("a", prompt, GREEDY8, namespace="prefill")
    engine.step()
    engine.step()
    assert a.is_prefilling and a.kv.num_computed_tokens == 64 and a.kv.block_table
    engine.abort("a")
    _assert_no_leak(engine)
    assert engine.kv.pool.counts().cached == 4
    assert engine.lookup(prompt, "prefill").num_cached_tokens == 4 * B
    assert a.out.finish_reason == "abort" and not engine.has_unfinished()

    # Mid-decode, while another request shares its prompt blocks: the other one is unaffected.
    b = engine.add_request("b", prompt, GREEDY8, namespace="decode")
    c = engine.add_request("c", prompt + tok.encode(" Spain"), GREEDY8, namespace="decode")
    while len(b.out.output_token_ids) < 2:
        engine.step()
        engine.check_integrity()
    assert not b.finished and c.status is RequestStatus.RUNNING
    shared = set(b.kv.block_table) & set(c.kv.block_table)
    assert shared
    engine.abort("b")
    engine.check_integrity()
    assert all(engine.kv.pool.ref_count(x) == 1 for x in shared)  # c's reference only
    _run_to_end(engine)
    _assert_no_leak(engine)
    # Every full block of the prompt stays cached for the next request.
    assert engine.lookup(prompt, "decode").num_cached_tokens == 6 * B
    cold_b, cold_c = _cold(llm_cold, [prompt, prompt + tok.encode(" Spain")])
    assert b.out.output_token_ids == cold_b[: len(b.out.output_token_ids)]
    assert c.out.output_token_ids == cold_c
