"""AsyncEngine end to end on the real model, in plain asyncio (``asyncio.run`` inside each test).

One engine (its step loop in a background thread) serves every test of the module; each test
leaves it idle, with no block in use.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from _helpers import BYTES_PER_TOKEN, shared_default_weights

from prefixcache.api.errors import SequenceFailedError, SlowConsumerError, TenantQuotaError
from prefixcache.api.request import SamplingParams
from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine, EngineShutDownError, QueueFullError

B = 16
MAX_WAITING = 8  # a tenant's share: half, 4
MAX_PENDING = 16  # deltas a reader may leave unread
STALL_S = 0.5
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

TEXT = (
    "Prefix caching stores the attention keys and values of a prompt so that a later request "
    "which starts with the same tokens does not compute them again. Paris is the capital of "
    "France, Berlin is the capital of Germany, and Madrid is the capital of Spain. "
)
OTHER = (
    "The river rose through the night and by morning the lower town was under water; the baker "
    "rowed his bread to the church steps while the mayor argued with the engineers. "
)


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        kv_cache_memory=64 * B * BYTES_PER_TOKEN,
        max_num_batched_tokens=64,  # chunked prefill: streams interleave with prefills
        max_waiting_requests=MAX_WAITING,
        max_pending_deltas=MAX_PENDING,
        health_stall_seconds=STALL_S,
        seed=0,
    )
    with shared_default_weights():
        eng = AsyncEngine(config)
    yield eng
    asyncio.run(eng.shutdown(drain=False))


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


def _ids(tok, text: str, n: int) -> list[int]:
    ids = tok.encode(text * 4)
    assert len(ids) >= n
    return ids[:n]


def _in_use(engine: AsyncEngine) -> int:
    return engine.cache_stats()["in_use_blocks"]


async def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until the engine holds no request and no block (aborts land between steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.engine_stats()
        if _in_use(engine) == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {engine.cache_stats()}")


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], sp=GREEDY) -> list:
    return [d async for d in engine.add_request(rid, prompt, sp)]


def test_concurrent_streams_with_shared_prefixes(engine, tok, llm_cold):
    # Two groups of four; each group shares 2 full blocks and a partial one (40 tokens).
    prefixes = [_ids(tok, TEXT, 40), _ids(tok, OTHER, 40)]
    prompts = [prefixes[i % 2] + tok.encode(f" Item {i}:") for i in range(8)]

    async def main():
        await engine.start()
        return await asyncio.gather(*(_collect(engine, f"c{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    cold = llm_cold.generate(prompts, GREEDY)
    for deltas, prompt, ref in zip(results, prompts, cold):
        assert deltas and deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
        assert deltas[0].prompt_token_ids == prompt
        tokens = [t for d in deltas for t in d.new_token_ids]
        assert tokens == ref.outputs[0].token_ids
        assert "".join(d.text_delta for d in deltas) == ref.outputs[0].text
        last = deltas[-1]
        assert last.num_output_tokens == GREEDY.max_tokens and last.num_prompt_tokens == len(prompt)
        m = last.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
    # Within each group the first request computes the prefix; the others reuse its full blocks.
    for g in (0, 1):
        cached = sorted(results[i][-1].num_cached_tokens for i in range(g, 8, 2))
        assert cached == [0, 2 * B, 2 * B, 2 * B], cached
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_break_out_of_stream_aborts_and_frees_blocks(engine, tok):
    prompt = _ids(tok, TEXT, 70)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        before = engine.engine_stats().generation_tokens_total
        got = []
        async for d in engine.add_request("brk", prompt, long):  # no reference kept
            got += d.new_token_ids
            if len(got) >= 2:
                break
        await _wait_idle(engine)
        return got, engine.engine_stats().generation_tokens_total - before

    got, generated = asyncio.run(main())
    assert len(got) >= 2
    assert generated < long.max_tokens  # stopped early, not run to the end
    engine.check_integrity()
    assert _in_use(engine) == 0
    # The prompt's computed full blocks stay cached.
    assert engine.lookup(prompt).num_cached_tokens == (70 // B) * B


def test_abort_from_another_task_ends_the_stream(engine, tok):
    prompt = _ids(tok, OTHER, 50)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        first = asyncio.Event()
        got = []

        async def consume():
            async for d in engine.add_request("ext", prompt, long):
                got.append(d)
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 60)
        engine.abort("ext")
        await asyncio.wait_for(task, 10)  # the consumer is not left waiting forever
        await _wait_idle(engine)
        return got

    got = asyncio.run(main())
    assert got and not got[-1].finished  # the stream just ends
    assert sum(len(d.new_token_ids) for d in got) < long.max_tokens
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_stream_of_a_closed_event_loop_does_not_stop_the_engine(engine, tok):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def orphan():
        await engine.start()
        engine.add_request("orphan", _ids(tok, OTHER, 30), long)  # never iterated

    asyncio.run(orphan())  # its loop closes while the request runs

    async def main():
        deltas = await asyncio.wait_for(_collect(engine, "after", _ids(tok, TEXT, 25)), 60)
        await _wait_idle(engine)  # the orphan was stopped, not run to the end
        return deltas

    assert asyncio.run(main())[-1].finished
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_queue_full_error(engine, tok):
    prompts = [_ids(tok, TEXT, 20 + i) for i in range(MAX_WAITING + 1)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        # Holding the engine lock stands for a long step: the engine thread cannot drain its
        # inbox, so nothing leaves the queue while it fills.
        with engine._lock:
            streams = [engine.add_request(f"q{i}", p, sp) for i, p in enumerate(prompts[:-1])]
            assert engine.num_waiting() == MAX_WAITING
            with pytest.raises(QueueFullError):
                engine.add_request("q-over", prompts[-1], sp)
            # A tenant refused because others filled the queue hears its own state only:
            # neither how many the others have waiting nor the global limit.
            with pytest.raises(QueueFullError) as e:
                engine.add_request("q-tenant", prompts[-1], sp, tenant="b")
            assert not isinstance(e.value, TenantQuotaError)
            assert e.value.message == (
                "the queue is full; this tenant has 0 sequences waiting and asks for 1 more "
                f"(its share is {MAX_WAITING // 2})"
            )

        async def drain(s):
            return [d async for d in s]

        return await asyncio.gather(*(drain(s) for s in streams))

    results = asyncio.run(main())
    assert all(r[-1].finished and r[-1].num_output_tokens == 4 for r in results)
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_a_tenant_over_its_share_of_the_queue_is_refused_alone(engine, tok):
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        with engine._lock:  # a long step: nothing leaves the queue while it fills
            mine = [engine.add_request(f"t{i}", _ids(tok, TEXT, 20 + i), sp, tenant="a")
                    for i in range(MAX_WAITING // 2)]  # fmt: skip
            with pytest.raises(TenantQuotaError) as e:
                engine.add_request("t-over", _ids(tok, TEXT, 30), sp, tenant="a")
            assert e.value.retry_after > 0 and isinstance(e.value, QueueFullError)
            other = engine.add_request("u0", _ids(tok, OTHER, 20), sp, tenant="b")  # still room
        return await asyncio.gather(*([_drain(s) for s in [*mine, other]]))

    results = asyncio.run(main())
    assert all(r[-1].finished for r in results)
    engine.check_integrity()
    assert _in_use(engine) == 0


async def _drain(stream) -> list:
    return [d async for d in stream]


def test_a_reader_that_stops_reading_is_cancelled_and_its_blocks_freed(engine, tok):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        before = engine.slow_consumers_total
        stream = engine.add_request("stuck", _ids(tok, TEXT, 40), long)
        deadline = time.monotonic() + 60  # cancelled after MAX_PENDING unread deltas
        while engine.slow_consumers_total == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await _wait_idle(engine)
        got, err = [], None
        try:
            async for d in stream:
                got.append(d)
        except SlowConsumerError as e:
            err = e
        return got, err, engine.slow_consumers_total - before

    got, err, slow = asyncio.run(main())
    assert isinstance(err, SlowConsumerError) and slow == 1
    assert len(got) == MAX_PENDING  # what was queued is delivered, nothing more was made
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_health_reports_a_stalled_or_dead_engine_thread(engine, tok):
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def stalled():
        await engine.start()
        assert engine.health().ok
        with engine._lock:  # a step that does not end (a hang), with work waiting
            stream = engine.add_request("h0", _ids(tok, TEXT, 20), sp)
            await asyncio.sleep(STALL_S * 3)
            h = engine.health()
        assert not h.ok and h.reason == "stalled" and h.has_work
        await _drain(stream)
        assert engine.health().ok

    asyncio.run(stalled())

    async def dead():
        real_step = engine.engine.step

        def crash():  # not an Exception: nothing in the loop may swallow it
            raise SystemExit("injected: the engine thread dies")

        engine.engine.step = crash
        try:
            with pytest.raises(EngineShutDownError):  # its consumer is not left waiting
                await asyncio.wait_for(_drain(engine.add_request("h1", _ids(tok, OTHER, 20), sp)), 30)
            assert engine.health().reason == "engine_thread_dead"
            with pytest.raises(EngineShutDownError):  # nor is the next request
                engine.add_request("h2", _ids(tok, OTHER, 20), sp)
        finally:
            engine.engine.step = real_step
        engine.engine.abort("h1")
        await engine.start()  # a new thread
        assert engine.health().ok
        assert (await _drain(engine.add_request("h3", _ids(tok, OTHER, 20), sp)))[-1].finished

    asyncio.run(dead())
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_a_failed_step_fails_its_batch_and_nobody_else(tok, llm_cold):
    """Issue #37: an exception in a step failed every tenant's requests. The forward pass is
    shared by the step's batch, so that batch fails; a request that was waiting (not in the
    batch: one slot, taken) is served afterwards, its output its solo output."""
    with shared_default_weights():
        eng = AsyncEngine(EngineConfig(kv_cache_memory="32MiB", max_num_seqs=1, seed=0))
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a_ids, b_ids = _ids(tok, TEXT, 20), _ids(tok, OTHER, 24)
    runner = eng.engine.runner
    real = runner.execute
    armed = []

    def execute(pieces):
        a = eng.engine.seqs.get("a")
        if armed and a is not None and any(p.block_table is a.kv.block_table for p in pieces):
            armed.clear()
            raise RuntimeError("injected: the forward failed")
        return real(pieces)

    async def main():
        await eng.start()
        a = eng.add_request("a", a_ids, sp, tenant="t1")
        first = await a.__anext__()  # a runs (its first token), holding the only slot
        assert first.new_token_ids
        b = eng.add_request("b", b_ids, sp, tenant="t2")
        while not eng.engine.seqs.get("b"):  # b is in the engine, waiting for the slot
            await asyncio.sleep(0.01)
        runner.execute = execute
        armed.append(1)
        with pytest.raises(SequenceFailedError):
            await _drain(a)
        out = await _drain(b)
        await eng.shutdown(drain=False)
        return out

    try:
        out = asyncio.run(main())
    finally:
        runner.execute = real
    ref = llm_cold.generate([b_ids], sp)[0].outputs[0].token_ids
    assert [t for d in out for t in d.new_token_ids] == ref and out[-1].finished
    eng.engine.check_integrity()


def test_shutdown_drain_lets_running_requests_finish(engine, tok):
    prompts = [_ids(tok, TEXT, 30) + tok.encode(f" Point {i}.") for i in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        await engine.start()
        started = [asyncio.Event() for _ in prompts]

        async def consume(i):
            out = []
            async for d in engine.add_request(f"d{i}", prompts[i], sp):
                out.append(d)
                started[i].set()
            return out

        tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await engine.shutdown(drain=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    results = asyncio.run(main())
    for r in results:
        assert r[-1].finished and r[-1].finish_reason == "length"
        assert sum(len(d.new_token_ids) for d in r) == sp.max_tokens
    engine.check_integrity()
    assert _in_use(engine) == 0


def test_requests_after_shutdown_are_refused(engine, tok):
    """Runs after the drain test (module order): the engine is shut down. A new request gets an
    immediate EngineShutDownError instead of a stream that would never produce anything."""

    async def main():
        await engine.shutdown(drain=True)  # idempotent
        with pytest.raises(EngineShutDownError, match="shutting down"):
            engine.add_request("late", _ids(tok, TEXT, 20), GREEDY)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert "late" not in engine._streams
