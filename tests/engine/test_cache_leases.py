"""Cache leases (engine/leases.py): Anthropic cache breakpoints held as pins with a TTL on the
engine's clock, charged to the tenant's pin quota.

First on a bare block pool (what a lease gets: accepted, clipped, rejected and why; renewal;
expiry at an injected time), then through the server in this process with the official
``anthropic`` client and an injected engine clock: a breakpoint's prefix survives an eviction
storm while its lease lasts and is evicted like any block once the clock passes its TTL (no
sleeping); a lease past the tenant's quota is refused while the request runs; tenants' quotas
sum within the budget, so one tenant's leases never take another's room.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from _helpers import BYTES_PER_TOKEN, shared_default_weights

from prefixcache.api.request import CacheLease, SamplingParams
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.hashing import hash_blocks, root_hash
from prefixcache.cache.manager import KVCacheManager
from prefixcache.engine.leases import grant_leases
from prefixcache.sequence import Sequence

B = 16


def computed_seq(pool: BlockPool, n_tokens: int, tenant: str | None = "alice") -> Sequence:
    """A sequence whose prompt is computed and registered (what a step's commit leaves)."""
    tokens = random.Random(n_tokens).choices(range(1000, 30000), k=n_tokens)
    root = root_hash("m", tenant, block_size=B)
    seq = Sequence.of("r", tokens, SamplingParams(), root, namespace=tenant, tenant=tenant)
    n = n_tokens // B
    seq.kv.block_table = pool.allocate(-(-n_tokens // B))
    keys = hash_blocks(tokens, B, root)
    for i in range(n):
        parent = root if i == 0 else keys[i - 1]
        pool.register(seq.kv.block_table[i], keys[i], parent, tokens[i * B : (i + 1) * B], tenant,
                      group=tenant)  # fmt: skip
    seq.kv.num_registered_blocks = n
    seq.kv.num_computed_tokens = n_tokens
    return seq


def grant(pool, seq, *leases, now=0.0, max_ttl=3600.0, caching=True):
    return grant_leases(KVCacheManager(pool, "m"), seq, [CacheLease(*x) for x in leases],
                        now=now, max_ttl=max_ttl, caching=caching)  # fmt: skip


def test_what_a_lease_gets():
    pool = BlockPool(32, B, max_pinned_blocks=8)
    pool.set_pin_quotas({"alice": 4, "bob": 4})
    seq = computed_seq(pool, 70)  # 4 whole blocks and a tail
    short, whole = grant(pool, seq, (40, 300.0), (70, 3600.0), max_ttl=600.0)
    assert (short.status, short.num_tokens, short.ttl_seconds) == ("accepted", 32, 300.0)
    assert (whole.status, whole.num_tokens, whole.ttl_seconds) == ("clipped", 64, 600.0)
    assert pool.pinned_by("alice") == 4
    # Renewal costs no quota: the same prefix again is accepted at the quota.
    assert grant(pool, seq, (70, 300.0))[0].status == "accepted"
    assert pool.pinned_by("alice") == 4
    tiny, = grant(pool, seq, (15, 300.0))
    off, = grant(pool, seq, (70, 300.0), caching=False)
    assert (tiny.status, tiny.reason, off.reason) == ("rejected", "shorter_than_a_block",
                                                       "caching_disabled")  # fmt: skip
    # Bob's quota is his own: a 5-block prefix is over it; nothing of it is pinned.
    big = computed_seq(pool, 5 * B, tenant="bob")
    over, = grant(pool, big, (5 * B, 300.0))
    assert (over.status, over.reason, over.num_tokens) == ("rejected", "pin_quota_exceeded", 0)
    assert pool.pinned_by("bob") == 0
    # Within his quota, Bob's lease is held beside Alice's: the quotas sum within the budget.
    assert grant(pool, big, (4 * B, 300.0))[0].status == "accepted"
    pool.check_integrity()


def test_a_lease_ends_at_its_deadline_on_the_injected_clock():
    pool = BlockPool(8, B, max_pinned_blocks=4)
    seq = computed_seq(pool, 2 * B, tenant=None)
    grant(pool, seq, (2 * B, 300.0), now=1000.0)
    pool.release(seq.kv.block_table)
    assert pool.counts().pinned == 2 and pool.num_allocatable == 8 - 2 - 0
    assert pool.expire_pins(1299.0) == 0
    assert pool.allocate(7) is None  # the leased blocks are not evictable
    assert pool.expire_pins(1300.0) == 2
    assert pool.allocate(8) is not None  # now they are


# ---- through the server, on an injected clock ---------------------------------------------------

KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": ("ops", True)}
SYSTEM = ("You are the handbook assistant of the Example company. Answer every question about "
          "holidays, expenses and travel in one short sentence.")  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def served():
    from prefixcache.config import EngineConfig
    from prefixcache.engine.async_engine import AsyncEngine
    from prefixcache.server.app import create_app
    from prefixcache.server.base.auth import Tenant, TenantDirectory

    clock = Clock()
    # 34 blocks of 16 tokens, 8 of them pinnable: alice and bob 4 each.
    config = EngineConfig(kv_cache_memory=34 * 16 * BYTES_PER_TOKEN, max_model_len=1024, seed=0)
    with shared_default_weights():
        engine = AsyncEngine(config, clock=clock)
    keys = {k: Tenant(*v) if isinstance(v, tuple) else Tenant(v) for k, v in KEYS.items()}
    app = create_app(engine, tenants=TenantDirectory(keys))
    yield app, clock
    asyncio.run(engine.shutdown(drain=False))


def run(served, test) -> None:
    """``test(client_of, http)`` on a started engine: ``client_of(key)`` is the official
    async client for that key, ``http`` a plain client of the same app."""
    import anthropic
    import httpx2

    app, clock = served

    async def main():
        await app.state.serving.engine.start()
        transport = httpx2.ASGITransport(app=app)
        clients = []

        def client_of(key: str):
            http = httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1")
            clients.append(http)
            return anthropic.AsyncAnthropic(api_key=key, base_url="http://127.0.0.1",
                                            http_client=http, max_retries=0)  # fmt: skip

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:  # fmt: skip
            try:
                await test(client_of, http, clock)
            finally:
                for c in clients:
                    await c.aclose()

    asyncio.run(main())


async def ask(client, user: str, ttl: str = "5m", system: str = SYSTEM, salt: str | None = None):
    extra = {"temperature": 0}
    if salt:
        extra["cache_salt"] = salt
    return await client.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, extra_body=extra,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": ttl}}],
        messages=[{"role": "user", "content": user}],
    )  # fmt: skip


_storms = iter(range(10**6))


async def storm(http, key: str, n: int = 6) -> None:
    """Unique prompts of 7 blocks each through a 34-block pool: unpinned blocks go."""
    for _ in range(n):
        ids = random.Random(next(_storms)).choices(range(1000, 30000), k=120)
        r = await http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"prompt": ids, "max_tokens": 1, "cache_salt": "storm"})  # fmt: skip
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_a_breakpoint_survives_eviction_until_its_ttl_ends(served):
    async def test(client_of, http, clock):
        alice = client_of("sk-alice")
        first = await ask(alice, "How many vacation days do I get?")
        lease = first.model_extra["cache_leases"][0]
        assert lease["status"] == "accepted" and lease["ttl_seconds"] == 300.0
        held = lease["cached_tokens"]
        assert held == lease["prompt_tokens"] // 16 * 16 > 0
        assert first.usage.cache_creation_input_tokens == held
        assert first.usage.cache_creation.ephemeral_5m_input_tokens == held
        clock.t += 299  # within the TTL: the storm cannot evict the leased prefix
        await storm(http, "sk-alice")
        again = await ask(alice, "Can I carry days over to next year?")
        assert again.usage.cache_read_input_tokens == held  # read (and the lease renewed)
        assert again.usage.cache_creation_input_tokens == 0
        clock.t += 301  # past the renewed deadline: evictable like any block
        await storm(http, "sk-alice")
        late = await ask(alice, "Who approves travel?")
        assert late.usage.cache_read_input_tokens == 0
        assert late.usage.cache_creation_input_tokens == held

    run(served, test)


@pytest.mark.slow
def test_leases_past_the_quota_are_refused_and_quotas_do_not_crowd_out(served):
    async def test(client_of, http, clock):
        alice, bob = client_of("sk-alice"), client_of("sk-bob")
        long_system = SYSTEM + " Quote the handbook section you answer from, by its number."
        big = await ask(bob, "Hello", system=long_system * 3, salt="q")
        lease = big.model_extra["cache_leases"][0]
        assert lease["prompt_tokens"] >= 5 * 16, lease  # more than bob's quota of 4 blocks
        assert (lease["status"], lease["reason"], lease["cached_tokens"]) == (
            "rejected", "pin_quota_exceeded", 0)
        assert big.content and big.stop_reason in ("end_turn", "max_tokens")  # it ran anyway
        # Bob leases up to his quota; alice's lease is still held beside his.
        clock.t += 10_000  # every earlier lease has ended
        assert (await ask(bob, "Hi", salt="q2")).model_extra["cache_leases"][0]["status"] == "accepted"
        mine = await ask(alice, "Hi", salt="q2")
        assert mine.model_extra["cache_leases"][0]["status"] == "accepted"
        # Bob sent the same prompt: alice read nothing of his (namespaces are per tenant).
        assert mine.usage.cache_read_input_tokens == 0

    run(served, test)


# ---- retention priorities through the server ----------------------------------------------------

LONG_SYSTEM = (SYSTEM + " Quote the handbook section you answer from, by its number.") * 3


@pytest.mark.slow
def test_a_lease_refused_over_the_quota_still_ranks_its_prefix(served):
    """Bob's breakpoint is over his pin quota: no pin, but its prefix ranks 100 among his own
    blocks for its TTL, so his own storm of unique prompts evicts those first."""

    async def test(client_of, http, clock):
        clock.t += 10_000  # every earlier lease and rank has ended
        bob = client_of("sk-bob")
        big = await ask(bob, "Hello", system=LONG_SYSTEM, salt="ranked")
        lease = big.model_extra["cache_leases"][0]
        assert (lease["status"], lease["reason"]) == ("rejected", "pin_quota_exceeded")
        prefix = lease["prompt_tokens"] // 16 * 16
        await storm(http, "sk-bob", n=8)  # 8 x 8 blocks through 34: every unranked block goes
        again = await ask(bob, "Goodbye", system=LONG_SYSTEM, salt="ranked")
        assert again.usage.cache_read_input_tokens >= prefix
        clock.t += 301  # the rank ended with the lease's TTL: evictable like the rest
        await storm(http, "sk-bob", n=8)
        late = await ask(bob, "Hello again", system=LONG_SYSTEM, salt="ranked")
        assert late.usage.cache_read_input_tokens == 0

    run(served, test)


def _chat(user: str, **fields) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "temperature": 0,
            "cache_salt": "rp", "messages": [{"role": "system", "content": LONG_SYSTEM},
                                             {"role": "user", "content": user}], **fields}  # fmt: skip


@pytest.mark.slow
def test_retention_priority_on_the_openai_routes_and_its_bad_values(served):
    async def test(client_of, http, clock):
        clock.t += 10_000
        alice = {"Authorization": "Bearer sk-alice"}

        async def cached(user: str, **fields) -> int:
            r = await http.post("/v1/chat/completions", headers=alice, json=_chat(user, **fields))
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        await cached("Where do I file expenses?", retention_priority=100,
                     retention_priority_seconds=600)  # fmt: skip
        await storm(http, "sk-alice", n=8)
        assert await cached("Who approves travel?") >= 96  # the ranked prompt outlived it
        clock.t += 601  # its rank ended: the next storm takes it
        await storm(http, "sk-alice", n=8)
        assert await cached("Who approves travel?") == 0
        bad = [({"retention_priority": 101}, 400, "retention_priority"),
               ({"retention_priority": -1}, 400, "retention_priority"),
               ({"retention_priority": "high"}, 422, "retention_priority"),
               ({"retention_priority": True}, 422, "retention_priority"),
               ({"retention_priority": 50, "retention_priority_seconds": 0}, 400,
                "retention_priority_seconds"),
               ({"retention_priority_seconds": 60}, 400, "retention_priority_seconds")]  # fmt: skip
        for fields, status, param in bad:
            r = await http.post("/v1/chat/completions", headers=alice, json=_chat("Hi", **fields))
            assert r.status_code == status, (fields, r.text)
            assert r.json()["error"]["param"] == param, r.text
        r = await http.post("/v1/completions", headers=alice, json={
            "prompt": "Paris is", "max_tokens": 1, "retention_priority": 1000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "retention_priority"
        r = await http.post("/v1/messages", headers={"x-api-key": "sk-alice"}, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 1, "retention_priority": 101,
            "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "retention_priority" in r.json()["error"]["message"]
        ok = await client_of("sk-alice").messages.create(
            model="SmolLM2-135M-Instruct", max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"retention_priority": 90, "retention_priority_seconds": 60})  # fmt: skip
        assert ok.content is not None

    run(served, test)
