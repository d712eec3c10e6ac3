"""One sequence's failure is its own: sampling parameters are checked once at the edge, and a
sequence that still fails in sampling or output processing is finished alone while every other
sequence of its steps produces the tokens it produces alone. Fair admission across tenants.
Explanations of a miss never read another tenant's namespace (no timing or content oracle).

Runs on the session engines (real model); each test leaves them idle with no block in use.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
from _helpers import PROSE, shared_default_weights

from prefixcache import SamplingParams
from prefixcache.api.errors import InvalidRequestError, SequenceFailedError
from prefixcache.api.request import GREEDY_TEMPERATURE_EPS
from prefixcache.cache.manager import MAX_CACHED_ROOTS
from prefixcache.config import EngineConfig
from prefixcache.engine.fairness import (
    BUSY_STEP_FLOOR,
    RecentTenants,
    StepPace,
    busy_budget,
    fair_order,
    fair_share,
    memory_victim,
    rebalance,
    shared_budget,
    token_caps,
)
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.scheduler import Scheduler
from prefixcache.sequence import Sequence

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def _poisoned(field: str, value) -> SamplingParams:
    """Parameters that passed validation and then break (stands for a validation gap, a bug):
    the frozen dataclass is changed behind the validator's back."""
    p = SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)
    object.__setattr__(p, field, value)
    return p


# ---- validation at the edge ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_are_checked_once_with_a_typed_error(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_best_token(llm):
    prompts = [PROSE[:160], PROSE[200:330]]
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, cache_salt="iso-t")]
    for extreme in (
        SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True),  # 1/T overflows
        SamplingParams(max_tokens=8, temperature=GREEDY_TEMPERATURE_EPS / 2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=3, ignore_eos=True),
    ):
        outs = llm.generate(prompts, extreme, cache_salt="iso-t")
        assert [o.outputs[0].token_ids for o in outs] == greedy, extreme
    llm.check_integrity()


# ---- isolation in the step ----------------------------------------------------------------------
def test_a_failing_sequence_is_finished_alone_and_others_are_unchanged(llm, llm_cold):
    good = [PROSE[:150], PROSE[300:420], PROSE[500:580]]
    solo = [llm_cold.generate([p], GREEDY)[0].outputs[0].token_ids for p in good]
    eng = llm.engine
    seqs = {
        "g0": eng.add_request("g0", good[0], GREEDY, namespace="iso"),
        # NaN temperature: sampling divides by it, softmax is NaN, multinomial raises.
        "bad-sample": eng.add_request("bad-sample", good[1], _poisoned("temperature", math.nan)),
        "g1": eng.add_request("g1", good[1], GREEDY, namespace="iso"),
        # A stop "string" that is not one: the output processor's find() raises.
        "bad-output": eng.add_request("bad-output", good[2], _poisoned("stop", (None,))),
        "g2": eng.add_request("g2", good[2], GREEDY, namespace="iso"),
    }
    _run(eng)
    for rid in ("bad-sample", "bad-output"):
        s = seqs[rid]
        assert s.finished and s.out.finish_reason == "error", rid
        assert isinstance(s.error, SequenceFailedError) and s.error.request_id == rid
        assert s.kv.block_table == []  # its blocks went back at once
    assert [seqs[f"g{i}"].out.output_token_ids for i in range(3)] == solo
    assert all(seqs[f"g{i}"].out.finish_reason == "length" for i in range(3))
    assert eng.kv.pool.counts().in_use == 0 and not eng.seqs
    # The offline API says so instead of returning a silently short answer.
    with pytest.raises(SequenceFailedError):
        llm.generate([good[0], good[1]], [GREEDY, _poisoned("temperature", math.nan)])
    assert eng.kv.pool.counts().in_use == 0 and not eng.has_unfinished()
    llm.check_integrity()


# ---- fair admission -----------------------------------------------------------------------------
def _seq(i: int, tenant: str, priority: int = 0) -> Sequence:
    return Sequence.of(f"{tenant}{i}", [1, 2, 3], GREEDY, root=b"\0" * 16, tenant=tenant,
                       priority=priority)  # fmt: skip


def test_fair_order_interleaves_tenants_and_priority_stays_inside_a_tenant():
    a = [_seq(i, "a") for i in range(4)]
    b = [_seq(i, "b", priority=-100) for i in range(2)]  # b's priority cannot jump a
    policy = a + b  # the policy's order: a's flood arrived first
    order = fair_order(policy, running={"a": 2})
    assert [s.request_id for s in order] == ["b0", "b1", "a0", "a1", "a2", "a3"]
    assert [s.request_id for s in fair_order(policy, {})] == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert fair_order(a, {"a": 9}) == a  # alone, a tenant keeps the policy's order


def test_rebalance_preempts_only_tenants_over_their_share():
    running = [_seq(i, "a") for i in range(4)]  # a holds every slot of 4
    waiting = fair_order([_seq(9, "b"), _seq(10, "b"), _seq(11, "b")], {"a": 4})
    assert fair_share(4, {"a": 4}, waiting) == 2
    victims = rebalance(waiting, running, max_num_seqs=4)
    assert [v.request_id for v in victims] == ["a3", "a2"]  # a's newest, down to its share
    assert rebalance(fair_order([_seq(5, "a")], {"a": 4}), running, 4) == []  # alone: all slots


def test_token_caps_and_memory_victims_favour_the_tenant_with_less():
    a = [_seq(i, "a") for i in range(3)]
    b = [_seq(0, "b")]
    assert token_caps(2048, a, []) is None  # alone: no cap
    assert token_caps(2048, a, b) == {"a": 1024, "b": 1024}
    assert memory_victim(a + b).request_id == "a2"  # not b's only sequence, though newest
    assert memory_victim(a).request_id == "a2"


def test_long_prefills_of_one_tenant_leave_room_in_every_step(llm_cold):
    """Tenant a's prefills would take every token of the next steps; b's request is admitted at
    once because a gets half a step while b waits, and what b leaves goes back to a."""
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(
            kv_cache_memory="32MiB", max_num_batched_tokens=64, seed=0,
            shared_step_ms=0, busy_step_ms=0,  # full steps: this test is about the caps
        ))  # fmt: skip
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long = [PROSE[i * 50 :] for i in range(3)]  # ~150+ tokens each: several chunks of 64
    a = [eng.add_request(f"a{i}", p, sp, tenant="a") for i, p in enumerate(long)]
    eng.step()  # a alone: the whole step is a's
    assert eng.scheduler.counters.batched_tokens == 64
    b = eng.add_request("b0", PROSE[:60], sp, tenant="b")
    eng.step()
    assert b in eng.scheduler.running and b.kv.num_computed_tokens > 0  # admitted, computing
    assert eng.scheduler.counters.batched_tokens == 128  # and the step was still full
    _run(eng)
    refs = llm_cold.generate(long + [PROSE[:60]], sp)
    assert [s.out.output_token_ids for s in a] + [b.out.output_token_ids] == [
        r.outputs[0].token_ids for r in refs
    ]


def test_step_pace_recent_tenants_and_the_shared_budget():
    pace = StepPace()
    assert pace.tokens_within(0.25) is None  # unknown before the first step
    assert shared_budget(2048, 2, pace, 0.25, floor=16) == 2048  # ... so no bound yet
    pace.observe(100, 0.5)  # 5 ms a token
    assert pace.tokens_within(0.25) == 50
    pace.observe(0, 1.0)  # an empty step says nothing about the pace
    assert pace.tokens_within(0.25) == 50
    pace.observe(100, 1.0)  # slower steps move the average by ALPHA of the difference
    assert pace.seconds_per_token == pytest.approx(0.005 + StepPace.ALPHA * 0.005)
    pace = StepPace()
    pace.observe(100, 0.5)
    assert shared_budget(2048, 1, pace, 0.25, floor=16) == 2048  # one tenant: every token
    assert shared_budget(2048, 2, pace, 0.25, floor=16) == 50
    assert shared_budget(2048, 4, pace, 0.25, floor=16) == 64  # a block per tenant at least
    assert shared_budget(2048, 2, pace, 0.0, floor=16) == 2048  # 0: the bound is off
    assert shared_budget(40, 2, pace, 0.25, floor=16) == 40  # never above the configured max
    recent = RecentTenants(window=10, limit=3)
    recent.touch(["a", "b"], now=0)
    recent.touch(["a"], now=8)
    assert recent.active(now=9) == {"a", "b"}
    assert recent.active(now=11) == {"a"}  # b's last work was 11 s ago
    recent.touch(["c", "d", "e"], now=12)
    assert recent.active(now=12) == {"c", "d", "e"}  # bounded: the oldest is forgotten


def test_busy_budget():
    pace = StepPace()
    assert busy_budget(2048, 3, pace, 0.1) == 2048  # pace unknown: no bound yet
    pace.observe(100, 0.5)  # 5 ms a token
    assert busy_budget(2048, 1, pace, 0.1) == 2048  # a sequence alone: every token
    assert busy_budget(2048, 2, pace, 0.1) == BUSY_STEP_FLOOR  # 20 fit: the floor
    assert busy_budget(2048, 2, pace, 1.0) == 200
    assert busy_budget(2048, 2, pace, 0.0) == 2048  # 0: off
    assert busy_budget(100, 2, pace, 1.0) == 100  # never above the configured max


def test_busy_steps_are_paced_by_prefill_steps_only():
    """A decode row costs several prefill tokens, so a step of mostly decode rows would make the
    pace look slow and shrink busy steps to their floor (random 256 at concurrency 8 lost a
    third of its throughput that way): the busy pace counts only steps whose tokens are at least
    4x their rows; the shared pace counts every step."""
    sched = Scheduler(EngineConfig(kv_cache_memory="4MiB", seed=0), kv=None)
    sched.observe_step(12, 0.1, rows=8)  # 8 decode rows and a few prompt tokens: not prefill
    assert sched.prefill_pace.seconds_per_token is None
    assert sched.pace.seconds_per_token == pytest.approx(0.1 / 12)
    sched.observe_step(256, 0.128, rows=8)  # a prefill chunk beside the decodes
    assert sched.prefill_pace.seconds_per_token == pytest.approx(0.0005)


def test_a_burst_of_prompts_gets_short_steps_and_first_tokens_in_turn(llm_cold):
    """Three long prompts of one tenant arrive together: each step carries what fits in
    busy_step_ms at the (fixed) pace, so the first prompt's first token comes steps before the
    last's, not with it; a prompt alone gets whole steps. Outputs equal the solo runs."""
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(kv_cache_memory="32MiB", max_num_batched_tokens=512, seed=0,
                                     busy_step_ms=100))  # fmt: skip
    eng.scheduler.prefill_pace = _FixedPace(0.1 / 128)  # 128 prefill tokens in 100 ms
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long = [eng.tokenizer.encode((PROSE * 3)[i * 80 :])[:300] for i in range(3)]
    seqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(long)]
    firsts, steps = {}, 0
    while eng.has_unfinished():
        before = eng.scheduler.counters.batched_tokens
        eng.step()
        steps += 1
        assert eng.scheduler.counters.batched_tokens - before <= 128
        for s in seqs:
            if s.out.output_token_ids and s.request_id not in firsts:
                firsts[s.request_id] = steps
    assert firsts["r0"] < firsts["r2"] - 2  # r0's first token several steps before r2's
    refs = llm_cold.generate(long, sp)
    assert [s.out.output_token_ids for s in seqs] == [r.outputs[0].token_ids for r in refs]
    alone = eng.add_request("alone", long[0][:250], sp)
    eng.step()  # a sequence alone: the whole budget
    assert alone.kv.num_computed_tokens == 250


class _FixedPace(StepPace):
    """A pace that ignores the wall clock, so the test's budgets do not depend on the host."""

    def __init__(self, seconds_per_token: float) -> None:
        self.seconds_per_token = seconds_per_token

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def test_steps_are_short_while_another_tenant_is_active(llm_cold):
    """Tenant a's long prefills take whole 256-token steps while it is alone; once tenant b has
    a request, every step carries only the tokens that fit in shared_step_ms (here 40 at the
    fixed pace), b's short prompt is computed in a first step of its own, and the bound holds
    while b was active within the window, then a gets full steps again. Every output equals its solo
    run (the exact path does not depend on how steps are cut)."""
    now = [0.0]
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(
            kv_cache_memory="32MiB", max_num_batched_tokens=256, seed=0,
            shared_step_ms=100, shared_window_s=30, busy_step_ms=0,  # tenants' bound alone
        ))  # fmt: skip
    eng.scheduler.pace = _FixedPace(0.1 / 40)
    eng.scheduler.clock = lambda: now[0]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long = [(PROSE * 3)[i * 80 :] for i in range(3)]  # ~1,000 tokens: several full steps
    a = [eng.add_request(f"a{i}", p, sp, tenant="a") for i, p in enumerate(long)]
    eng.step()
    assert eng.scheduler.counters.batched_tokens == 256  # alone: the whole budget
    short = eng.tokenizer.encode(PROSE[:60])[:18]  # <= the step's 40
    # b's own namespace: nothing of a's prompts (which start with the same prose) is a hit
    b = eng.add_request("b0", short, sp, tenant="b", namespace="b")
    progress = {s.request_id: s.kv.num_computed_tokens for s in a}
    before = eng.scheduler.counters.batched_tokens
    eng.step()
    # b's first chunk runs alone (a's sequences wait one step): its first token at once
    assert eng.scheduler.counters.batched_tokens - before == len(short)
    assert len(b.out.output_token_ids) == 1 and eng.scheduler.counters.first_steps == 1
    assert all(s.kv.num_computed_tokens == progress[s.request_id] for s in a)
    while not b.finished:
        before = eng.scheduler.counters.batched_tokens
        eng.step()
        assert eng.scheduler.counters.batched_tokens - before <= 40
    now[0] += 10  # b is between requests: a's steps stay short
    before = eng.scheduler.counters.batched_tokens
    eng.step()
    assert eng.scheduler.counters.batched_tokens - before <= 40
    shared = eng.scheduler.counters.shared_steps
    assert shared >= 3 and eng.stats().num_shared_steps_total == shared
    now[0] += 31  # b's window is over: a is alone again
    before = eng.scheduler.counters.batched_tokens
    eng.step()
    assert eng.scheduler.counters.batched_tokens - before > 40
    assert eng.scheduler.counters.shared_steps == shared
    _run(eng)
    refs = llm_cold.generate(long + [short], sp)
    got = [s.out.output_token_ids for s in a] + [b.out.output_token_ids]
    assert got == [r.outputs[0].token_ids for r in refs]
    assert eng.kv.pool.counts().in_use == 0


def test_a_tenant_cannot_stay_newly_arrived(llm_cold):
    """Issue #37: one-token requests finish in their first step, so their tenant had nothing
    running at every step and got every other step to itself as a newcomer. Now a tenant gets
    a newcomer step at most once every 2 x (active tenants) steps; the busy tenants' outputs
    are their solo outputs all the same."""
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(
            kv_cache_memory="32MiB", max_num_batched_tokens=256, seed=0,
            shared_step_ms=100, shared_window_s=30, busy_step_ms=0,
        ))  # fmt: skip
    eng.scheduler.pace = _FixedPace(0.1 / 40)
    sp = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)  # busy past the steps
    busy = [PROSE[i * 50 : i * 50 + 120] for i in range(2)]
    seqs = [eng.add_request(f"{t}", p, sp, tenant=t) for t, p in zip("ac", busy, strict=True)]
    tiny = SamplingParams(max_tokens=1, temperature=0)
    alone = 0  # steps that ran tenant t's sequences and nobody else's
    steps = 60
    real = eng.scheduler.schedule

    def schedule():
        nonlocal alone
        out = real()
        tenants = {x.seq.tenant for x in out.scheduled}
        alone += tenants == {"t"}
        return out

    eng.scheduler.schedule = schedule
    for i in range(steps):
        if not any(s.tenant == "t" for s in eng.scheduler.waiting):
            eng.add_request(f"t{i}", [5 + i, 7, 9], tiny, tenant="t")  # always one waiting
        eng.step()
        eng.check_integrity()
    assert not any(s.finished for s in seqs)
    # 3 tenants: a newcomer step for t at most every 6 steps (it was every other one: ~30).
    assert 0 < alone <= steps // 6 + 1, alone
    assert eng.scheduler.counters.first_steps <= steps // 6 + 3
    _run(eng)
    refs = llm_cold.generate(busy, sp)
    assert [s.out.output_token_ids for s in seqs] == [r.outputs[0].token_ids for r in refs]


def test_a_flooding_tenant_does_not_hold_the_batch(llm_cold):
    """Tenant a fills every slot; tenant b's request is admitted at the next step by preempting
    a's newest sequence, and everybody's tokens equal their solo runs (preemption keeps them)."""
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(kv_cache_memory="32MiB", max_num_seqs=4, seed=0))
    flood = [PROSE[i * 40 : i * 40 + 90] for i in range(6)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = [eng.add_request(f"a{i}", p, sp, tenant="a") for i, p in enumerate(flood)]
    for _ in range(3):
        eng.step()
    assert sum(s.tenant == "a" for s in eng.scheduler.running) == 4
    victim = eng.add_request("b0", PROSE[100:190], sp, tenant="b")
    eng.step()
    assert victim in eng.scheduler.running  # admitted at once, not after a's flood
    assert eng.scheduler.counters.fairness_preemptions == 1
    _run(eng)
    refs = llm_cold.generate(flood + [PROSE[100:190]], sp)
    got = [s.out.output_token_ids for s in a] + [victim.out.output_token_ids]
    assert got == [r.outputs[0].token_ids for r in refs]
    assert eng.kv.pool.counts().in_use == 0


# ---- no side channels through explanations --------------------------------------------------------
def test_explaining_a_miss_reads_other_namespaces_only_for_admins(llm):
    eng = llm.engine
    ids = llm.get_tokenizer().encode(PROSE)[:40]
    llm.generate([ids], GREEDY, cache_salt="side-a")  # "side-a" holds the prompt's blocks
    spy = mock.patch.object(eng.kv, "root", wraps=eng.kv.root)
    with spy as root:
        e = eng.explain(ids, "side-b")
    # Nothing of another namespace was even hashed: answer and cost are side-b's alone.
    assert e.reason == "no_prior_request"
    assert {c.args[0] for c in root.call_args_list} == {"side-b"}
    assert eng.explain(ids, "side-b", across=True).reason == "other_namespace"  # the admin's view


def test_the_namespace_registry_is_bounded(llm):
    eng = llm.engine
    short = llm.get_tokenizer().encode("Hi there")  # no full block: nothing is cached
    for i in range(20):
        llm.generate([short], SamplingParams(max_tokens=1), cache_salt=f"salt-{i}")
    assert not any(str(ns).startswith("salt-") for ns in eng.kv.pool.index.namespaces())
    for i in range(MAX_CACHED_ROOTS + 10):  # every salt a client invents is a root
        eng.kv.root(f"r{i}")
    assert len(eng.kv._roots) <= MAX_CACHED_ROOTS
