"""Segments work is admitted and budgeted like any prefill (docs/segments.md, "Cost and limits"):
a segments request (warm or chat) over its tenant's queue share is a 429, one over the document
or record limits a 400, and a large warm runs in pieces within the step's token budget, so
another tenant's short request sent meanwhile finishes first; the pieces change no output.

One AsyncEngine on the default model with a small step budget (64 tokens) and small limits,
behind the app in this process (httpx's ASGI transport); order of completion, never time.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from _helpers import PROSE, shared_default_weights

from prefixcache.api.request import SamplingParams
from prefixcache.api.segments import SegmentOptions, SegmentRequest
from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine
from prefixcache.engine.fairness import StepPace
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.segments.record import payload_bytes
from prefixcache.server.app import create_app

MAX_DOCS = 6
MAX_RECORD_TOKENS = 200  # the record limit, in tokens of the default model
SHARE = 2  # the tenant's share of the queue: half of max_waiting_requests
SYSTEM = {"role": "system", "content": "Answer from the records only."}
QUESTION = {"role": "user", "content": "Which record names Berlin?"}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)


def _docs(n: int, tag: str, text: str = PROSE) -> list[dict]:
    """``n`` distinct documents of ~123 tokens each (PROSE under its own title)."""
    return [{"role": "document", "title": f"{tag} record {i}", "content": text} for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        kv_cache_memory="64MiB",
        max_model_len=1024,
        max_num_batched_tokens=64,  # a 6-document warm needs ~12 steps alone, ~24 when shared
        max_waiting_requests=2 * SHARE,
        max_segments_per_request=MAX_DOCS,
        # records hold float32 K/V whatever the pool's KV dtype (segments/record.py)
        max_segment_record=payload_bytes(MAX_RECORD_TOKENS, 30, 3, 64),
        seed=0,
    )
    with shared_default_weights():
        eng = AsyncEngine(config)
    yield eng
    asyncio.run(eng.shutdown(drain=False))


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine)  # open: every caller is the admin tenant "default"


def _serve(app, test) -> None:
    async def main():
        await app.state.serving.engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            await test(http)

    asyncio.run(main())


def _warm_body(docs: list[dict], salt: str) -> dict:
    return {"messages": [SYSTEM, *docs], "cache_mode": "segments", "cache_salt": salt}


def test_segments_over_the_document_or_record_limit_are_a_400(app):
    async def test(http):
        for docs in (_docs(MAX_DOCS + 1, "many"), _docs(1, "long", PROSE * 2)):  # 7; ~240 tokens
            for path, body in (
                ("/v1/cache/warm", _warm_body(docs, "limits")),
                ("/v1/chat/completions", {"messages": [SYSTEM, *docs, QUESTION],
                                          "max_tokens": 1, "cache_mode": "segments"}),
            ):  # fmt: skip
                r = await http.post(path, json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "segment_limit_exceeded" and err["param"] == "messages"
                limit = "max_segments_per_request" if len(docs) > 1 else "max_segment_record"
                assert limit in err["message"]
        # A long document recomputed whole makes no record: not bound by the record limit.
        body = {"messages": [SYSTEM, *_docs(1, "long", PROSE * 2), QUESTION], "max_tokens": 1,
                "cache_mode": "segments", "segment_recompute_tokens": 10**6}  # fmt: skip
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        fits = _docs(MAX_DOCS, "fits", PROSE[:80])  # short: the limit is on the count
        r = await http.post("/v1/cache/warm", json=_warm_body(fits, "limits"))
        assert r.status_code == 200 and r.json()["segments"] == MAX_DOCS

    _serve(app, test)


def test_a_segments_request_over_the_tenant_share_is_a_429(app, engine):
    ids = engine.tokenizer.encode(PROSE)[:20]
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def test(http):
        # Holding the engine lock stands for a long step: nothing leaves the queue meanwhile.
        with engine._lock:
            held = [
                engine.add_request(f"fill-{i}", ids, sp, tenant="default") for i in range(SHARE)
            ]
            for path, body in (
                ("/v1/cache/warm", _warm_body(_docs(2, "quota"), "quota")),
                ("/v1/chat/completions", {"messages": [SYSTEM, *_docs(2, "quota"), QUESTION],
                                          "max_tokens": 1, "cache_mode": "segments"}),
            ):  # fmt: skip
                # Refused before anything waits on the lock (a guard, not a timing assertion).
                r = await asyncio.wait_for(http.post(path, json=body), 60)
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "tenant_quota_exceeded"
                assert "Retry-After" in r.headers
        for stream in held:
            assert [d async for d in stream][-1].finished

    _serve(app, test)


def test_a_short_request_sent_while_a_large_warm_runs_finishes_first(engine, llm):
    """The warm's documents are computed in pieces, a step at a time within the budget and its
    tenant's share: the victim's short request is scheduled between them and finishes first.
    Pieces change nothing: a chat reusing the warmed documents on this 64-token budget, run
    beside another tenant's request, equals the same chat computed cold on a 2048-token one."""
    docs, salt = _docs(MAX_DOCS, "big"), "big-warm"
    tok = engine.tokenizer
    victim_ids = tok.encode(PROSE)[:24]
    victim_sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    store = engine.engine.connectors.get("segments").store
    chat = tok.encode_chat_segments([SYSTEM, *docs, QUESTION])
    done: list[str] = []

    async def main():
        await engine.start()
        seg = tok.encode_chat_segments([SYSTEM, *docs])
        misses = store.misses

        async def warm():
            assert await engine.warm_segments(seg.token_ids, list(seg.spans), salt,
                                              tenant="attacker") == 0  # fmt: skip
            done.append("warm")

        async def victim():
            async for _ in engine.add_request("victim", victim_ids, victim_sp, tenant="victim"):
                pass
            done.append("victim")

        task = asyncio.create_task(warm())
        while store.misses == misses and not task.done():  # the warm began its first document
            await asyncio.sleep(0.005)
        await asyncio.gather(victim(), task)

        # Reuse, in pieces, beside another tenant's request.
        request = SegmentRequest(chat.spans, SegmentOptions(recompute_tokens=4))

        async def reuse():
            stream = engine.add_request("reuse", chat.token_ids, GREEDY, salt, tenant="attacker",
                                        segments=request)  # fmt: skip
            return [d async for d in stream]

        async def other():
            async for _ in engine.add_request("other", victim_ids, victim_sp, tenant="victim"):
                pass

        deltas, _ = await asyncio.gather(reuse(), other())
        return deltas

    deltas = asyncio.run(main())
    assert done == ["victim", "warm"]
    cold = llm.chat([SYSTEM, *docs, QUESTION], GREEDY, cache_salt="big-warm-cold",
                    cache_mode="segments", segment_recompute_tokens=4)[0]  # fmt: skip
    assert cold.num_segment_cached_tokens == 0  # computed alone there, reused here
    assert deltas[-1].cache.num_segment_cached_tokens == sum(b - a - 4 for a, b in chat.spans)
    assert [t for d in deltas for t in d.new_token_ids] == cold.outputs[0].token_ids
    assert [lp for d in deltas for lp in d.new_logprobs] == cold.outputs[0].logprobs
    engine.check_integrity()


class _FixedPace(StepPace):
    """A pace that ignores the wall clock (the budget does not depend on the host)."""

    def __init__(self, seconds_per_token: float) -> None:
        self.seconds_per_token = seconds_per_token

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def test_a_warms_steps_are_bounded_by_the_shared_budget_and_paced_by_the_work_done():
    """While another tenant is active, a warm's documents are computed in steps of at most the
    shared budget (40 tokens at the fixed pace), the other tenant's request runs between them,
    and each step reports to the pace exactly the tokens it computed: a warm that ends early in
    its grant does not count the rest (it did, and the next steps came out that much longer
    than shared_step_ms, the victim waiting on them)."""
    with shared_default_weights():
        eng = LLMEngine(EngineConfig(
            kv_cache_memory="32MiB", max_model_len=1024, max_num_batched_tokens=256, seed=0,
            shared_step_ms=100, shared_window_s=30,
        ))  # fmt: skip
    eng.scheduler.pace = _FixedPace(0.1 / 40)  # shared steps: 40 tokens
    eng.scheduler.clock = lambda: 0.0  # the other tenant stays active for the whole test
    # A connector that cannot say what it will spend (KVConnector.wants None): the warm is
    # granted its prompt's remainder and may end early in a grant, the case this test guards
    # (the segments connector caps its grants, the next test).
    eng.scheduler.wants = lambda seq: None
    computed, observed, granted = [0], [], []
    execute, observe = eng.runner.execute, eng.scheduler.observe_step
    schedule = eng.scheduler.schedule

    def counted_execute(pieces):  # (a warm has no probes: every piece counts whole)
        computed[0] += sum(p.n for p in pieces)
        return execute(pieces)

    def seen(tokens, seconds, rows):
        observed.append((tokens, computed[0]))
        computed[0] = 0
        observe(tokens, seconds, rows)

    def scheduled():
        out = schedule()
        if out.scheduled:  # a step that runs (and is observed)
            granted.append(out.num_batched_tokens)
        return out

    eng.runner.execute = counted_execute
    eng.scheduler.observe_step, eng.scheduler.schedule = seen, scheduled
    victim = eng.add_request("v", eng.tokenizer.encode(PROSE)[:24],
                             SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                             tenant="victim")  # fmt: skip
    seg = eng.tokenizer.encode_chat_segments([SYSTEM, *_docs(3, "paced", PROSE[:150])])
    warm = eng.add_request("w", seg.token_ids, SamplingParams(max_tokens=1, temperature=0),
                           tenant="attacker", segments=SegmentRequest(seg.spans, store_only=True))
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
        eng.check_integrity()
    assert victim.finished and warm.finished and not eng.has_unfinished()
    assembler = eng.connectors.get("segments").assembler
    assert assembler.num_stored(seg.token_ids, seg.spans, None) == 3
    sink = len(assembler.sink_of(seg.token_ids, seg.spans))
    work = sum(b - a + sink for a, b in seg.spans)  # each document computed after the sink
    assert sum(c for _, c in observed) == work + len(victim.prompt_token_ids) + 1
    assert len(observed) >= work // 40  # in pieces: no step over the shared budget
    assert all(c <= 40 for _, c in observed)
    # The pace sees what each step computed, not what it was granted ...
    assert [t for t, _ in observed] == [c for _, c in observed]
    # ... and the warm did end early in a grant (the case this guards).
    assert any(c < g for (_, c), g in zip(observed, granted))


def test_a_grant_an_assembly_cannot_spend_goes_to_the_other_sequences():
    """Three segments requests whose documents all miss, in one engine with 256-token steps:
    once its assembly has begun, a request is granted no more than its phase can spend
    (KVConnector.wants: what its documents computed alone have left, then its recomputed
    tokens), so the rest of each step goes to the other requests. With the cap off (a
    connector that cannot say), the same requests take more steps for the same tokens."""
    runs = {}
    for capped in (True, False):
        with shared_default_weights():
            eng = LLMEngine(EngineConfig(kv_cache_memory="32MiB", max_model_len=1024,
                                         max_num_batched_tokens=256, busy_step_ms=0, seed=0))  # fmt: skip
        if not capped:
            eng.scheduler.wants = lambda seq: None
        seqs = []
        for i in range(3):
            seg = eng.tokenizer.encode_chat_segments([SYSTEM, *_docs(2, f"cap {i}"), QUESTION])
            seqs.append(eng.add_request(
                f"r{i}", seg.token_ids, GREEDY,
                segments=SegmentRequest(seg.spans, SegmentOptions(recompute_tokens=3)),
            ))  # fmt: skip
        steps = 0
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
            steps += 1
        runs[capped] = (steps, [s.out.output_token_ids for s in seqs])
    (steps, tokens), (steps_off, tokens_off) = runs[True], runs[False]
    assert tokens == tokens_off
    assert steps < steps_off, (steps, steps_off)


def test_a_segments_request_the_pool_can_never_hold_while_it_assembles_is_a_400():
    """An assembling request holds its slots and scratch blocks for its documents
    computed alone: a pool that holds the prompt and its output but not that as well would
    leave the request waiting at the head of the queue for ever (no later arrival may
    overtake it). It is refused up front (context_length_exceeded); the same request with
    every document recomputed (nothing computed alone: no scratch) runs."""
    from _helpers import BYTES_PER_TOKEN

    from prefixcache.api.errors import ContextLengthError

    with shared_default_weights():
        eng = LLMEngine(EngineConfig(kv_cache_memory=10 * 16 * BYTES_PER_TOKEN, seed=0,
                                     pin_budget_fraction=0.0))  # fmt: skip
    assert eng.kv.usable_blocks == 10
    seg = eng.tokenizer.encode_chat_segments([SYSTEM, *_docs(3, "tight", PROSE[:150])])
    n, biggest = len(seg.token_ids), max(b - a for a, b in seg.spans)
    assert -(-(n + 8) // 16) <= 10 < -(-n // 16) + -(-(biggest + 1) // 16)  # the case
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(ContextLengthError, match="while it assembles"):
        eng.add_request("tight", seg.token_ids, params, segments=SegmentRequest(seg.spans))
    whole = SegmentRequest(seg.spans, SegmentOptions(recompute_tokens=biggest))
    seq = eng.add_request("whole", seg.token_ids, params, segments=whole)
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    assert len(seq.out.output_token_ids) == 8
