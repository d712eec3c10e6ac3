"""Tenant isolation figures: a victim tenant's time to first token while another tenant runs an
attack, as a ratio to its time to first token alone (issue #23's figure: target <= 3x each).

One `prefixcache serve` per attack, with two tenants (keys ``sk-victim``, ``sk-flood``) and
default limits.

  alone      the victim sends a small streaming completion (a fresh 32-token prompt, 4 tokens)
             every ``--pause`` seconds, ``--samples`` times, on an idle server
  flood      the attacker keeps ``--flood-clients`` requests in flight without pause, each 16
             prompts x n=8 (128 sequences, its whole share of the queue) of ``--flood-tokens``
             tokens; once it holds the batch, the victim sends the same requests as alone
  segments   the attacker keeps ``--flood-clients`` ``POST /v1/cache/warm`` in flight, each
             ``--segment-docs`` (20) unique documents of ~350 tokens in segments mode, every one
             computed alone (within the context, so the work is done)
  refused    the same with 64 documents: over the context, so every one is a 400 once its
             ~128 KiB body is parsed and tokenized (a flood of refused requests)
  routes     ``--route-clients`` concurrent loops of cache-control calls (invalidate of its own
             namespace, lookup, stats), 429s counted
  logprobs   ``--flood-clients`` requests in flight of 8 prompts x n=16, max_tokens 2000,
             logprobs 20, ignore_eos (big bodies, per-token work on the event loop)

Issue #37's attacks: ``--attack-clients`` (64) loops from another loopback address
(127.0.0.2, so a per-peer connection cap never counts the victim), a third tenant's background
load with ``--background`` (one loop of 8 prompts x 32 tokens), and ``/health`` probed every
0.1 s in both phases (its median latency reported alone and during the attack):

  explain        the attacker caches ``--explain-siblings`` one-block prompts ``[7]*15 + [j]``
                 (siblings under its namespace's root), then asks for miss explanations of 32
                 new prompts per request (``return_cache_info``)
  metrics        keyless ``GET /metrics`` scrapes
  warm-pin       the same pinned ``/v1/cache/warm`` renewed over and over
  count-tokens   ``/v1/messages/count_tokens`` with four breakpoints (five renders each)
  comparison     chats naming an earlier response (``prompt_cache_options``: ~11 renders each)
  wrong-model    ~200 KB chats naming a model that is not served (a 404 after the parse)
  nodes          ``count_tokens`` bodies of 9,000 empty content blocks (234 KB)
  newcomer       one-token requests of 16 new tokens, without pause (the newcomer step)
  slow-headers   keyless connections that never finish their headers (``--slow-connections``)

``--attacker-process`` runs issue #37's attack loops in a process of their own: an attacker is
never inside the victim's process, and 64 loops in the probes' event loop delay the probes by
the client's own work (docs/benchmarks-journal.md "Tenant isolation": 6.3x against 1.2x for ``/health``
during keyless metrics scrapes, the same server).

TTFT is measured by the client: from sending the request to the first SSE event with text.
Reported per attack: medians (and p90) of each phase, the ratio of the medians, the
attacker's answers by status, and the server's generated tokens per second during the attack
phase (the attacker's throughput, the victim's few tokens included). ``--server-args`` passes
flags to the server, e.g. ``"--shared-step-ms 0"`` for the throughput the short shared steps
cost the attacker. ``--checkout DIR`` runs the server from another checkout (e.g. a
worktree of an older commit) with the same venv, for a before/after comparison.

    .venv/bin/python benchmarks/tenant_isolation.py --attacks flood,segments,routes,logprobs
    .venv/bin/python benchmarks/tenant_isolation.py --checkout /tmp/before --out before.json
    .venv/bin/python benchmarks/tenant_isolation.py --background --pause 0.3 \
        --attacks explain,metrics,warm-pin,count-tokens,comparison,wrong-model,nodes,newcomer,slow-headers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from prefixcache.server.launcher import ServerProcess

KEYS = {"keys": {"sk-victim": "victim", "sk-flood": "flooder", "sk-bg": "background",
                 "sk-ops": {"tenant": "ops", "admin": True}}}  # fmt: skip
ADMIN = {"Authorization": "Bearer sk-ops"}  # reads /metrics (the benchmark's own figures)
ATTACKER_ADDRESS = "127.0.0.2"  # the attack loops' source address (loopback, another peer)
MODEL = "SmolLM2-135M-Instruct"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(1000, 30000), k=n)


async def victim_ttft(client: httpx.AsyncClient, rng: random.Random) -> float:
    body = {"prompt": prompt_ids(rng, 32), "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": "Bearer sk-victim"}) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"victim got {r.status_code}: {await r.aread()!r}")
        ttft, done = None, False
        async for line in r.aiter_lines():  # read to the end: the request finishes normally
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:  # e.g. cancelled at max_pending_deltas: a lost request
                    raise RuntimeError(f"the victim's stream failed: {chunk['error']}")
                if ttft is None and chunk["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
            done = done or line == "data: [DONE]"
    if ttft is None or not done:
        raise RuntimeError("the victim's stream ended without text or without [DONE]")
    return ttft


async def flood(client: httpx.AsyncClient, rng: random.Random, args, stop: asyncio.Event,
                codes: list[int]) -> None:  # fmt: skip
    while not stop.is_set():
        body = {"prompt": [prompt_ids(rng, 64) for _ in range(16)], "n": 8, "max_tokens": args.flood_tokens,
                "ignore_eos": True}  # fmt: skip
        await attack_call(client, "POST", "/v1/completions", body, codes)


# An attack call whose connection the server closed or refused is counted as -1 and retried
# after this long (an attacker that keeps at it; the pause keeps the attacking client, on the
# same cores, from spinning).
REFUSED_PAUSE_S = 0.01


async def attack_call(client, method: str, path: str, body, codes: list[int], headers=None) -> None:
    try:
        r = await client.request(method, path, json=body,
                                 headers={"Authorization": "Bearer sk-flood"} if headers is None else headers)  # fmt: skip
    except httpx.HTTPError:
        codes.append(-1)
        await asyncio.sleep(REFUSED_PAUSE_S)
        return
    codes.append(r.status_code)
    if r.status_code == 429:
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))


def document(rng: random.Random) -> str:
    words = ["alpha", "river", "stone", "ledger", "orbit", "maple", "copper", "signal", "harbor", "quartz"]
    return f"Record {rng.getrandbits(64):x}: " + " ".join(rng.choice(words) for _ in range(280))


def documents_body(rng: random.Random, n: int, **extra) -> dict:
    docs = [{"role": "document", "content": document(rng)} for _ in range(n)]
    return {"cache_mode": "segments", "messages": [*docs, {"role": "user", "content": "Summarize."}],
            **extra}  # fmt: skip


async def segments(client, rng, args, stop, codes, docs: int | None = None) -> None:
    while not stop.is_set():
        await attack_call(client, "POST", "/v1/cache/warm", documents_body(rng, docs or args.segment_docs), codes)


async def segments_chat(client, rng, args, stop, codes) -> None:
    """The same documents through a chat in segments mode with nothing recomputed."""
    while not stop.is_set():
        body = documents_body(rng, args.segment_docs, segment_recompute_tokens=0, max_tokens=4)
        await attack_call(client, "POST", "/v1/chat/completions", body, codes)


async def refused(client, rng, args, stop, codes) -> None:
    """64 documents (the documents limit) of ~350 tokens: over the context, each a 400 after
    its ~128 KiB body is parsed and its text tokenized."""
    await segments(client, rng, args, stop, codes, docs=64)


async def routes(client, rng, args, stop, codes) -> None:
    calls = [("POST", "/v1/cache/invalidate", {}), ("POST", "/v1/cache/lookup", {"prompt": "hello " * 50}),
             ("GET", "/v1/cache/stats", None)]  # fmt: skip
    while not stop.is_set():
        method, path, body = rng.choice(calls)
        await attack_call(client, method, path, body, codes)


def logprobs_body(rng: random.Random, **extra) -> dict:
    return {"prompt": [prompt_ids(rng, 32) for _ in range(8)], "n": 16, "max_tokens": 2000,
            "logprobs": 20, "ignore_eos": True, **extra}  # fmt: skip


async def logprobs(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        await attack_call(client, "POST", "/v1/completions", logprobs_body(rng), codes)


async def logprobs_stream(client, rng, args, stop, codes) -> None:
    """The logprobs flood streamed, read as it comes (the issue's case: its deltas must not
    get other tenants' streams cancelled at max_pending_deltas)."""
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=logprobs_body(rng, stream=True),
                                 headers={"Authorization": "Bearer sk-flood"}) as r:  # fmt: skip
            codes.append(r.status_code)
            async for _ in r.aiter_lines():
                if stop.is_set():
                    break
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))


# -- issue #37's attacks -------------------------------------------------------------------------
def _one_block(j: int) -> list[int]:
    return [7] * 15 + [j]


async def explain_setup(client, args) -> None:
    """``--explain-siblings`` one-block prompts under the attacker's root, 32 per request."""
    n, step = args.explain_siblings, 32
    for start in range(0, n, step):
        body = {"prompt": [_one_block(1000 + j) for j in range(start, min(n, start + step))],
                "max_tokens": 1}  # fmt: skip
        r = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-flood"})
        if r.status_code != 200:
            raise RuntimeError(f"explain setup got {r.status_code}: {r.text[:300]}")


async def explain(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        prompts = [[*_one_block(rng.randrange(30000, 49000)), 5] for _ in range(32)]
        body = {"prompt": prompts, "max_tokens": 1, "return_cache_info": True}
        await attack_call(client, "POST", "/v1/completions", body, codes)


async def metrics_scrape(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        await attack_call(client, "GET", "/metrics", None, codes, headers={})  # no key


async def warm_pin(client, rng, args, stop, codes) -> None:
    body = {"prompt": prompt_ids(random.Random(7), 64), "pin": True, "ttl_seconds": 60}
    while not stop.is_set():
        await attack_call(client, "POST", "/v1/cache/warm", body, codes)


def _breakpoints_body(rng: random.Random) -> dict:
    cc = {"type": "ephemeral"}
    text = lambda: document(rng)[:1200]
    return {
        "model": MODEL,
        "system": [{"type": "text", "text": text(), "cache_control": cc}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": text(), "cache_control": cc}]},
            {"role": "assistant", "content": [{"type": "text", "text": text(), "cache_control": cc}]},
            {"role": "user", "content": [{"type": "text", "text": text(), "cache_control": cc}]},
        ],
    }


async def count_tokens(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        await attack_call(client, "POST", "/v1/messages/count_tokens", _breakpoints_body(rng), codes)


def _chat(rng: random.Random, turns: int, chars: int = 60) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": document(rng)[:chars]})
    return msgs


async def comparison_setup(client, args) -> str:
    body = {"messages": _chat(random.Random(3), 21), "max_tokens": 1, "prompt_cache_options": {}}
    r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-flood"})
    if r.status_code != 200:
        raise RuntimeError(f"comparison setup got {r.status_code}: {r.text[:300]}")
    return r.json()["id"]


async def comparison(client, rng, args, stop, codes) -> None:
    previous = args.comparison_id
    while not stop.is_set():
        msgs = _chat(random.Random(3), 21)
        msgs[-1]["content"] = document(rng)[:60]  # the last turn differs: a search over the parts
        body = {"messages": msgs, "max_tokens": 1,
                "prompt_cache_options": {"comparison_response_id": previous}}  # fmt: skip
        await attack_call(client, "POST", "/v1/chat/completions", body, codes)


async def wrong_model(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        body = {"model": "not-served", "messages": _chat(rng, 600, 300), "max_tokens": 1}
        await attack_call(client, "POST", "/v1/chat/completions", body, codes)


async def nodes(client, rng, args, stop, codes) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 9000}]}
    raw = json.dumps(body).encode()
    headers = {"Authorization": "Bearer sk-flood", "content-type": "application/json"}
    while not stop.is_set():
        try:
            r = await client.post("/v1/messages/count_tokens", content=raw, headers=headers)
        except httpx.HTTPError:
            codes.append(-1)
            await asyncio.sleep(REFUSED_PAUSE_S)
            continue
        codes.append(r.status_code)
        if r.status_code == 429:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))


async def newcomer(client, rng, args, stop, codes) -> None:
    while not stop.is_set():
        body = {"prompt": prompt_ids(rng, 16), "max_tokens": 1}
        await attack_call(client, "POST", "/v1/completions", body, codes)


async def slow_headers(client, rng, args, stop, codes) -> None:
    """Keyless connections that send half a request's headers and nothing more; each one the
    server closes is opened again (``--slow-connections`` of them over all loops)."""
    url = httpx.URL(str(client.base_url))
    per_loop = max(1, args.slow_connections // args.attack_clients)
    held: list[asyncio.StreamWriter] = []
    try:
        while not stop.is_set():
            held = [w for w in held if not w.is_closing()]
            while len(held) < per_loop and not stop.is_set():
                try:
                    _, w = await asyncio.open_connection(url.host, url.port, local_addr=(ATTACKER_ADDRESS, 0))
                    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
                    held.append(w)
                    codes.append(0)  # a connection opened
                except OSError:
                    codes.append(-1)  # refused
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
    finally:
        for w in held:
            w.close()


ATTACKS = {"flood": flood, "segments": segments, "segments-chat": segments_chat,
           "refused": refused, "routes": routes, "logprobs": logprobs,
           "logprobs-stream": logprobs_stream, "explain": explain, "metrics": metrics_scrape,
           "warm-pin": warm_pin, "count-tokens": count_tokens, "comparison": comparison,
           "wrong-model": wrong_model, "nodes": nodes, "newcomer": newcomer,
           "slow-headers": slow_headers}  # fmt: skip
NEW_ATTACKS = {"explain", "metrics", "warm-pin", "count-tokens", "comparison", "wrong-model", "nodes",
               "newcomer", "slow-headers"}  # fmt: skip
SETUPS = {"explain": explain_setup}


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """A counter of the server's (NaN when the server cannot be reached: an attack on
    connections may refuse even this reader's)."""
    try:
        text = (await client.get("/metrics", headers=ADMIN)).text
    except httpx.HTTPError:
        return float("nan")
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rpartition(" ")[2])
    return 0.0


async def running(client: httpx.AsyncClient) -> float:
    return await metric(client, "prefixcache:num_requests_running")


async def generated(client: httpx.AsyncClient) -> float:
    return await metric(client, "prefixcache:generation_tokens_total")


async def wait_busy(client: httpx.AsyncClient, minimum: int, timeout: float = 600) -> None:
    """Until the flooder holds at least ``minimum`` running sequences (read from /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await running(client) >= minimum:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the flood never filled the batch")


async def victim_phase(client, rng, samples: int, pause: float, lost: list | None = None) -> list[float]:
    """The victim's TTFTs; with ``lost``, a request that fails is counted there instead of
    ending the run (an attack on connections may refuse the victim's)."""
    out = []
    for _ in range(samples):
        try:
            out.append(await victim_ttft(client, rng))
        except (httpx.HTTPError, RuntimeError) as e:
            if lost is None:
                raise
            lost.append(repr(e)[:200])
        await asyncio.sleep(pause)
    return out


async def health_probe(base_url: str, stop: asyncio.Event, out: list[float], fresh: bool = False) -> None:
    """``GET /health`` every 0.1 s on a connection of its own (``fresh``: a new connection for
    each probe); latencies in seconds, a failed probe as infinity."""
    limits = httpx.Limits(max_keepalive_connections=0) if fresh else httpx.Limits()
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await client.get("/health")
                out.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                out.append(float("inf"))
            await asyncio.sleep(0.1)


async def background(base_url: str, stop: asyncio.Event, tokens: list[float]) -> None:
    """A third tenant's steady load: 8 prompts x 32 tokens per request, one at a time, streamed;
    ``tokens`` gets the arrival time of each token (its throughput in any window)."""
    rng = random.Random(99)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        while not stop.is_set():
            body = {"prompt": [prompt_ids(rng, 64) for _ in range(8)], "max_tokens": 32,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Authorization": "Bearer sk-bg"}) as r:  # fmt: skip
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text":""' not in line:
                        tokens.append(time.perf_counter())


def _attack_child(base_url: str, attack: str, args, clients: int, stop, out) -> None:
    """The attack loops in a process of their own (``--attacker-process``): an attacker is
    never inside the victim's process, and 64 loops reconnecting in the probe's own event loop
    would delay the probe's ``/health`` calls by the client's own work. ``out`` gets each
    status as it comes (the parent counts them)."""

    async def run() -> None:
        limits = httpx.Limits(max_connections=clients + 4)
        transport = httpx.AsyncHTTPTransport(local_address=ATTACKER_ADDRESS, limits=limits)

        class Codes(list):
            def append(self, code: int) -> None:
                out.put(code)

        codes, done = Codes(), asyncio.Event()
        async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits,
                                     transport=transport) as attacker:  # fmt: skip
            tasks = [asyncio.create_task(ATTACKS[attack](attacker, random.Random(i + 1), args, done, codes))
                     for i in range(clients)]  # fmt: skip
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    out.put(None)


async def attack_in_process(base_url: str, attack: str, args, clients: int, stop: asyncio.Event,
                            codes: list[int]) -> None:  # fmt: skip
    """Runs ``_attack_child`` in a spawned process until ``stop``; its statuses land in ``codes``."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    child_stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_attack_child, args=(base_url, attack, args, clients, child_stop, out), daemon=True)
    proc.start()
    finished = False
    while not finished:
        if stop.is_set():
            child_stop.set()
        try:
            while True:
                code = out.get_nowait()
                if code is None:
                    finished = True
                    break
                codes.append(code)
        except queue.Empty:
            pass
        await asyncio.sleep(0.05)
    await asyncio.to_thread(proc.join, 30)


def rate_between(times: list[float], t0: float, t1: float) -> float:
    return sum(t0 <= t < t1 for t in times) / max(1e-9, t1 - t0)


async def measure(base_url: str, attack: str, args) -> dict:
    rng = random.Random(0)
    clients = args.route_clients if attack == "routes" else args.flood_clients
    new = attack in NEW_ATTACKS
    if new:
        clients = args.attack_clients
    limits = httpx.Limits(max_connections=clients + 4)
    # The attack loops come from another loopback address (another peer) in the new attacks.
    transport = httpx.AsyncHTTPTransport(local_address=ATTACKER_ADDRESS, limits=limits) if new else None
    # The new attacks' victim opens a connection per request, as many clients do (a
    # keep-alive connection would hide an attack on connections).
    victim_limits = httpx.Limits(max_keepalive_connections=0) if new else limits
    async with (httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as observer,
                httpx.AsyncClient(base_url=base_url, timeout=3600, limits=victim_limits) as client,
                httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits,
                                  transport=transport) as attacker):  # fmt: skip
        if attack in SETUPS:
            await SETUPS[attack](attacker, args)
        if attack == "comparison":
            args.comparison_id = await comparison_setup(attacker, args)
        bg_stop, bg_tokens, bg_task = asyncio.Event(), [], None
        if args.background:
            bg_task = asyncio.create_task(background(base_url, bg_stop, bg_tokens))
            await asyncio.sleep(2.0)
        await victim_ttft(client, rng)  # warm-up
        health_stop, health_alone = asyncio.Event(), []
        probe = asyncio.create_task(health_probe(base_url, health_stop, health_alone, new))
        t_alone = time.perf_counter()
        alone = await victim_phase(client, rng, args.samples, args.pause)
        bg_alone = rate_between(bg_tokens, t_alone, time.perf_counter())
        health_stop.set()
        await probe
        stop, codes = asyncio.Event(), []
        if args.attacker_process and new:
            tasks = [asyncio.create_task(attack_in_process(base_url, attack, args, clients, stop, codes))]
        else:
            tasks = [asyncio.create_task(ATTACKS[attack](attacker, random.Random(i + 1), args, stop, codes))
                     for i in range(clients)]  # fmt: skip
        if attack in ("flood", "logprobs", "logprobs-stream"):
            await wait_busy(observer, minimum=64)
        else:  # under way: the first calls are in (or refused)
            deadline = time.monotonic() + 120
            while len(codes) < 1 and time.monotonic() < deadline and not any(t.done() for t in tasks):
                await asyncio.sleep(0.2)
            await asyncio.sleep(args.pause)
        health_stop, health_attack = asyncio.Event(), []
        probe = asyncio.create_task(health_probe(base_url, health_stop, health_attack, new))
        lost: list[str] = []
        tokens0, t0 = await generated(observer), time.perf_counter()
        during = await victim_phase(client, rng, args.samples, args.pause, lost if new else None)
        bg_attack = rate_between(bg_tokens, t0, time.perf_counter())
        rate = (await generated(observer) - tokens0) / (time.perf_counter() - t0)
        health_stop.set()
        await probe
        stop.set()
        bg_stop.set()
        if args.attacker_process and new:
            await asyncio.gather(*tasks, return_exceptions=True)  # collects the child's codes
        for t in tasks:
            t.cancel()
        if bg_task is not None:
            bg_task.cancel()
        await asyncio.gather(*tasks, *([bg_task] if bg_task else []), return_exceptions=True)
        errors = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
    return {"alone": alone, "attack": during, "codes": codes, "attacker_errors": errors,
            "generated_tokens_per_s": rate, "health_alone": health_alone, "health_attack": health_attack,
            "victim_lost": lost,
            "background_tokens_per_s": [bg_alone, bg_attack] if args.background else None}  # fmt: skip


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--attacks", default="flood", help=f"comma-separated, of {','.join(ATTACKS)}")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--flood-clients", type=int, default=2)
    ap.add_argument("--flood-tokens", type=int, default=32)
    ap.add_argument("--segment-docs", type=int, default=20)
    ap.add_argument("--route-clients", type=int, default=50)
    ap.add_argument("--attack-clients", type=int, default=64, help="loops of issue #37's attacks")
    ap.add_argument("--explain-siblings", type=int, default=3000)
    ap.add_argument("--slow-connections", type=int, default=600)
    ap.add_argument("--background", action="store_true", help="a third tenant's load in both phases")
    ap.add_argument("--attacker-process", action="store_true",
                    help="issue #37's attack loops in a process of their own (not in the probes' event loop)")
    ap.add_argument("--checkout", default=None, help="run the server from this checkout")
    ap.add_argument("--server-args", default="", help="more flags for the server (one string)")
    ap.add_argument("--out", default="results/tenant_isolation.json")
    args = ap.parse_args()
    attacks = args.attacks.split(",")
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        ap.error(f"unknown attacks {sorted(unknown)}")

    summary = {"machine": f"{cpu_name()}, {os.cpu_count()} cores", "checkout": args.checkout or "this one",
               "args": vars(args), "attacks": {}}  # fmt: skip
    for attack in attacks:
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp:
            keys = Path(tmp) / "keys.json"
            keys.write_text(json.dumps(KEYS))
            env = {"OMP_WAIT_POLICY": "PASSIVE"}
            if args.checkout:
                env["PYTHONPATH"] = str(Path(args.checkout).resolve())
            # The explain attack's siblings must all stay cached (~0.7 MiB a block).
            kv = "3GiB" if attack == "explain" else "1GiB"
            server_args = ["--api-keys-file", str(keys), "--kv-cache-memory", kv,
                           *shlex.split(args.server_args)]  # fmt: skip
            with ServerProcess(server_args, env=env, cwd=args.checkout) as srv:
                result = asyncio.run(measure(srv.base_url, attack, args))
                log_tail = srv.output()[-3000:]
        load_after = os.getloadavg()
        alone = statistics.median(result["alone"])
        # Every victim request lost to the attack (refused connections): no time to report.
        during = statistics.median(result["attack"]) if result["attack"] else float("nan")
        codes = result["codes"]
        summary["attacks"][attack] = {
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "victim_ttft_alone_median_s": round(alone, 4),
            "victim_ttft_alone_p90_s": round(p90(result["alone"]), 4),
            "victim_ttft_attack_median_s": round(during, 4),
            "victim_ttft_attack_p90_s": round(p90(result["attack"]), 4) if result["attack"] else None,
            "ratio_of_medians": round(during / alone, 2),
            "generated_tokens_per_s_during_attack": round(result["generated_tokens_per_s"], 1),
            "attacker_status": {str(c): codes.count(c) for c in sorted(set(codes))},
            "attacker_errors": result["attacker_errors"],
            "server_5xx_or_tracebacks": "Traceback" in log_tail or any(c >= 500 for c in codes),
            "samples": {"alone": result["alone"], "attack": result["attack"]},
        }
        row = summary["attacks"][attack]
        health = [sorted(x for x in result[k] if x != float("inf")) for k in ("health_alone", "health_attack")]
        if all(health):
            row["health_alone_median_s"] = round(statistics.median(health[0]), 4)
            row["health_attack_median_s"] = round(statistics.median(health[1]), 4)
            row["health_ratio_of_medians"] = round(row["health_attack_median_s"] / row["health_alone_median_s"], 2)
        row["health_failed"] = sum(x == float("inf") for x in result["health_attack"])
        row["victim_lost"] = result["victim_lost"]
        if result["background_tokens_per_s"] is not None:
            row["background_tokens_per_s_alone_attack"] = [round(x, 1) for x in result["background_tokens_per_s"]]
        print(attack, json.dumps({k: v for k, v in summary["attacks"][attack].items() if k != "samples"}), flush=True)
        out = Path(args.out)  # after every attack: a later one that fails loses nothing
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
