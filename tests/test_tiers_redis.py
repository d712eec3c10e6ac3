"""The Redis tier against a real redis-server (tests/_redis.py): a second engine (a replica)
restores what the first computed, cold == warm; disk + Redis together (Redis fills the disk);
tenants stay apart and invalidation empties a namespace in Redis; Redis killed mid-run costs
recomputes only, and the tier comes back when Redis does."""

from __future__ import annotations

import time

import pytest
import redis
from _redis import RedisServer

from prefixcache import LLM, SamplingParams
from prefixcache.errors import TierUnavailableError
from prefixcache.tiers.keys import namespace_id
from prefixcache.tiers.redis_tier import PREFIX, RedisTier

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
MEM = "24MiB"


@pytest.fixture(scope="module")
def server():
    s = RedisServer().start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def cold(llm_cold):
    return llm_cold  # the suite's float32 engine without caching


def _prompt(salt: int, n_tokens: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % 40000 + 50 for i in range(n_tokens)]


def _tier(llm, name="redis"):
    return llm.cache_stats()["tiers"][name]


def _keys(url, namespace) -> int:
    c = redis.Redis.from_url(url)
    try:
        return len(list(c.scan_iter(match=f"{PREFIX}:{namespace_id(namespace)}:*")))
    finally:
        c.close()


@pytest.fixture(scope="module")
def a(server):
    """One replica: Redis only."""
    return LLM(kv_cache_memory=MEM, remote_cache=server.url, seed=0)


@pytest.fixture(scope="module")
def b(server, tmp_path_factory):
    """Another replica, with its own disk too."""
    disk = tmp_path_factory.mktemp("replica-b")
    return LLM(kv_cache_memory=MEM, remote_cache=server.url, disk_cache_dir=disk, seed=0)


def test_a_refused_write_is_dropped_without_taking_the_tier_down():
    """Redis answering OOM (full, ``noeviction``) refuses writes, but it is up: reads go on,
    no back-off. (A connection error is the other case: tested with a killed server below.)"""
    s = RedisServer().start()
    client = redis.Redis.from_url(s.url)
    try:
        tier = RedisTier(s.url)
        assert tier.put("n", "a", b"x" * 1000)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # any use is over it: every write is refused
        assert tier.put("n", "b", b"y" * 1000) is False
        st = tier.stats()
        assert st.available and st.dropped_writes == 1 and st.errors == 1
        assert tier.get_many("n", ["a"]) == [b"x" * 1000]
        client.config_set("maxmemory", 0)
        assert tier.put("n", "b", b"y" * 1000) and tier.stats().reconnects == 0
    finally:
        client.close()
        s.close()


def test_invalidation_drops_exactly_its_namespace_without_scanning_the_keyspace():
    """Dropping a namespace reads its index set, never SCANs all of Redis (one SCAN per
    invalidate let a tenant stall the shared Redis and the tier writer). Exactly that
    namespace's blocks go; a block Redis evicted meanwhile is a harmless stale index entry."""
    s = RedisServer().start()
    client = redis.Redis.from_url(s.url)
    try:
        tier = RedisTier(s.url)
        for ns, n in (("ns-a", 5), ("ns-b", 3), ("ns-c", 2)):
            for i in range(n):
                assert tier.put(ns, f"block-{i}", b"kv" * 10)
        client.set("someone-else:key", b"x")  # not ours: never touched
        client.delete(f"{PREFIX}:ns-a:block-0")  # as if evicted by Redis
        client.config_resetstat()
        assert tier.drop_namespace("ns-a") == 4
        ours = {k.decode() for k in client.keys(f"{PREFIX}:*")}  # (the test may scan)
        assert ours == {f"{PREFIX}:ns-b:block-{i}" for i in range(3)} | {
            f"{PREFIX}:ns-c:block-{i}" for i in range(2)
        }
        assert tier.get_many("ns-b", ["block-0", "block-1"]) == [b"kv" * 10] * 2
        assert tier.drop_namespace(None) == 5
        assert client.keys(f"{PREFIX}:*") == [] and client.get("someone-else:key") == b"x"
        assert tier.drop_namespace("ns-a") == 0  # nothing left: nothing to do
        stats = client.info("commandstats")
        assert "cmdstat_smembers" in stats  # the index was read ...
        assert "cmdstat_scan" not in stats, stats.get("cmdstat_scan")  # ... never the keyspace
    finally:
        client.close()
        s.close()


@pytest.mark.slow
def test_replica_restores_from_redis_cold_equals_warm(a, b, cold):
    lengths = [4 * BS - 1, 4 * BS, 4 * BS + 1]
    prompts = [_prompt(i, n) + [9, 8, 7] for i, n in enumerate(lengths)]
    a.generate(prompts, GREEDY)
    assert a.engine.tiers.flush()
    assert _tier(a)["written_blocks"] == sum((n + 3) // BS for n in lengths)
    # B: another replica with its own disk; the blocks come from Redis and land on its disk.
    asked = [p[:n] + [1, 2] for p, n in zip(prompts, lengths)]
    warm = b.generate(asked, GREEDY)
    expect = cold.generate(asked, GREEDY)
    assert [w.outputs[0].token_ids for w in warm] == [c.outputs[0].token_ids for c in expect]
    assert [w.num_cached_tokens for w in warm] == [n // BS * BS for n in lengths]
    st = _tier(b)
    assert st["hit_tokens"] == sum(n // BS * BS for n in lengths) and st["rejected_blocks"] == 0
    assert st["available"] is True
    assert b.engine.tiers.flush()
    assert _tier(b, "disk")["stored_blocks"] >= sum(n // BS for n in lengths)  # promoted
    b.check_integrity()


@pytest.mark.slow
def test_tenants_invalidation_and_redis_killed_mid_run(server, a, b, cold):
    secret = _prompt(50, 3 * BS + 2)
    a.generate([secret], GREEDY, cache_salt="tenant-a")
    assert a.engine.tiers.flush() and _keys(server.url, "tenant-a") == 3
    hits = _tier(b)["hit_blocks"]
    assert b.generate([secret], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert _tier(b)["hit_blocks"] == hits
    assert b.generate([secret], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 3 * BS
    b.engine.invalidate("tenant-a")  # from RAM and Redis, for every replica
    assert _keys(server.url, "tenant-a") == 0 and _keys(server.url, "tenant-b") == 3
    hits = _tier(b)["hit_blocks"]
    assert b.generate([secret], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert _tier(b)["hit_blocks"] == hits  # nothing of it comes back from Redis or disk

    # Redis dies with requests flowing: they are served by recomputing, cold == warm.
    dropped = _tier(a)["dropped_writes"]
    server.kill()
    p = _prompt(60, 3 * BS + 1)
    out = a.generate([p], GREEDY)
    assert out[0].outputs[0].token_ids == cold.generate([p], GREEDY)[0].outputs[0].token_ids
    a.engine.tiers.flush()
    st = _tier(a)  # (whether it counts as available now depends on the back-off's clock)
    assert st["errors"] >= 1 and st["dropped_writes"] > dropped
    errors = st["errors"]
    with pytest.raises(TierUnavailableError):
        a.engine.invalidate("tenant-b")
    assert _tier(a)["errors"] > errors
    # Redis is back (empty: no persistence): after the back-off the tier reconnects by itself.
    server.start()
    deadline = time.monotonic() + 30
    i = 0
    while _tier(a)["reconnects"] == 0 and time.monotonic() < deadline:
        i += 1  # new prompts: new blocks to write
        q = _prompt(100 + i, 3 * BS + 1)
        a.generate([q], SamplingParams(max_tokens=1))
        a.engine.tiers.flush()
        time.sleep(0.2)
    assert _tier(a)["reconnects"] >= 1
    q = _prompt(99, 3 * BS + 1)  # written now that the tier is back
    a.generate([q], GREEDY)
    assert a.engine.tiers.flush() and _keys(server.url, None) >= 3
    warm = b.generate([q + [5]], GREEDY)[0]  # b never saw q: Redis has it again
    assert warm.num_cached_tokens == 3 * BS
    assert warm.outputs[0].token_ids == cold.generate([q + [5]], GREEDY)[0].outputs[0].token_ids
