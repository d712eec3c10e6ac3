"""The cache routes' own threads and per-tenant cap (server/base/cache_gate.py), in process: the real
app and a real AsyncEngine on the default model, its lock held as a long step holds it, so the
cache calls that need the engine stay in flight for as long as the test wants."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _helpers import shared_default_weights

from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine
from prefixcache.server.app import create_app
from prefixcache.server.base.auth import Tenant, TenantDirectory
from prefixcache.server.base.cache_gate import CacheCallGate
from prefixcache.server.edge.errors import APIError
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.openai.prompt import completion_prompts
from prefixcache.server.openai.protocol import CompletionRequest

pytestmark = pytest.mark.slow

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
CAP = 2
LIVENESS_S = 120  # only a hang reaches it


@pytest.fixture(scope="module")
def engine():
    with shared_default_weights():
        eng = AsyncEngine(EngineConfig(kv_cache_memory="8MiB", seed=0))
    yield eng
    asyncio.run(eng.shutdown(drain=False))


async def _until(cond) -> None:
    for _ in range(LIVENESS_S * 100):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_a_flooding_tenant_gets_429_while_others_and_tokenization_go_on(engine):
    tenants = TenantDirectory({"sk-alice": Tenant("alice"), "sk-bob": Tenant("bob")})
    limits = ServerLimits(cache_route_threads=2 * CAP, max_cache_calls_per_tenant=CAP)
    app = create_app(engine, tenants=tenants, limits=limits)
    serving = app.state.serving
    gate = serving.cache_gate

    async def main():
        # One default thread: if a cache call ever ran there, tokenization would wait on it.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None) as c:
            engine._lock.acquire()  # a step that runs long: every engine query waits for it
            try:
                flood = [asyncio.create_task(c.post("/v1/cache/invalidate", json={}, headers=ALICE))
                         for _ in range(CAP)]  # fmt: skip
                await _until(lambda: gate.num_admitted("alice") == CAP)
                over = await c.post("/v1/cache/lookup", json={"prompt": [1, 2, 3]}, headers=ALICE)
                assert over.status_code == 429, over.text
                err = over.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
                assert over.headers["retry-after"] == "1"
                stats = await c.get("/v1/cache/stats", headers=ALICE)  # stats count too
                assert stats.status_code == 429
                # Bob is admitted while alice is at her cap ...
                bob = asyncio.create_task(
                    c.post("/v1/cache/lookup", json={"prompt": [1, 2, 3]}, headers=BOB)
                )
                await _until(lambda: gate.num_admitted("bob") == 1)
                # ... and tokenization runs while every cache call waits for the engine.
                req = CompletionRequest(prompt="The capital of France is", max_tokens=1)
                prompts = await asyncio.wait_for(completion_prompts(serving, req), LIVENESS_S)
                assert prompts and prompts[0]
            finally:
                engine._lock.release()
            assert [r.status_code for r in await asyncio.gather(*flood)] == [200] * CAP
            answer = await bob
            assert answer.status_code == 200 and answer.json()["num_cached_tokens"] == 0
            # Released when they finished: alice is served again.
            again = await c.post("/v1/cache/lookup", json={"prompt": [1, 2, 3]}, headers=ALICE)
            assert again.status_code == 200
        assert gate.num_admitted("alice") == gate.num_admitted("bob") == 0

    asyncio.run(main())
    gate.close()


def test_a_tenant_whose_requests_keep_being_refused_is_refused_early_alone(engine):
    """server/edge/refusals.py: past max_refusals_per_second refusals (400, 422) a tenant's requests
    are 429 too_many_refusals before their body is read, for refusal_penalty seconds, then at
    most max_refusals_per_second a second for as long; another tenant and the admin are not
    affected, and admins' refusals are not counted."""
    tenants = TenantDirectory({"sk-alice": Tenant("alice"), "sk-bob": Tenant("bob"),
                               "sk-ops": Tenant("ops", admin=True)})  # fmt: skip
    app = create_app(engine, tenants=tenants, limits=ServerLimits(max_refusals_per_second=3, refusal_penalty=30))
    now = [0.0]
    app.state.serving.refusals.clock = lambda: now[0]
    too_long = {"prompt": [5] * (engine.config.max_model_len or 8192) + [5], "max_tokens": 1}
    ok = {"prompt": [1, 2, 3]}  # a lookup (no generation: this app's engine loop is not started)
    ops = {"Authorization": "Bearer sk-ops"}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=LIVENESS_S) as c:

            async def status(body, headers, path="/v1/completions"):
                return (await c.post(path, json=body, headers=headers)).status_code

            assert [await status(b, ops) for b in [too_long] * 6] == [400] * 6  # admins: never
            bad = [too_long, {"prompt": 5}, too_long, too_long]  # a 422 counts like a 400
            assert [await status(b, ALICE) for b in bad] == [400, 422, 400, 400]
            r = await c.post("/v1/cache/lookup", json=ok, headers=ALICE)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_refusals"
            assert r.headers["retry-after"] == "30"
            assert await status({}, ALICE, "/v1/cache/invalidate") == 429  # every route
            assert await status(ok, BOB, "/v1/cache/lookup") == 200  # bob is not alice
            now[0] += 31
            assert await status(ok, ALICE, "/v1/cache/lookup") == 200  # the penalty is over
            # ... then a probation as long: at most 3 requests started a second (a herd of
            # clients back from one Retry-After is not all parsed before a refusal counts).
            assert [await status(ok, ALICE, "/v1/cache/lookup") for _ in range(3)] == [200, 200, 429]
            now[0] += 0.34
            assert await status(ok, ALICE, "/v1/cache/lookup") == 200
            now[0] += 31  # probation over: no bound but the refusals' own
            assert [await status(ok, ALICE, "/v1/cache/lookup") for _ in range(5)] == [200] * 5

    asyncio.run(main())
    assert app.state.serving.refusals.refused_early == 3


def test_a_tenant_gets_its_calls_a_second_and_no_more():
    """The rate: a bucket of per_second calls refilled at per_second a second, per tenant; the
    next call past it is a 429 with Retry-After before anything runs; another tenant and an
    admin's calls (rated=False) are not touched. Fake clock: no sleeping, no timing."""
    now = [100.0]
    gate = CacheCallGate(threads=2, per_tenant=2, per_second=3, clock=lambda: now[0])
    ran = []

    async def call(tenant: str, rated: bool = True) -> None:
        await gate.run(tenant, ran.append, tenant, rated=rated)

    async def main():
        for _ in range(3):  # a burst of one second's worth passes
            await call("alice")
        with pytest.raises(APIError) as e:
            await call("alice")
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        assert ran == ["alice"] * 3  # the refused call never ran
        await call("bob")  # another tenant has its own bucket
        for _ in range(10):
            await call("admin", rated=False)  # operators' calls are not rated
        now[0] += 0.34  # a third of a second (and a bit): one more call
        await call("alice")
        with pytest.raises(APIError):
            await call("alice")
        now[0] += 60  # idle: the bucket is full again, never more than one second's worth
        for _ in range(3):
            await call("alice")
        with pytest.raises(APIError):
            await call("alice")

    try:
        asyncio.run(main())
    finally:
        gate.close()
    assert ran.count("alice") == 7 and ran.count("bob") == 1 and ran.count("admin") == 10
