"""KV tiers behind live servers: two servers share one real redis-server (tests/_redis.py),
each with its own disk directory.

- server B serves what server A computed (cold == warm across them), the usage counts the
  restored tokens and cache_info says which tier they came from;
- tenants stay apart in every tier; a tenant's stats show only its own restored tokens;
  admins see per-tier stats, /metrics has per-tier series;
- server A stopped and started again restores from its disk;
- invalidate empties the namespace in Redis; with Redis killed requests are still served and
  invalidate is a 503 (not a 500);
- a bad --remote-cache URL or size is a startup error (exit 2) naming the problem.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from _redis import RedisServer

from prefixcache.cli import main
from prefixcache.server.launcher import ServerProcess
from prefixcache.tiers.keys import namespace_id
from prefixcache.tiers.redis_tier import PREFIX
from prefixcache.tiers.secret import TierKeys

BLOCK = 16
KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": {"tenant": "ops", "admin": True}}}
SECRET = b"both servers' tier secret, 32+ bytes"  # replicas sharing a Redis share it


def _ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 30000), k=n)


def _post(srv, key, path, body, status=200) -> dict:
    r = httpx.post(srv.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)  # fmt: skip
    assert r.status_code == status, r.text
    return r.json()


def _complete(srv, key, prompt) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_cache_info": True}
    return _post(srv, key, "/v1/completions", body)


def _stats(srv, key) -> dict:
    r = httpx.get(srv.base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_written(srv, tier, n) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _stats(srv, "sk-ops")["tiers"][tier]["written_blocks"] >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{tier} tier: {n} blocks never written")


def _redis_keys(url, namespace) -> int:
    c = redis.Redis.from_url(url)
    try:
        ns = namespace_id(namespace, TierKeys.from_secret(SECRET))
        return len(list(c.scan_iter(match=f"{PREFIX}:{ns}:*")))
    finally:
        c.close()


def test_bad_tier_options_are_startup_errors(capsys):
    for args, says in (
        (["--remote-cache", "http://host:6379"], "redis://"),
        (["--remote-cache", "redis://host"], "no port"),
        (["--remote-cache", "redis://:secret@host:6379/zero"], "database must be a number"),
        (["--disk-cache-dir", "/tmp/x", "--disk-cache-size", "lots"], "memory size"),
    ):
        assert main(["serve", *args]) == 2  # before any model is loaded
        err = capsys.readouterr().err
        assert says in err and "secret" not in err, err


@pytest.mark.slow
def test_two_servers_share_redis_restart_from_disk_tenants_faults(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    secret = tmp_path / "tier-secret"
    secret.write_bytes(SECRET)
    store = RedisServer().start()
    common = ["--api-keys-file", str(keys), "--kv-cache-memory", "24MiB", "--max-model-len",
              "512", "--remote-cache", store.url, "--tier-secret-file", str(secret)]  # fmt: skip
    a = ServerProcess([*common, "--disk-cache-dir", str(tmp_path / "a")])
    b = ServerProcess([*common, "--disk-cache-dir", str(tmp_path / "b")])
    try:
        with ThreadPoolExecutor(2) as pool:  # both load the model at once
            list(pool.map(ServerProcess.start, (a, b)))
        prompt = _ids(1, 5 * BLOCK + 3)
        cold = _complete(a, "sk-alice", prompt)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        _wait_written(a, "redis", 5)
        warm = _complete(b, "sk-alice", prompt)  # another replica, through Redis
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
        info = warm["choices"][0]["cache_info"]
        assert info["cached_tokens_by_tier"] == {"ram": 0, "redis": 5 * BLOCK}
        # explained again once restored (at arrival RAM had none): what it got, not a miss
        assert (info["cached_tokens"], info["reason"]) == (5 * BLOCK, "partial_block")
        other = _complete(b, "sk-bob", prompt)  # same prompt, another tenant: nothing shared
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _stats(b, "sk-alice")["tier_hit_tokens"] == {"redis": 5 * BLOCK}
        assert _stats(b, "sk-bob")["tier_hit_tokens"] == {}
        assert "tiers" not in _stats(b, "sk-bob")
        # Its own share of the tiers only: Bob's figures on A count nothing of Alice's there.
        assert _stats(a, "sk-alice")["tier_usage"]["disk"]["stored_records"] == 5
        assert _stats(a, "sk-bob")["tier_usage"] == {
            "queue": {"queued_bytes": 0, "dropped_writes": 0, "queued_restores": 0,
                      "dropped_restores": 0},
            "disk": {"stored_records": 0, "stored_bytes": 0},
            "redis": {"stored_records": None, "stored_bytes": None},
        }  # fmt: skip
        admin = _stats(b, "sk-ops")["tiers"]
        assert admin["redis"]["hit_tokens"] == 5 * BLOCK and admin["disk"]["enabled"] is True
        metrics = httpx.get(b.base_url + "/metrics", headers={"Authorization": "Bearer sk-ops"}).text
        assert 'prefixcache:tier_hit_tokens_total{model_name=' in metrics
        assert 'tier="redis"} 80.0' in metrics

        # A restart of A: its disk has the blocks (queued writes are flushed on shutdown).
        a.stop()
        a.start()
        again = _complete(a, "sk-alice", prompt)
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        assert again["choices"][0]["cache_info"]["cached_tokens_by_tier"] == {
            "ram": 0, "disk": 5 * BLOCK,
        }  # fmt: skip

        # Invalidate drops alice's namespace from Redis too (for every replica).
        assert _redis_keys(store.url, "alice") >= 5
        _post(b, "sk-alice", "/v1/cache/invalidate", {})
        assert _redis_keys(store.url, "alice") == 0

        # Redis dies: requests are still served (recomputed), invalidate says 503.
        store.kill()
        fresh = _ids(2, 3 * BLOCK + 1)
        r1 = _complete(b, "sk-bob", fresh)
        r2 = _complete(a, "sk-bob", fresh)
        assert r1["choices"][0]["text"] == r2["choices"][0]["text"]
        err = _post(b, "sk-alice", "/v1/cache/invalidate", {}, status=503)
        assert err["error"]["code"] == "cache_tier_unavailable"
        assert _stats(b, "sk-ops")["tiers"]["redis"]["errors"] >= 1
    finally:
        a.stop()
        b.stop()
        store.close()
