"""Retention in the persistent tiers (OpenAI's ``prompt_cache_retention``): records written
with a TTL expire there, on an injected clock (disk: a sweep and a restart's scan; Redis: the
key's own TTL, and a sweep that takes expired records out of the owners' accounts); records
written without one stay until evicted; a record promoted from Redis to disk keeps what it has
left. The engine side (which requests write what) is in test_server_retention.py."""

from __future__ import annotations

import os

import pytest
import redis
from _redis import RedisServer

from prefixcache.tiers.disk import SUBDIR, DiskTier
from prefixcache.tiers.keys import StoreLayout
from prefixcache.tiers.manager import TierManager
from prefixcache.tiers.records import BlockRef
from prefixcache.tiers.redis_tier import EXPIRY_PREFIX, RedisTier
from prefixcache.tiers.secret import TierKeys
from prefixcache.tiers.shares import owner_id

KEYS = TierKeys.from_secret(b"deployment one: 32 bytes or more")
OWNER = owner_id("alice", KEYS)
DAY = 24 * 3600.0


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_disk_records_with_a_ttl_expire_on_the_clock_and_across_a_restart(tmp_path):
    clock = Clock()
    disk = DiskTier(tmp_path, 1 << 20, fsync=False, clock=clock)
    assert disk.put("ns", "aa", b"x" * 100, owner=OWNER, ttl=DAY)
    assert disk.put("ns", "bb", b"y" * 100, owner=OWNER)  # no retention: until evicted
    files = sorted(p.name for p in (tmp_path / SUBDIR / "ns").iterdir() if p.name != "owner")
    assert files == [f"aa.{int(clock.t + DAY)}.blk", "bb.blk"]
    assert disk.get_many("ns", ["aa", "bb"]) == [b"x" * 100, b"y" * 100]
    # A restart reads the deadline from the name.
    clock.t += DAY - 1
    again = DiskTier(tmp_path, 1 << 20, fsync=False, clock=clock)
    assert again.get_many("ns", ["aa"]) == [b"x" * 100]
    assert again.sweep() == 0
    clock.t += 1  # the deadline: a miss at once, removed by the sweep
    assert again.get_many("ns", ["aa"]) == []
    assert again.sweep() == 1 and again.stats().expired == 1
    assert not (tmp_path / SUBDIR / "ns" / f"aa.{int(clock.t)}.blk").exists()
    assert again.get_many("ns", ["bb"]) == [b"y" * 100]
    again.check_integrity()
    # A record that expired while no server ran is removed by the next start's scan.
    assert again.put("ns", "cc", b"z", owner=OWNER, ttl=60)
    clock.t += 61
    third = DiskTier(tmp_path, 1 << 20, fsync=False, clock=clock)
    assert third.get_many("ns", ["cc"]) == []
    assert [p.name for p in (tmp_path / SUBDIR / "ns").iterdir() if p.name.startswith("cc")] == []


@pytest.fixture(scope="module")
def redis_server():
    s = RedisServer().start()
    yield s
    s.close()


def test_redis_records_with_a_ttl_expire_and_leave_the_account(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    raw.flushall()
    tier = RedisTier(redis_server.url, capacity_bytes=1 << 20, scope="dep")
    assert tier.put("ns", "aa", b"x" * 100, owner=OWNER, ttl=DAY)
    assert tier.put("ns", "bb", b"y" * 100, owner=OWNER)
    assert 0 < raw.pttl("pc-kv:ns:aa") <= DAY * 1000 and raw.pttl("pc-kv:ns:bb") == -1
    assert tier.remaining_ttls("ns", ["aa", "bb", "zz"])[1:] == [None, None]
    assert tier.account() == {OWNER: 200}
    assert tier.sweep() == 0  # nothing past its deadline yet
    # Past the deadline (the clock is injected: Redis's own TTL is a day away), the record
    # leaves the index set and the owner's account; the other stays.
    assert tier.sweep(now=raw.time()[0] + DAY + 1) == 1
    assert tier.account() == {OWNER: 100} and tier.stats().expired == 1
    assert raw.exists("pc-kv:ns:aa") == 0 and raw.smembers("pc-kv-index:ns") == {b"bb"}
    assert raw.zcard(f"{EXPIRY_PREFIX}:dep") == 0
    tier.check_integrity()
    # Written again without a TTL, a record loses it (and leaves the expiry set).
    assert tier.put("ns", "cc", b"z", owner=OWNER, ttl=60)
    assert tier.put("ns", "cc", b"z", owner=OWNER)
    assert raw.pttl("pc-kv:ns:cc") == -1 and raw.zcard(f"{EXPIRY_PREFIX}:dep") == 0
    tier.close()


def _layout() -> StoreLayout:
    return StoreLayout(model_fingerprint="m", block_size=16, num_layers=2, num_kv_heads=1,
                       head_dim=8, kv_dtype="float32", scaled=False, block_bytes=256)  # fmt: skip


def test_a_record_promoted_from_redis_to_disk_keeps_its_deadline(tmp_path, redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    clock = Clock()
    disk = DiskTier(tmp_path, 1 << 20, fsync=False, clock=clock)
    remote = RedisTier(redis_server.url, scope="dep2")
    ref = BlockRef(b"k" * 16, b"p" * 16 + b"t" * 64)
    only_redis = TierManager([remote], _layout(), KEYS)
    only_redis.offload("alice", [(ref, bytes(256))], ttl=DAY)
    assert only_redis.flush()
    only_redis.close()
    both = TierManager([disk, remote], _layout(), KEYS)
    try:
        job = both.submit_restore("r", "alice", [ref])
        while not job.done:
            both.wait_completed(0.1)
        assert [w for _, _, w in job.found] == ["redis"]
        assert both.flush()
        (name,) = [p.name for p in (tmp_path / SUBDIR).glob("*/*.blk")]
        deadline = int(name.split(".")[1])
        assert clock.t + DAY - 60 <= deadline <= clock.t + DAY  # what Redis had left
        assert both.sweep(now=deadline) >= 1
        assert list((tmp_path / SUBDIR).glob("*/*.blk")) == []
    finally:
        both.close()
    assert os.path.isdir(tmp_path / SUBDIR)
