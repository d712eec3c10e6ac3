"""Hostile tenants on one live `prefixcache serve`: one poisons and floods while another's streams
run (the victim's outputs equal its solo outputs, nothing of ours fails), queue shares (429 for
the flooder only), pin quotas and the longest pin, per-tenant stats, the metrics key, and a keys
file reloaded by SIGHUP under a running stream.

A small server (4 running sequences, 8 waiting, so a tenant's share is 4; 45 KV blocks, 11 of them
pinnable, 5 per tenant; pins last at most 4 s). The reload test rewrites the keys: it runs last.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest
from _helpers import BYTES_PER_TOKEN

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob",
                 "sk-ops": {"tenant": "ops", "admin": True}}}  # fmt: skip
MAX_PIN_TTL = 4
REFUSAL_PENALTY = 1  # alice's poison may put her over the refusal limit for this long
BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", str(45 * 16 * BYTES_PER_TOKEN),
            "--max-model-len", "512", "--max-num-seqs", "4", "--max-waiting-requests", "8", "--metrics-key", "scrape",
            "--max-pin-ttl", str(MAX_PIN_TTL), "--refusal-penalty", str(REFUSAL_PENALTY)]  # fmt: skip
    with ServerProcess(args) as srv:
        srv.keys_file = keys
        yield srv


def headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 30000), k=n)


def post(server, key: str, path: str, body, status: int | None = 200) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base_url + path, content=content, timeout=120,
                   headers={**headers(key), "content-type": "application/json"})  # fmt: skip
    if status is not None:
        assert r.status_code == status, r.text
    return r


def stats(server, key: str) -> dict:
    r = httpx.get(server.base_url + "/v1/cache/stats", headers=headers(key))
    assert r.status_code == 200, r.text
    return r.json()


# As many as its share of the queue (4): all may wait at once without a 429.
BOB_PROMPTS = [f"Question {i}: what is the capital of country number {i}? Answer:" for i in range(4)]
BOB_BODY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def _stream_text(client: httpx.AsyncClient, key: str, body: dict) -> tuple[int, str, list]:
    events = []
    async with client.stream("POST", "/v1/completions", headers=headers(key),
                             json={**body, "stream": True}) as r:  # fmt: skip
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        status = r.status_code
    errors = [e for e in events if "error" in e]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return status, text, errors


def _poison() -> list[bytes | dict]:
    """What the hostile tenant sends: each must be a 4xx or a normal answer, never a 5xx."""
    p = {"prompt": "Hi", "max_tokens": 4}
    return [
        {**p, "temperature": 1e-40},  # 1/T overflows in the sampler: greedy instead
        {**p, "top_p": 1e-300},
        {**p, "temperature": 1e-300, "top_p": 1e-300, "top_k": 2**40},
        b'{"prompt": "Hi", "max_tokens": 4, "temperature": NaN}',
        b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "\\ud800", "max_tokens": 4}',
        b'{"prompt": "Hi", "cache_salt": "\\udfff"}',
        b"[" * 50_000 + b"]" * 50_000,
        {**p, "seed": 2**70, "stream": True},
        {**p, "stop": ["x" * 100_000]},
        {"prompt": ["Hi"] * 16, "n": 16, "max_tokens": 4},  # 256 sequences at once
        {"prompt": [[1, 2, 2**40]], "max_tokens": 4},
    ]


def test_a_poisoning_and_flooding_tenant_hurts_nobody(server):
    solo = [post(server, "sk-bob", "/v1/completions", {**BOB_BODY, "prompt": p})
            .json()["choices"][0]["text"] for p in BOB_PROMPTS]  # fmt: skip

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
            victim = [_stream_text(c, "sk-bob", {**BOB_BODY, "prompt": p}) for p in BOB_PROMPTS]
            hostile = []
            for body in _poison():
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                hostile.append(c.post("/v1/completions", content=content, headers={
                    **headers("sk-alice"), "content-type": "application/json"}))  # fmt: skip
            for path in ("/v1/cache/lookup", "/v1/cache/warm"):
                for prompt in ([1, -5, 3], [1, 2**32, 3], list(range(300_000))):
                    hostile.append(c.post(path, headers=headers("sk-alice"),
                                          json={"prompt": prompt}))  # fmt: skip
            flood = {"prompt": "Count to twenty:", "max_tokens": 24, "ignore_eos": True}
            hostile += [c.post("/v1/completions", headers=headers("sk-alice"), json=flood)
                        for _ in range(12)]  # fmt: skip
            return await asyncio.gather(asyncio.gather(*victim), asyncio.gather(*hostile))

    victim, hostile = asyncio.run(main())
    for (status, text, errors), ref in zip(victim, solo, strict=True):
        assert status == 200 and not errors, errors
        assert text == ref  # the victim's tokens are its solo tokens
    for r in hostile:
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert "Traceback" not in err["message"] and "Error:" not in err["message"]
    codes = [r.status_code for r in hostile]
    assert 429 in codes  # the flood met its share of the queue (or alice's refusal limit)...
    for r in hostile:
        if r.status_code == 429:
            assert r.json()["error"]["code"] in ("tenant_quota_exceeded", "too_many_refusals")
            assert r.headers["retry-after"].isdigit()
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    integrity = httpx.get(server.base_url + "/v1/debug/integrity", headers=headers("sk-ops"))
    assert integrity.json()["ok"]
    time.sleep(REFUSAL_PENALTY)  # alice's refusal penalty (refusals.py) is over for the next tests


def test_pin_quota_per_tenant_and_the_longest_pin(server):
    quota = stats(server, "sk-alice")["kv"]["pin_quota_blocks"]
    assert quota == 5
    warm = {"pin": True, "ttl_seconds": MAX_PIN_TTL}
    assert post(server, "sk-alice", "/v1/cache/warm",
                {"prompt": ids(1, 3 * BLOCK + 1), **warm}).json()["pinned_blocks"] == 3
    err = post(server, "sk-alice", "/v1/cache/warm",
               {"prompt": ids(2, 3 * BLOCK + 1), **warm}, status=400).json()["error"]
    assert err["code"] == "pin_quota_exceeded"  # 3 + 3 > 5: alice's quota, not the pool's
    assert post(server, "sk-bob", "/v1/cache/warm",  # bob's quota is his own
                {"prompt": ids(3, 3 * BLOCK + 1), **warm}).json()["pinned_blocks"] == 3
    err = post(server, "sk-bob", "/v1/cache/warm",
               {"prompt": ids(4, 17), "pin": True, "ttl_seconds": 10 * MAX_PIN_TTL},
               status=400).json()["error"]  # fmt: skip
    assert err["param"] == "ttl_seconds"
    # A pin without a TTL gets the longest one, never forever.
    post(server, "sk-ops", "/v1/cache/invalidate", {"all": True})
    assert post(server, "sk-bob", "/v1/cache/warm",
                {"prompt": ids(5, 2 * BLOCK + 1), "pin": True}).json()["pinned_blocks"] == 2
    assert stats(server, "sk-bob")["pinned_blocks"] == 2
    time.sleep(MAX_PIN_TTL + 0.5)
    post(server, "sk-bob", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})  # a step runs
    assert stats(server, "sk-bob")["pinned_blocks"] == 0


def test_stats_show_a_tenant_only_its_own(server):
    post(server, "sk-alice", "/v1/completions",
         {"prompt": ids(20, 40), "max_tokens": 1, "cache_salt": "s1"})  # fmt: skip
    alice_before = stats(server, "sk-alice")
    post(server, "sk-bob", "/v1/completions", {"prompt": ids(21, 40), "max_tokens": 1})
    alice, bob = stats(server, "sk-alice"), stats(server, "sk-bob")
    assert alice["tenant"] == "alice" and set(alice["namespace_blocks"]) <= {"alice", "alice/s1"}
    assert alice["namespace_blocks"]["alice/s1"] >= 2
    assert "alice/s1" not in bob["namespace_blocks"]
    assert alice["prompt_tokens_total"] == alice_before["prompt_tokens_total"]  # bob's is his
    for pool_wide in ("evicted_blocks", "free_blocks", "cached_blocks", "engine", "query_tokens"):
        assert pool_wide not in alice
    ops = stats(server, "sk-ops")
    assert ops["engine"]["num_running"] >= 0 and "evicted_blocks" in ops


def test_metrics_need_the_metrics_key(server):
    url = server.base_url + "/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=headers("sk-alice")).status_code == 401
    assert httpx.get(url, headers=headers("scrape")).status_code == 200
    assert "prefixcache:prompt_tokens_total" in httpx.get(url, headers=headers("sk-ops")).text


def test_sighup_reloads_the_keys_file_without_dropping_requests(server):
    body = {"prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
            running = asyncio.create_task(_stream_text(c, "sk-bob", body))
            await asyncio.sleep(0.5)
            server.keys_file.write_text(json.dumps({"keys": {"sk-carol": "carol",
                                                             "sk-alice": "alice"}}))  # fmt: skip
            server.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while (await c.get("/v1/models", headers=headers("sk-carol"))).status_code != 200:
                assert time.monotonic() < deadline, "the new key never worked"
                await asyncio.sleep(0.1)
            return await running

    status, text, errors = asyncio.run(main())
    assert status == 200 and not errors and text  # bob's running stream finished
    assert httpx.get(server.base_url + "/v1/models", headers=headers("sk-bob")).status_code == 401
    assert httpx.get(server.base_url + "/v1/models", headers=headers("sk-alice")).status_code == 200
