"""Cache control and tenants of `prefixcache serve`: warm, lookup, pin and TTL under an eviction
storm, invalidate, miss reasons, API keys, tenant isolation and shared namespaces.

One live server on the default model with a small KV cache (34 blocks of 16 tokens, 8 of them
pinnable), so an eviction storm costs a few hundred prefill tokens. Prompts are token ids, so
their block structure is exact.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest
from _helpers import BYTES_PER_TOKEN, KV_DTYPE

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

KEYS = {
    "keys": {
        "sk-alice": "alice",
        "sk-bob": "bob",
        "sk-ops": {"tenant": "ops", "admin": True},
    },
    "shared_namespaces": ["public"],
}
BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--api-keys-file", str(keys), "--shared-namespace", "handbook",
            "--kv-cache-memory", str(34 * BLOCK * BYTES_PER_TOKEN), "--max-model-len", "1024",
            "--pin-quota-fraction", "1"]  # fmt: skip  (pin quotas: test_server_tenants.py)
    with ServerProcess(args) as srv:
        yield srv


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 30000), k=n)


class Api:
    def __init__(self, server, key: str | None):
        self.base = server.base_url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body: dict, status: int = 200) -> dict:
        r = httpx.post(self.base + path, json=body, headers=self.headers, timeout=120)
        assert r.status_code == status, r.text
        return r.json()

    def complete(self, prompt, **extra) -> dict:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        return self.post("/v1/completions", body)

    def cached(self, prompt, **extra) -> int:
        return self.complete(prompt, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def reason(self, prompt, **extra) -> dict:
        return self.complete(prompt, return_cache_info=True, **extra)["choices"][0]["cache_info"]

    def lookup(self, prompt, **extra) -> int:
        return self.post("/v1/cache/lookup", {"prompt": prompt, **extra})["num_cached_tokens"]

    def warm(self, prompt, status: int = 200, **extra) -> dict:
        return self.post("/v1/cache/warm", {"prompt": prompt, **extra}, status)

    def stats(self) -> dict:
        r = httpx.get(self.base + "/v1/cache/stats", headers=self.headers)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def alice(server):
    return Api(server, "sk-alice")


@pytest.fixture(scope="module")
def bob(server):
    return Api(server, "sk-bob")


@pytest.fixture(scope="module")
def ops(server):
    return Api(server, "sk-ops")


def test_missing_or_wrong_key_is_401(server):
    for key in (None, "sk-nobody"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/cache/warm"), ("POST", "/v1/cache/lookup"),
                             ("POST", "/v1/cache/invalidate"), ("GET", "/v1/cache/stats"),
                             ("GET", "/v1/models")]:  # fmt: skip
            r = httpx.request(method, server.base_url + path, headers=headers, json={})
            assert r.status_code == 401, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)
    # Health stays open to probes; with keys, /metrics needs an admin key (or --metrics-key):
    # its counts are every tenant's traffic.
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    assert httpx.get(server.base_url + "/metrics", headers=_auth("sk-alice")).status_code == 401
    assert httpx.get(server.base_url + "/metrics", headers=_auth("sk-ops")).status_code == 200
    good = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-alice", max_retries=0)
    assert good.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)


def test_warm_then_lookup_shows_the_hit(alice):
    p = ids(1, 50)  # 3 full blocks; the last token is always recomputed
    assert alice.lookup(p) == 0
    before = alice.stats()
    # The KV dtype and its size per token are reported (auto: int16 on the exact path).
    assert before["kv"]["kv_cache_dtype"] == KV_DTYPE
    assert before["kv"]["bytes_per_token"] == BYTES_PER_TOKEN
    assert alice.lookup(p) == 0  # a lookup changes nothing
    assert alice.stats()["namespace_blocks"] == before["namespace_blocks"]
    w = alice.warm(p)
    assert (w["num_tokens"], w["num_cached_tokens"], w["namespace"]) == (50, 0, "alice")
    assert alice.lookup(p) == 48
    assert alice.cached(p) == 48
    # Chat messages are rendered with the chat template, as a chat completion would be.
    msgs = [{"role": "system", "content": "You answer questions about the handbook. " * 4},
            {"role": "user", "content": "What is on page one?"}]  # fmt: skip
    w = alice.post("/v1/cache/warm", {"messages": msgs})
    assert alice.post("/v1/cache/lookup", {"messages": msgs})["num_cached_tokens"] >= 32
    r = alice.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert r["usage"]["prompt_tokens"] == w["num_tokens"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_tenants_are_isolated(alice, bob, ops):
    p = ids(2, 40)
    assert alice.cached(p) == 0
    assert alice.cached(p) == 32
    assert bob.lookup(p) == 0
    info = bob.reason(p)
    assert info["cached_tokens"] == 0 and info["namespace"] == "bob"
    # Bob must not learn that someone else sent this prompt; the admin may.
    assert info["reason"] == "no_prior_request"
    assert ops.reason(p)["reason"] == "other_namespace"
    # A salt partitions inside a tenant; it cannot reach another tenant's namespace.
    assert bob.cached(p, cache_salt="alice") == 0
    assert alice.cached(p, cache_salt="x") == 0


def test_shared_namespace(alice, bob, ops):
    q = ids(3, 40)
    # A raw prompt declares nothing shared: with a shared salt it stays in "alice/public".
    assert alice.cached(q, cache_salt="public") == 0
    assert bob.cached(q, cache_salt="public") == 0
    assert alice.cached(q, cache_salt="public") == 32
    # A chat's system messages are what a shared salt shares; an admin warms them for everyone
    # (here in a shared namespace from the command line).
    system = [{"role": "system", "content": "You answer questions about the handbook. " * 4}]
    w = ops.post("/v1/cache/warm", {"messages": system, "add_generation_prompt": False,
                                    "cache_salt": "handbook"})  # fmt: skip
    assert w["shared_namespace"] == "handbook" and w["shared_tokens"] >= 32
    ask = {"messages": [*system, {"role": "user", "content": "Page one?"}], "cache_salt": "handbook"}
    look = bob.post("/v1/cache/lookup", ask)
    assert look["num_cached_tokens"] >= 16 and look["namespace"] == "bob/handbook"
    assert bob.cached(q, cache_salt="private") == 0  # "bob/private"
    assert alice.cached(q, cache_salt="private") == 0  # "alice/private"


def test_invalidate_empties_a_namespace(alice, bob, ops):
    r = ids(4, 40)
    alice.warm(r)
    alice.warm(r, cache_salt="s1")
    bob.warm(r)
    assert alice.lookup(r) == bob.lookup(r) == alice.lookup(r, cache_salt="s1") == 32
    out = alice.post("/v1/cache/invalidate", {})
    assert out["namespace"] == "alice" and out["dropped_blocks"] >= 2
    assert alice.lookup(r) == 0
    assert alice.lookup(r, cache_salt="s1") == 32 and bob.lookup(r) == 32  # untouched
    alice.post("/v1/cache/invalidate", {"cache_salt": "s1"})
    assert alice.lookup(r, cache_salt="s1") == 0
    # Other tenants' namespaces, shared ones and "all" need the admin key.
    alice.post("/v1/cache/invalidate", {"namespace": "bob"}, status=403)
    alice.post("/v1/cache/invalidate", {"cache_salt": "public"}, status=403)
    alice.post("/v1/cache/invalidate", {"all": True}, status=403)
    assert bob.lookup(r) == 32
    ops.post("/v1/cache/invalidate", {"namespace": "bob"})
    assert bob.lookup(r) == 0
    bob.warm(r)
    ops.post("/v1/cache/invalidate", {"all": True})
    assert bob.lookup(r) == 0


def test_miss_reasons(alice):
    salt = {"cache_salt": "reasons"}
    a = ids(5, 33)  # 2 full blocks + the recomputed last token
    info = alice.reason(a, **salt)
    assert (info["reason"], info["cached_tokens"]) == ("no_prior_request", 0)
    info = alice.reason(a, **salt)
    assert (info["reason"], info["cached_tokens"]) == ("full_hit", 32)
    b = a[:20] + ids(6, 20)  # shares block 0 and 4 tokens of block 1
    info = alice.reason(b, **salt)
    assert info["reason"] == "diverged"
    assert (info["cached_tokens"], info["first_uncached_position"], info["diverged_at"]) == (
        20, 20, 20,
    )  # fmt: skip  (token-exact: block 1's first 4 tokens are copied, the hit ends where b diverges)
    c = ids(7, 40)
    alice.complete(c, **salt)
    info = alice.reason(c, **salt)  # two blocks hit; the 7-token tail is never cached
    assert (info["reason"], info["cached_tokens"]) == ("partial_block", 32)


def test_pin_survives_eviction_storm_and_ttl_expiry(alice, ops):
    stats = ops.stats()  # the pool's numbers are the admin's to see
    assert stats["total_blocks"] == 34  # the storm below must overflow this
    pinned, short, loose = ids(10, 49), ids(11, 17), ids(12, 49)
    assert alice.warm(pinned, pin=True, ttl_seconds=600)["pinned_blocks"] == 3
    assert alice.warm(short, pin=True, ttl_seconds=1)["pinned_blocks"] == 1
    assert alice.warm(loose)["pinned_blocks"] == 0
    # The pin budget (25% of 34 blocks = 8) is split between alice and bob: alice's 4 are
    # pinned now, 7 more do not fit.
    err = alice.warm(ids(13, 120), pin=True, status=400)["error"]
    assert "pin" in err["message"]
    time.sleep(1.5)  # the short pin's TTL ends
    evicted = stats["evicted_blocks"]
    for i in range(6):  # 6 x 7 blocks through a 34-block pool
        alice.warm(ids(100 + i, 120), cache_salt="storm")
    assert ops.stats()["evicted_blocks"] > evicted
    assert alice.lookup(pinned) == 48  # pinned: survived the storm
    assert alice.lookup(short) == 0  # its TTL ended: evicted like any other block
    assert alice.lookup(loose) == 0
    assert alice.reason(loose)["reason"] == "evicted"



def test_segments_mode_warm_usage_isolation_invalidation_and_bad_input(alice, bob):
    """cache_mode "segments" through the API (docs/segments.md): documents warmed as segments
    are reused by a chat in another order, reported as segment_cached_tokens beside the exact
    cached_tokens; another tenant reuses nothing; invalidation drops them; bad input is 4xx."""
    docs = [{"role": "document", "title": f"Doc {n}", "content": f"The code of {n} is {c}."}
            for n, c in (("Ann", 4721), ("Ben", 9034), ("Cy", 1588))]  # fmt: skip
    system = {"role": "system", "content": "Answer with the number only."}
    question = {"role": "user", "content": "What is the code of Ben?"}
    reordered = [system, docs[2], docs[0], question]

    def chat(api, messages, status=200, **extra):
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}
        return api.post("/v1/chat/completions", body, status)

    def seg_cached(api, messages) -> int:
        out = chat(api, messages, cache_mode="segments", segment_recompute_tokens=2)
        return out["usage"]["prompt_tokens_details"]["segment_cached_tokens"]

    warmed = alice.post("/v1/cache/warm", {"messages": [system, *docs], "cache_mode": "segments"})
    assert warmed["already_cached_segments"] == 0
    again = alice.post("/v1/cache/warm", {"messages": [system, *docs], "cache_mode": "segments"})
    assert again["already_cached_segments"] == 3  # the connector's `held` answer
    n = warmed["segment_tokens"]
    assert seg_cached(alice, reordered) == (n[2] - 2) + (n[0] - 2)
    assert seg_cached(bob, reordered) == 0  # the namespace is in the segment key
    plain = chat(alice, [system, *docs, question])["usage"]["prompt_tokens_details"]
    assert "segment_cached_tokens" not in plain  # requests without cache_mode are unchanged
    alice.post("/v1/cache/invalidate", {})
    assert seg_cached(alice, reordered) == 0
    # bad input: OpenAI-format errors naming the field
    assert chat(alice, reordered, 422, cache_mode="blend")["error"]["param"] == "cache_mode"
    err = chat(alice, reordered, 400, cache_mode="segments", segment_recompute_tokens=-1)["error"]
    assert err["param"] == "segment_recompute_tokens"
    body = {"prompt": "hi", "max_tokens": 1, "cache_mode": "segments"}
    assert alice.post("/v1/completions", body, 400)["error"]["param"] == "cache_mode"
