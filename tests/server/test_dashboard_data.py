"""The dashboard's data without a server: per-tenant activity (scoping, bounds, excerpts),
the summary's two views, and the Grafana dashboard against the metrics the server exports."""

from __future__ import annotations

import asyncio
import json

from _helpers import GRAFANA, grafana_metric_names, served_series

from prefixcache.api.engine import EngineStats, TenantStats
from prefixcache.api.request import RequestMetrics, StreamDelta
from prefixcache.server.base.auth import Tenant
from prefixcache.server.observability import activity as activity_mod
from prefixcache.server.observability.activity import Activity
from prefixcache.server.observability.dashboard import namespaces, summary
from prefixcache.server.observability.metrics import ServerMetrics


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def everyone(_name: str) -> bool:
    return True


def only(name: str):
    return lambda t: t == name


def test_each_tenant_sees_only_its_own_requests():
    a = Activity(decode, 16)
    a.record("alice", "alice", list(range(100)), 0, 0.5, "no_prior_request", now=1.0)
    a.record("alice", "alice", list(range(100)), 96, 0.1, "full_hit", now=2.0)
    a.record("bob", "bob/x", list(range(50)), 0, 0.4, "evicted", now=3.0)
    bob = a.view("bob", only("bob"))
    assert bob["requests"]["requests"] == 1 and bob["requests"]["hit_requests"] == 0
    assert list(bob["tenants"]) == ["bob"] and list(bob["namespaces"]) == ["bob/x"]
    assert bob["top_prefixes"] == [] and bob["miss_reasons"] == {"evicted": 1}
    assert "alice" not in json.dumps(bob)
    alice = a.view("alice", only("alice"))
    assert alice["requests"]["request_hit_rate"] == 0.5
    assert alice["requests"]["hit_rate"] == 96 / 200
    assert alice["ttft"]["hit"]["p50"] == 0.1 and alice["ttft"]["miss"]["p50"] == 0.5
    assert alice["miss_reasons"] == {"no_prior_request": 1}  # a full hit is no miss
    [p] = alice["top_prefixes"]
    assert (p["tokens"], p["hits"], p["saved_tokens"]) == (96, 1, 96)
    assert p["excerpt"].startswith("w0 w1") and "w95" in p["excerpt"]


def test_admin_gets_every_tenant_but_no_other_tenants_text():
    a = Activity(decode, 16)
    for t in ("alice", "bob"):
        a.record(t, t, [7] * 40, 32, 0.1, "full_hit", now=1.0)
    seen = a.view("bob", everyone)  # bob as an admin
    assert set(seen["tenants"]) == {"alice", "bob"}
    by_ns = {p["namespace"]: p for p in seen["top_prefixes"]}
    assert by_ns["bob"]["excerpt"] and by_ns["alice"]["excerpt"] is None
    # Equal tokens in two namespaces are two prefixes, with different digests.
    assert by_ns["alice"]["id"] != by_ns["bob"]["id"]


def test_a_flooding_tenant_cannot_push_out_or_change_another_ones_records():
    a = Activity(decode, 16)
    a.record("alice", "alice", [1] * 40, 32, 0.1, "full_hit", now=0.0)
    a.record("alice", "alice", [2] * 40, 0, 0.3, "diverged", now=0.5)
    before = a.view("alice", only("alice"))
    for i in range(3 * activity_mod.RECENT_REQUESTS):
        a.record("mallory", f"mallory/{i}", [i + 3] * 40, 32, 0.1, "full_hit", now=1.0 + i)
    assert a.view("alice", only("alice")) == before
    # and the flood itself stays bounded
    m = a.view("mallory", only("mallory"))
    assert len(m["namespaces"]) == activity_mod.MAX_NAMESPACES
    assert len(m["top_prefixes"]) == activity_mod.SHOWN_PREFIXES
    assert m["requests"]["requests"] == 3 * activity_mod.RECENT_REQUESTS
    assert m["ttft"]["hit"]["count"] == activity_mod.RECENT_REQUESTS


def test_prefix_hits_accumulate_and_excerpt_failures_are_harmless():
    def broken(_ids):
        raise ValueError("bad id")

    a = Activity(broken, 16)
    for now in range(3):
        a.record("t", "t", [5] * 33, 32, None, "full_hit", now=float(now))
    [p] = a.view("t", everyone)["top_prefixes"]
    assert (p["hits"], p["saved_tokens"], p["excerpt"]) == (3, 96, "")
    assert a.view("t", everyone)["ttft"]["hit"]["count"] == 0  # no first token time


def test_recent_misses_are_newest_first_and_exclude_hits():
    a = Activity(decode, 16)
    reasons = ["no_prior_request", "full_hit", "partial_block", "evicted", "diverged"]
    for i, r in enumerate(reasons):
        a.record("t", "t", [i] * 20, 16 if "hit" in r or "partial" in r else 0, 0.1, r, now=i)
    # Without an explanation, a miss is a prompt with a full block not served from the cache.
    a.record("t", "t", [9] * 33, 32, 0.1, None, now=10)  # both full blocks: a hit
    a.record("t", "t", [8] * 33, 16, 0.1, None, now=11)  # one of two: a miss
    a.record("t", "t", [7] * 10, 0, 0.1, None, now=12)  # no full block: nothing to miss
    v = a.view("t", everyone)
    assert [m["reason"] for m in v["recent_misses"]] == [
        None, "diverged", "evicted", "no_prior_request"]  # fmt: skip
    assert v["miss_reasons"] == {
        "no_prior_request": 1, "evicted": 1, "diverged": 1, activity_mod.NOT_EXPLAINED: 1}  # fmt: skip


def test_summary_of_a_tenant_holds_only_its_own_figures():
    stats = {
        "tenant": "bob", "num_running": 1, "num_waiting": 2, "prompt_tokens_total": 100,
        "prefix_cache_hits_total": 48, "generation_tokens_total": 5, "pinned_blocks": 3,
        "namespace_blocks": {"bob": 4, "bob/x": 2}, "hit_rate": 0.48, "kv": {"num_blocks": 30},
    }  # fmt: skip
    s = summary(stats, Tenant("bob"))
    assert s["scope"] == "tenant" and s["cached_blocks"] == 6 and s["kv_usage"] == 0.2
    assert s["tokens_saved"] == 48 and s["requests_waiting"] == 2 and s["pinned_blocks"] == 3
    assert s["free_blocks"] is s["in_use_blocks"] is s["evicted_blocks"] is None
    usage = {"public": {"requests": 1}, "bob/y": {"requests": 2}}
    rows = namespaces(stats["namespace_blocks"], usage, lambda ns: ns.startswith("bob"))
    assert [(r["namespace"], r["blocks"]) for r in rows] == [
        ("bob", 4), ("bob/x", 2), ("bob/y", 0), ("public", None)]  # fmt: skip


# ---- Grafana -------------------------------------------------------------------------------


class _Engine:
    slow_consumers_total = 0

    def engine_stats(self) -> EngineStats:
        return EngineStats(
            num_running=0, num_waiting=0, num_preemptions_total=0, prompt_tokens_total=10,
            generation_tokens_total=2, prefix_cache_queries_total=10, prefix_cache_hits_total=0,
            evicted_blocks_total=0, kv_cache_usage=0.0, cached_blocks=0, free_blocks=4,
            in_use_blocks=0, pinned_blocks=0, total_blocks=4, block_size=16, used_bytes=0,
            capacity_bytes=1, enable_prefix_caching=True,
        )  # fmt: skip


def test_grafana_dashboard_is_valid_and_uses_only_served_metrics():
    dash = json.loads(GRAFANA.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "stat") and p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p["targets"]:
            assert t["refId"] and t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model_name"}

    metrics = ServerMetrics(_Engine(), "m")
    t = 100.0
    m = RequestMetrics(t, first_scheduled_time=t, first_token_time=t + 0.1, finished_time=t + 0.3)
    metrics.observe_finished(StreamDelta("r", [1], "x", True, "length", 10, 3, m))
    names = grafana_metric_names()
    assert {"prefixcache:prefix_cache_hits_total",
            "prefixcache:time_to_first_token_seconds_bucket"} <= names  # fmt: skip
    missing = names - served_series(metrics.render().decode())
    assert not missing, missing


# ---- reads of the engine ------------------------------------------------------------------------


class _Counting(_Engine):
    def __init__(self):
        self.reads = 0
        self.kv_info = {"num_blocks": 4}

    def engine_stats(self) -> EngineStats:
        self.reads += 1
        return super().engine_stats()

    def cache_stats(self) -> dict:
        return {}

    def tenant_stats(self, tenant, owns):
        self.reads += 1
        return TenantStats(tenant, 0, 0, 0, 0, 0, 0, {"x": 1} if owns("x") else {})


def test_polls_of_one_tenant_share_one_read_of_the_engine(monkeypatch):
    from prefixcache.server.observability import dashboard

    class Tenants:
        def owns(self, tenant, ns):
            return tenant.admin

    from prefixcache.server.base.cache_gate import CacheCallGate
    from prefixcache.server.observability.cache_keys import PromptCacheKeyStats

    class Serving:  # what the route reads of the server's Serving
        engine = _Counting()
        tenants = Tenants()
        cache_gate = CacheCallGate(2, 16)
        cache_keys = PromptCacheKeyStats()

    s = Serving()
    engine = s.engine

    async def polls(tenant: Tenant, n: int):
        return await asyncio.gather(*(dashboard._engine_view(s, tenant) for _ in range(n)))

    views = asyncio.run(polls(Tenant("bob"), 5))
    assert engine.reads == 1 and all(v is views[0] for v in views)
    assert views[0][2] == {}  # bob owns no namespace here
    asyncio.run(polls(Tenant("ops", admin=True), 3))  # another scope: its own read
    assert engine.reads == 1 + 2  # the admin's stats and every namespace's blocks
    now = dashboard._clock()
    monkeypatch.setattr(dashboard, "_clock", lambda: now + 0.4)
    asyncio.run(polls(Tenant("bob"), 1))
    assert engine.reads == 3  # still fresh
    monkeypatch.setattr(dashboard, "_clock", lambda: now + 0.6)
    asyncio.run(polls(Tenant("bob"), 2))
    assert engine.reads == 3 + 1  # stale: read again, once
