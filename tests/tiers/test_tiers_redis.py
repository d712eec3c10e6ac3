"""The Redis tier against a real redis-server (tests/_redis.py): a second engine (a replica,
same secret) restores what the first computed, cold == warm; disk + Redis together (Redis fills
the disk); tenants stay apart and invalidation empties a namespace in Redis; two deployments
(different secrets) on one Redis never see each other's blocks, and one's record planted under
the other's name is rejected; a record over the size cap is not sent and a write that times out
on a Redis that answers does not take the tier down; a flooding tenant cannot evict another
below its share (our account, shared by replicas, acts before Redis's own LRU); Redis killed
mid-run costs recomputes only, and the tier comes back when Redis does."""

from __future__ import annotations

import os
import time

import pytest
import redis
from _redis import RedisServer

from prefixcache import LLM, SamplingParams
from prefixcache.api.errors import TierUnavailableError
from prefixcache.tiers.keys import StoreLayout, namespace_id
from prefixcache.tiers.manager import TierManager
from prefixcache.tiers.records import BlockRef
from prefixcache.tiers.redis_tier import PREFIX, RedisTier
from prefixcache.tiers.secret import TierKeys
from prefixcache.tiers.shares import owner_id

BS = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
MEM = "24MiB"
SECRET = b"the replicas' shared secret, 32+ bytes"
KEYS = TierKeys.from_secret(SECRET)
OWNER = owner_id("alice", KEYS)


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
        return len(list(c.scan_iter(match=f"{PREFIX}:{namespace_id(namespace, KEYS)}:*")))
    finally:
        c.close()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """The deployment's secret: replicas sharing a Redis must share it."""
    f = tmp_path_factory.mktemp("secret") / "tier-secret"
    f.write_bytes(SECRET)
    f.chmod(0o600)
    return f


@pytest.fixture(scope="module")
def a(server, secret_file):
    """One replica: Redis only."""
    return LLM(kv_cache_memory=MEM, remote_cache=server.url, tier_secret_file=secret_file, seed=0)


@pytest.fixture(scope="module")
def b(server, secret_file, tmp_path_factory):
    """Another replica, with its own disk too."""
    disk = tmp_path_factory.mktemp("replica-b")
    return LLM(kv_cache_memory=MEM, remote_cache=server.url, disk_cache_dir=disk,
               tier_secret_file=secret_file, seed=0)  # fmt: skip


def _restore(m: TierManager, namespace, ref) -> list:
    job = m.submit_restore("r", namespace, [ref])
    while not job.done:
        m.wait_completed(0.05)
    m.take_completed()
    return job.found


def test_two_deployments_on_one_redis_never_see_each_others_blocks(server):
    layout = StoreLayout(model_fingerprint="m", block_size=16, num_layers=2, num_kv_heads=1,
                         head_dim=8, kv_dtype="float32", scaled=False, block_bytes=256)  # fmt: skip
    ref = BlockRef(b"k" * 16, b"p" * 16 + b"t" * 64)

    def deployment(secret: bytes) -> TierManager:
        keys = TierKeys.from_secret(secret)
        return TierManager([RedisTier(server.url, scope=keys.deployment_id)], layout, keys)

    ours, theirs = deployment(SECRET), deployment(b"another deployment's secret, 32+ bytes")
    replica = deployment(SECRET)
    client = redis.Redis.from_url(server.url)
    try:
        ours.offload("alice", [(ref, bytes(range(256)))])
        assert ours.flush()
        assert _restore(theirs, "alice", ref) == []  # same tenant name, same block: not found
        st = theirs.tiers[0].stats()
        assert st.miss_blocks == 1 and st.rejected_blocks == 0  # never even read
        assert len(_restore(replica, "alice", ref)) == 1  # the same secret shares
        # Someone who can write to the Redis copies our record under their name: rejected.
        mine = f"{PREFIX}:{ours.namespace_id('alice')}:{ours.record_name(ref.key)}"
        planted = f"{PREFIX}:{theirs.namespace_id('alice')}:{theirs.record_name(ref.key)}"
        client.set(planted, client.get(mine))
        assert _restore(theirs, "alice", ref) == []
        assert theirs.tiers[0].stats().rejected_by_reason == {"mac": 1}
        # Their "invalidate everything" drops their records, never ours.
        theirs.offload("bob", [(ref, bytes(range(256)))])
        assert theirs.flush()
        theirs.invalidate(None, all_namespaces=True)
        assert _restore(theirs, "bob", ref) == []
        assert len(_restore(replica, "alice", ref)) == 1
    finally:
        client.close()
        for m in (ours, theirs, replica):
            m.close()


def test_an_oversize_record_is_not_sent_and_a_slow_write_leaves_redis_up():
    s = RedisServer().start()
    client = redis.Redis.from_url(s.url)
    try:
        tier = RedisTier(s.url, socket_timeout=0.3, max_value_bytes=1000)
        assert tier.put("n", "big", b"x" * 1001, owner=OWNER) is False
        st = tier.stats()
        assert st.oversize_writes == 1 and st.dropped_writes == 1 and st.available
        assert not client.exists(f"{PREFIX}:n:big")
        assert tier.put("n", "small", b"y" * 1000, owner=OWNER)
        # A write that outlasts the socket timeout while the server answers (here: writes are
        # paused on the server) costs that write only: the tier stays up, reads go on.
        client.client_pause(5000, all=False)
        assert tier.put("n", "slow", b"z" * 10, owner=OWNER) is False
        st = tier.stats()
        assert st.available and st.errors == 1 and st.dropped_writes == 2
        assert tier.get_many("n", ["small"]) == [b"y" * 1000]
        client.client_unpause()
        assert tier.put("n", "after", b"w", owner=OWNER) and tier.stats().reconnects == 0
    finally:
        client.close()
        s.close()


def test_a_refused_write_is_dropped_without_taking_the_tier_down():
    """Redis answering OOM (full, ``noeviction``) refuses writes, but it is up: reads go on,
    no back-off. (A connection error is the other case: tested with a killed server below.)"""
    s = RedisServer().start()
    client = redis.Redis.from_url(s.url)
    try:
        tier = RedisTier(s.url)
        assert tier.put("n", "a", b"x" * 1000, owner=OWNER)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # any use is over it: every write is refused
        assert tier.put("n", "b", b"y" * 1000, owner=OWNER) is False
        st = tier.stats()
        assert st.available and st.dropped_writes == 1 and st.errors == 1
        assert tier.get_many("n", ["a"]) == [b"x" * 1000]
        client.config_set("maxmemory", 0)
        assert tier.put("n", "b", b"y" * 1000, owner=OWNER) and tier.stats().reconnects == 0
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
                assert tier.put(ns, f"block-{i}", b"kv" * 10, owner=OWNER)
        client.set("someone-else:key", b"x")  # not ours: never touched
        client.delete(f"{PREFIX}:ns-a:block-0")  # as if evicted by Redis
        client.config_resetstat()
        assert tier.drop_namespace("ns-a", owner=OWNER) == 4
        assert tier.account() == {OWNER: 5 * 20}  # the evicted one is out of the account too
        tier.check_integrity()
        ours = {k.decode() for k in client.keys(f"{PREFIX}:*")}  # (the test may scan)
        assert ours == {f"{PREFIX}:ns-b:block-{i}" for i in range(3)} | {
            f"{PREFIX}:ns-c:block-{i}" for i in range(2)
        }
        assert tier.get_many("ns-b", ["block-0", "block-1"]) == [b"kv" * 10] * 2
        assert tier.drop_namespace(None) == 5
        assert tier.account() == {} and client.keys("pc-kv-*") == []
        assert client.keys(f"{PREFIX}:*") == [] and client.get("someone-else:key") == b"x"
        assert tier.drop_namespace("ns-a") == 0  # nothing left: nothing to do
        stats = client.info("commandstats")
        assert "cmdstat_smembers" in stats  # the index was read ...
        assert "cmdstat_scan" not in stats, stats.get("cmdstat_scan")  # ... never the keyspace
    finally:
        client.close()
        s.close()


def test_a_flooding_tenant_cannot_evict_another_below_its_share_in_redis():
    """Redis under maxmemory with allkeys-lru, as the docs say to run it. A tenant writing
    unique records without end deletes its own (our shared account, redis_tier.py) before Redis
    has to pick victims blind to tenants; the victim, within its share, keeps every record,
    also as seen by another replica (one account in Redis)."""
    s = RedisServer().start("--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru")
    try:
        tier = RedisTier(s.url, capacity_bytes="auto", scope="d1")
        assert tier.capacity_bytes == 8 << 20  # half of maxmemory
        a, b = owner_id("flooder", KEYS), owner_id("victim", KEYS)
        mine = [f"v{i}" for i in range(10)]
        for i, name in enumerate(mine):  # 1 MB of a 4 MiB share
            assert tier.put("nb", name, bytes([i]) * 100_000, owner=b)
        replica = RedisTier(s.url, capacity_bytes="auto", scope="d1")
        for i in range(400):  # 40 MB of unique records, half from each replica
            assert (tier, replica)[i % 2].put("na", f"f{i}", os.urandom(100_000), owner=a)
        got = replica.get_many("nb", mine, owner=b)
        assert got == [bytes([i]) * 100_000 for i in range(10)]
        use = tier.account()
        assert use[b] == 1_000_000 and 7 << 20 < use[a] + use[b] <= 8 << 20
        assert tier.stats().evicted + replica.stats().evicted == 400 - use[a] // 100_000
        assert tier.owner_usage(b) == (None, 1_000_000)
        tier.check_integrity()
        assert redis.Redis.from_url(s.url).info("stats")["evicted_keys"] == 0  # ours did it all
    finally:
        s.close()


@pytest.mark.slow
def test_replica_restores_from_redis_cold_equals_warm(a, b, cold):
    lengths = [4 * BS - 1, 4 * BS, 4 * BS + 1]
    prompts = [_prompt(i, n) + [9, 8, 7] for i, n in enumerate(lengths)]
    a.generate(prompts, GREEDY)
    assert a.engine.connectors.flush()
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
    assert b.engine.connectors.flush()
    assert _tier(b, "disk")["stored_blocks"] >= sum(n // BS for n in lengths)  # promoted
    b.check_integrity()


@pytest.mark.slow
def test_tenants_invalidation_and_redis_killed_mid_run(server, a, b, cold):
    secret = _prompt(50, 3 * BS + 2)
    a.generate([secret], GREEDY, cache_salt="tenant-a")
    assert a.engine.connectors.flush() and _keys(server.url, "tenant-a") == 3
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
    a.engine.connectors.flush()
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
        a.engine.connectors.flush()
        time.sleep(0.2)
    assert _tier(a)["reconnects"] >= 1
    q = _prompt(99, 3 * BS + 1)  # written now that the tier is back
    a.generate([q], GREEDY)
    assert a.engine.connectors.flush() and _keys(server.url, None) >= 3
    warm = b.generate([q + [5]], GREEDY)[0]  # b never saw q: Redis has it again
    assert warm.num_cached_tokens == 3 * BS
    assert warm.outputs[0].token_ids == cold.generate([q + [5]], GREEDY)[0].outputs[0].token_ids
