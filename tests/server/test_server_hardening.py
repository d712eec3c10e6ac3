"""Issue #37: work a tenant (or a keyless client) could make the server do outside its share,
each attack run live against one server and its mechanism checked, never a time.

One server in this process: uvicorn on a loopback socket (real HTTP, the server's own protocol
with its connection guards), the app on a real engine (default model), tenants from a keys
file. The engine's lock records the thread of every acquisition: no attack may find it taken
on the event loop or in the default executor, whose threads parse and tokenize every tenant's
requests (the failure of the metrics scrapes and the pinned warms). Each test has attackers of
its own (a refusal penalty never carries over), sends a victim's request during the attack
(it completes), and finds ``/health`` answering and no 5xx. The timing ratios are measured by
benchmarks/tenant_isolation.py (docs/benchmarks-journal.md "Tenant isolation").
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from _helpers import shared_default_weights

from prefixcache.api.errors import TenantQuotaError
from prefixcache.cache.prefix_index import PrefixIndex
from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine
from prefixcache.server.anthropic.prompt import MessagesRenderer
from prefixcache.server.app import create_app
from prefixcache.server.base import protocol
from prefixcache.server.base.auth import TenantDirectory
from prefixcache.server.edge.http import protocol_class
from prefixcache.server.edge.limits import ServerLimits

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ATTACKERS = [f"a{i}" for i in range(10)]
KEYS = {"keys": {"sk-victim": "victim", "sk-ops": {"tenant": "ops", "admin": True},
                 **{f"sk-{a}": a for a in ATTACKERS}},
        "shared_namespaces": ["public"]}  # fmt: skip
MAX_CONNECTIONS = 100
ENGINE_THREADS = ("prefixcache-engine", "prefixcache-cache-route", "prefixcache-snapshot")
SERVER_THREAD = "test-uvicorn"  # the event loop's thread


class RecordingLock:
    """The engine's RLock, counting acquisitions by thread name."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.threads: collections.Counter = collections.Counter()

    def acquire(self, *args, **kwargs) -> bool:
        ok = self._lock.acquire(*args, **kwargs)
        if ok:
            self.threads[threading.current_thread().name] += 1
        return ok

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def outsiders(self) -> set[str]:
        """Threads that took the lock other than the engine's own, the cache routes' and the
        snapshots' (the event loop's is "test-uvicorn", the default executor's "uvloop_N" or
        "asyncio_N")."""
        return {t for t in self.threads if not t.startswith(ENGINE_THREADS)}


class Live:
    def __init__(self, engine: AsyncEngine, app, lock: RecordingLock, port: int) -> None:
        self.engine, self.app, self.lock, self.port = engine, app, lock, port
        self.serving = app.state.serving
        self.base_url = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    config = EngineConfig(kv_cache_memory="256MiB", max_model_len=512, seed=0,
                          max_num_seqs=16, max_waiting_requests=64)  # fmt: skip
    with shared_default_weights():
        engine = AsyncEngine(config)
    lock = RecordingLock()
    engine._lock = lock  # before the engine thread starts (lifespan)
    limits = ServerLimits(max_connections=MAX_CONNECTIONS, header_timeout=30, refusal_penalty=30)
    app = create_app(engine, tenants=TenantDirectory.from_options(api_keys_file=keys),
                     limits=limits)  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_keep_alive=limits.keep_alive_timeout,
        http=protocol_class(limits.max_connections, limits.header_timeout, limits.send_timeout,
                            app.state.peer_guard),
    ))  # fmt: skip
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=SERVER_THREAD)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    lock.threads.clear()  # create_app set the pin quotas (this thread, before serving)
    yield Live(engine, app, lock, sock.getsockname()[1])
    server.should_exit = True
    thread.join(60)
    sock.close()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def victim(client: httpx.AsyncClient) -> None:
    """The victim's request during an attack: it completes, with text."""
    r = await client.post("/v1/completions", headers=auth("sk-victim"), json={
        "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


async def healthy(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def run(live: Live, attack) -> list[httpx.Response]:
    """``attack(client)`` (its answers) beside a victim's request and a health probe; no 5xx,
    and the engine's lock never taken on the event loop or in the default executor."""

    async def main():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=300, limits=limits) as c:
            answers, *_ = await asyncio.gather(attack(c), victim(c), healthy(c))
            return answers

    answers = asyncio.run(main())
    assert all(r.status_code < 500 for r in answers), [r.text for r in answers if r.status_code >= 500]
    assert live.lock.outsiders() == set(), live.lock.threads
    return answers


def codes(answers) -> collections.Counter:
    return collections.Counter(r.status_code for r in answers)


# -- 1. miss explanations ------------------------------------------------------------------------
def test_miss_explanations_bisect_the_siblings(live, monkeypatch):
    """A tenant caches 300 one-block prompts ``[7]*15 + [j]`` (siblings under its root), then
    asks for explanations of 16 new ones per request, from 2 loops: every answer is right (the
    15 tokens shared with a sibling, token-exactly reused), and no explanation scanned the
    siblings (it used to scan all of them under the engine lock, for every prompt)."""
    key = "sk-a0"
    for start in range(0, 300, 32):
        body = {"prompt": [[7] * 15 + [1000 + j, 1] for j in range(start, start + 32)],
                "max_tokens": 1}  # fmt: skip
        assert httpx.post(live.base_url + "/v1/completions", json=body, headers=auth(key),
                          timeout=300).status_code == 200  # fmt: skip
    scans = []
    real = PrefixIndex.children
    monkeypatch.setattr(PrefixIndex, "children", lambda self, p: scans.append(p) or real(self, p))

    async def attack(c):
        async def loop(i):
            out = []
            for k in range(3):
                prompts = [[7] * 15 + [20000 + 100 * i + 16 * k + j, 1] for j in range(16)]
                out.append(await c.post("/v1/completions", headers=auth(key), json={
                    "prompt": prompts, "max_tokens": 1, "return_cache_info": True}))  # fmt: skip
            return out

        return [r for rs in await asyncio.gather(*(loop(i) for i in range(2))) for r in rs]

    answers = run(live, attack)
    assert codes(answers).keys() <= {200, 429} and codes(answers)[200] >= 2
    for r in answers:
        if r.status_code == 200:
            for ch in r.json()["choices"]:
                info = ch["cache_info"]
                assert (info["reason"], info["diverged_at"], info["cached_tokens"]) == ("diverged", 15, 15)
    assert scans == []


# -- 2. metrics and integrity --------------------------------------------------------------------
def test_metrics_scrapes_read_the_engine_off_the_default_pool(live):
    """Keyless scrapes, 50 at a time (from 127.0.0.3): 401 (with keys, /metrics needs an admin
    key or the metrics key), the engine untouched, and past --max-unauthenticated-per-second
    the address is blocked: its next connection is refused as soon as it is made. 64 concurrent
    admin scrapes: read on the snapshot thread, one at a time (the lock never taken on the loop
    or the default executor, checked by ``run``); the integrity check likewise. (Sharing
    reads: test_server_units.)"""
    reader = live.serving.snapshot_reader
    guard = live.app.state.peer_guard
    keyless = httpx.AsyncHTTPTransport(local_address="127.0.0.3")

    async def attack(c):
        before = reader.reads
        async with httpx.AsyncClient(base_url=live.base_url, transport=keyless, timeout=60) as k:
            async def scrape():
                try:
                    return (await k.get("/metrics")).status_code
                except httpx.HTTPError:
                    return -1  # closed: the address was blocked meanwhile
            got = collections.Counter()
            for _ in range(20):  # batches of 50 until past 64 in a second (a few batches)
                got.update(await asyncio.gather(*(scrape() for _ in range(50))))
                if guard.blocked("127.0.0.3"):
                    break
            assert got[401] > live.serving.limits.max_unauthenticated_per_second, got
            assert set(got) <= {401, -1} and reader.reads == before
            assert guard.blocked("127.0.0.3")
            with pytest.raises(httpx.HTTPError):  # refused when made, before any request
                await k.get("/health")
        admin = await asyncio.gather(*(c.get("/metrics", headers=auth("sk-ops")) for _ in range(64)))
        assert codes(admin) == {200: 64} and before < reader.reads <= before + 64
        checks = await asyncio.gather(*(c.get("/v1/debug/integrity", headers=auth("sk-ops"))
                                        for _ in range(8)))  # fmt: skip
        assert all(r.json()["ok"] for r in checks)
        return admin + checks

    run(live, attack)
    assert not guard.blocked("127.0.0.1")  # the victim's address: never


# -- 3. warm through the gate --------------------------------------------------------------------
def test_pinned_warms_go_through_the_gate_and_admission_first(live, monkeypatch):
    """16 concurrent renewals of one pinned warm: at most the tenant's cap run at once (the rest
    are 429s), their lookups and pins on the cache routes' threads, never the event loop; a
    warm of a tenant over its share of the queue is refused before any engine work."""
    body = {"prompt": list(range(1000, 1064)), "pin": True, "ttl_seconds": 30}

    async def attack(c):
        return await asyncio.gather(*(c.post("/v1/cache/warm", json=body, headers=auth("sk-a1"))
                                      for _ in range(16)))  # fmt: skip

    answers = run(live, attack)
    assert codes(answers).keys() <= {200, 429} and codes(answers)[200] >= 1
    assert codes(answers)[429] >= 1  # the cap of 2 calls at once (or the rate)
    assert live.lock.threads["prefixcache-engine"] > 0
    lookups = []
    engine = live.engine
    monkeypatch.setattr(engine, "lookup", lambda *a: lookups.append(a))
    real = engine.check_admission

    def over_share(tenant, n):
        if tenant == "a2":
            raise TenantQuotaError("this tenant has 32 sequences waiting (its share is 32)")
        return real(tenant, n)

    monkeypatch.setattr(engine, "check_admission", over_share)
    r = httpx.post(live.base_url + "/v1/cache/warm", json=body, headers=auth("sk-a2"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_quota_exceeded"
    assert lookups == []


# -- 4. work before admission --------------------------------------------------------------------
def test_work_before_admission_is_charged_or_refused_first(live, monkeypatch):
    """count_tokens is a call of the tenant's cache-call rate, charged before its body is read
    (renders only for the calls let through); a completion over the tenant's share is refused
    before it is tokenized; a comparison takes a call of the rate; 404s for a wrong model count
    as refusals, so a stream of them is refused before the bodies are read."""
    s = live.serving
    renders = []
    renderer = s.renderer(MessagesRenderer)
    real_prompt = renderer.prompt
    monkeypatch.setattr(renderer, "prompt", lambda *a: renders.append(1) or real_prompt(*a))
    cc = {"type": "ephemeral"}
    count_body = {"model": MODEL, "system": [{"type": "text", "text": "Be brief.", "cache_control": cc}],
                  "messages": [{"role": "user", "content": "Hi there."}]}  # fmt: skip

    async def attack(c):
        counted = await asyncio.gather(*(c.post("/v1/messages/count_tokens", json=count_body,
                                                headers=auth("sk-a3")) for _ in range(40)))  # fmt: skip
        assert codes(counted).keys() <= {200, 429} and codes(counted)[429] >= 1
        assert len(renders) == codes(counted)[200] <= s.limits.max_cache_calls_per_second + 2
        return counted

    run(live, attack)
    # A comparison renders prefixes: it runs on the gate, as a call of the tenant's rate.
    first = httpx.post(live.base_url + "/v1/chat/completions", headers=auth("sk-a4"), timeout=300,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                             "prompt_cache_options": {}}).json()  # fmt: skip
    gated = []
    real_run = s.cache_gate.run

    async def gate_run(tenant, fn, *args, rated=True):
        gated.append((tenant, getattr(fn, "__name__", ""), rated))
        return await real_run(tenant, fn, *args, rated=rated)

    monkeypatch.setattr(s.cache_gate, "run", gate_run)
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=auth("sk-a4"), timeout=300, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
        "prompt_cache_options": {"comparison_response_id": first["id"]}})  # fmt: skip
    assert r.status_code == 200 and r.json()["prompt_cache_diagnostics"]["type"] == "cache_miss"
    assert gated == [("a4", "compare", True)]
    # Over its share of the queue: 429 before anything is tokenized.
    encodes = []
    tok = s.tokenizer
    monkeypatch.setattr(tok, "encode", lambda *a, **k: encodes.append(1) or [])
    real = live.engine.check_admission

    def over_share(tenant, n):
        if tenant == "a5":
            raise TenantQuotaError("this tenant has 32 sequences waiting (its share is 32)")
        return real(tenant, n)

    monkeypatch.setattr(live.engine, "check_admission", over_share)
    r = httpx.post(live.base_url + "/v1/completions", headers=auth("sk-a5"),
                   json={"prompt": "a long text " * 200, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 429 and encodes == []
    monkeypatch.undo()
    # Wrong model names: 404s, counted; past the limit a 429 before the body is read.
    wrong = {"model": "not-served", "prompt": "Hi", "max_tokens": 1}
    got = [httpx.post(live.base_url + "/v1/completions", headers=auth("sk-a6"), json=wrong)
           for _ in range(s.limits.max_refusals_per_second + 2)]  # fmt: skip
    assert got[0].status_code == 404 and got[-1].status_code == 429
    assert got[-1].json()["error"]["code"] == "too_many_refusals"


# -- 5. bodies bounded in containers -------------------------------------------------------------
def test_a_body_of_many_containers_is_refused_before_it_is_parsed(live, monkeypatch):
    """9,000 empty content blocks (234 KB): refused unparsed (its parse and validation held the
    interpreter 36-53 ms); a body with a few hundred containers (over 256) is parsed off the event loop."""
    parsed = []
    real = protocol._parse
    monkeypatch.setattr(protocol, "_parse", lambda *a: parsed.append(threading.current_thread().name)
                        or real(*a))  # fmt: skip
    blocks = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 9000}]}

    async def attack(c):
        return await asyncio.gather(*(c.post("/v1/messages/count_tokens", json=blocks,
                                             headers=auth("sk-a7")) for _ in range(8)))  # fmt: skip

    answers = run(live, attack)
    assert codes(answers).keys() <= {400, 429}  # (Anthropic's error shape: no code)
    assert all("objects and arrays" in r.json()["error"]["message"] for r in answers
               if r.status_code == 400) and codes(answers)[400] >= 1  # fmt: skip
    assert len(parsed) == 1  # the victim's small body alone was parsed (on the loop)
    parsed.clear()
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 300}],
            "max_tokens": 1}  # fmt: skip
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=auth("sk-victim"), json=chat,
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    assert parsed and SERVER_THREAD not in parsed  # parsed in a worker thread


# -- 6. newcomer steps ---------------------------------------------------------------------------
def test_one_token_requests_do_not_keep_a_tenant_newly_arrived(live, monkeypatch):
    """8 loops of one-token requests (each finished in its first step) beside the victim's
    longer stream: steps that ran the attacker alone are at most one in 2 x (active tenants),
    not every other step."""
    sched = live.engine.engine.scheduler
    steps = collections.Counter()
    real = sched.schedule

    def schedule():
        out = real()
        tenants = {x.seq.tenant for x in out.scheduled}
        if tenants:
            steps["all"] += 1
            steps["alone"] += tenants == {"a8"}
        return out

    monkeypatch.setattr(sched, "schedule", schedule)

    async def attack(c):
        stop = asyncio.Event()

        async def loop(i):
            out = []
            while not stop.is_set():
                out.append(await c.post("/v1/completions", headers=auth("sk-a8"),
                                        json={"prompt": [9, 100 + i, len(out)], "max_tokens": 1}))
            return out

        async def long_victim():
            r = await c.post("/v1/completions", headers=auth("sk-victim"), json={
                "prompt": "Count from one to a hundred:", "max_tokens": 48, "ignore_eos": True})
            stop.set()
            return r

        *loops, v = await asyncio.gather(*(loop(i) for i in range(8)), long_victim())
        assert v.status_code == 200
        return [r for rs in loops for r in rs]

    answers = run(live, attack)
    assert codes(answers).keys() <= {200, 429}
    assert steps["all"] >= 20 and steps["alone"] <= steps["all"] // 4 + 1, steps


# -- 7. a shared salt on the Messages API -------------------------------------------------------
def test_guesses_of_a_private_turn_under_a_shared_salt_look_alike(live):
    """The victim sends a private turn under the shared salt with automatic caching; an attacker
    sends an exact guess and a wrong one, each from an empty namespace of its own: identical
    cached counts and explanations (the shared prefix stops at the system)."""
    private = "My PIN is 4471 and my salary is 91,250 dollars; file my tax form."
    wrong = "My PIN is 9999 and my salary is 12,000 dollars; file my tax form."

    def body(turn: str) -> dict:
        return {"model": MODEL, "max_tokens": 1, "system": "You are the payroll assistant.",
                "messages": [{"role": "user", "content": turn}], "cache_control": {"type": "ephemeral"},
                "cache_salt": "public", "return_cache_info": True}  # fmt: skip

    def call(key: str, path: str, payload: dict) -> dict:
        r = httpx.post(live.base_url + path, json=payload, headers=auth(key), timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    call("sk-victim", "/v1/messages", body(private))
    seen = []
    for guess in (private, wrong):
        call("sk-a9", "/v1/cache/invalidate", {"namespace": "a9/public"})
        r = call("sk-a9", "/v1/messages", body(guess))
        seen.append((r["usage"]["cache_read_input_tokens"], r["cache_info"]))
    assert seen[0] == seen[1], seen


# -- 9. connections shared by peers --------------------------------------------------------------
def test_half_sent_connections_of_one_peer_do_not_lock_others_out(live):
    """Another address (127.0.0.2) fills every connection with half-sent requests (keyless, a
    slowloris); a victim's connection from 127.0.0.1 takes the place of one of them and is
    served; the flooding peer's next connection is closed at once."""
    held = []
    for _ in range(MAX_CONNECTIONS):
        s = socket.create_connection(("127.0.0.1", live.port), source_address=("127.0.0.2", 0))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        held.append(s)
    time.sleep(0.5)  # every one accepted
    try:
        r = httpx.post(live.base_url + "/v1/completions", headers=auth("sk-victim"), timeout=60,
                       json={"prompt": "Hi", "max_tokens": 1})  # fmt: skip
        assert r.status_code == 200
        # The victim's connection is gone again: the peer fills the free place, and its next
        # connection finds nobody holding more than it does.
        refill = socket.create_connection(("127.0.0.1", live.port), source_address=("127.0.0.2", 0))
        held.append(refill)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", live.port), source_address=("127.0.0.2", 0))
        extra.settimeout(5)
        try:
            assert extra.recv(1) == b""  # closed at once: the flooding peer holds the most
        except ConnectionResetError:
            pass
        extra.close()
        alive = 0
        for s in held:  # one (or more) of them made room for the victim
            s.setblocking(False)
            try:
                alive += s.recv(1) != b""
            except BlockingIOError:
                alive += 1
            except ConnectionResetError:
                pass
        assert alive < len(held)
        assert httpx.get(live.base_url + "/health").status_code == 200
    finally:
        for s in held:
            s.close()
