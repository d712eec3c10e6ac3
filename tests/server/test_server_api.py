"""The OpenAI API of `prefixcache serve`, through the official `openai` client and httpx, against a
live server on the default model (one server for the module, small max_tokens: CPU time is short).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a library. Answer in one short sentence, name the shelf "
    "where a book stands, and never invent titles that the catalogue does not list."
)
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "requests.jsonl"
    args = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--log-requests", str(log)]
    with ServerProcess(args) as srv:
        srv.request_log = log
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_service_routes(server, model):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server.base_url + "/version").json()
    models = httpx.get(server.base_url + "/v1/models").json()
    assert models["data"][0]["id"] == model == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == 512


def test_completion_and_chat(client, model):
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                  **GREEDY)  # fmt: skip
    assert c.object == "text_completion" and c.choices[0].text
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.completion_tokens <= 4 and c.usage.prompt_tokens > 0
    assert cached(c.usage) >= 0  # present in every response

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_with_usage_equals_plain(client, model):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Dune?"}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, **GREEDY)
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == plain.usage.completion_tokens
    # The second time the same prompt is served from the cache, and the streamed usage says so.
    assert cached(usage) > 0

    cstream = client.completions.create(model=model, prompt=SYSTEM, max_tokens=3, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY)  # fmt: skip
    cchunks = list(cstream)
    assert cchunks[-1].usage.prompt_tokens > 0 and cached(cchunks[-1].usage) >= 0


def test_shared_prefix_hits_and_matches_cold(client, model):
    def complete(prompt, salt):
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=8, extra_body={"cache_salt": salt}, **GREEDY
        )

    first = complete(SYSTEM + " Question: where is Dune?", "prefix-test")
    assert cached(first.usage) == 0
    second = complete(SYSTEM + " Question: where is Emma?", "prefix-test")
    assert cached(second.usage) >= 32  # the shared system prompt spans at least two blocks
    cold = complete(SYSTEM + " Question: where is Emma?", "prefix-test-cold")
    assert cached(cold.usage) == 0
    assert second.choices[0].text == cold.choices[0].text


def test_document_messages_form_a_cacheable_prefix(client, model):
    doc = {"role": "document", "title": "Catalogue",
           "content": "Dune stands on shelf 4. Emma stands on shelf 9. Ulysses is lent out."}  # fmt: skip

    def ask(q):
        msgs = [{"role": "system", "content": SYSTEM}, doc, {"role": "user", "content": q}]
        return client.chat.completions.create(
            model=model, messages=msgs, max_tokens=4, extra_body={"cache_salt": "docs"}, **GREEDY
        )

    ask("Where is Dune?")
    r = ask("Where is Emma?")
    assert cached(r.usage) >= 48  # system prompt + document


def test_twenty_concurrent_streams_match_cold_runs(client, server, model):
    prompts = [f"{SYSTEM} Shelf {i} holds" for i in range(4)]
    cold = {}
    for i, p in enumerate(prompts):
        r = client.completions.create(model=model, prompt=p, max_tokens=6,
                                      extra_body={"cache_salt": f"cold-{i}"}, **GREEDY)  # fmt: skip
        cold[p] = r.choices[0].text

    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

    async def one(p):
        stream = await aclient.completions.create(
            model=model, prompt=p, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"cache_salt": "concurrent"},
            **GREEDY,
        )  # fmt: skip
        text, usage = [], None
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
            usage = ch.usage or usage
        return p, "".join(text), usage

    async def main():
        try:
            return await asyncio.gather(*[one(prompts[i % 4]) for i in range(20)])
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 20
    for p, text, usage in results:
        assert text == cold[p]
        assert usage.completion_tokens > 0
    assert sum(cached(u) for _, _, u in results) > 0


def test_sampling_fields(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, n=2,
                                  temperature=1.0, seed=7)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, n=2,
                                      temperature=1.0, seed=7)  # fmt: skip
    assert [c.text for c in r.choices] == [c.text for c in again.choices]

    greedy = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12,
                                       **GREEDY)  # fmt: skip
    text = greedy.choices[0].text
    assert len(text.strip()) > 2
    stop = text.strip()[1]  # a character the greedy answer is known to produce
    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12,
                                        stop=[stop], **GREEDY)  # fmt: skip
    assert stop not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"

    lp = client.completions.create(model=model, prompt="Hello", max_tokens=3, logprobs=2,
                                   extra_body={"top_k": 5, "ignore_eos": True}, **GREEDY)  # fmt: skip
    lps = lp.choices[0].logprobs
    assert len(lps.tokens) == 3 == len(lps.token_logprobs) and lp.usage.completion_tokens == 3
    assert all(v <= 0 for v in lps.token_logprobs) and all(len(t) == 2 for t in lps.top_logprobs)

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_bad_inputs_get_openai_errors(server, client, model):
    url = server.base_url + "/v1/completions"

    def check(resp, status):
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return err

    check(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    err = check(httpx.post(url, json={"prompt": "x", "max_tokens": "many"}), 422)
    assert err["param"] == "max_tokens"
    check(httpx.post(server.base_url + "/v1/chat/completions", json={"messages": "hi"}), 422)
    err = check(httpx.post(url, json={"prompt": "x", "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found"
    check(httpx.post(url, json={"prompt": "x", "temperature": -1}), 400)
    check(httpx.post(url, json={"prompt": ""}), 400)
    check(httpx.get(server.base_url + "/v1/nothing"), 404)
    long_prompt = list(range(1000, 1600))  # 600 tokens, the context is 512
    err = check(httpx.post(url, json={"prompt": long_prompt, "max_tokens": 4}), 400)
    assert "600" in err["message"] and "512" in err["message"]
    err = check(httpx.post(url, json={"prompt": list(range(1000, 1500)), "max_tokens": 20}), 400)
    assert "500" in err["message"] and "512" in err["message"]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=1, top_p=2.0)
    # None of it disturbed the server.
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices


def engine_stats(server) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats").json()


def wait_idle(server, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(server)
        e = stats["engine"]
        if e["num_running"] == 0 and e["num_waiting"] == 0 and e["kv_cache_usage"] == 0:
            return stats
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.2)


def test_mid_stream_disconnects_leak_no_blocks(server, model):
    body = {"model": model, "prompt": SYSTEM + " Tell me everything.", "max_tokens": 200,
            "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip

    async def one(client):
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    return  # leave mid-stream: the server must abort the request

    async def main():
        limits = httpx.Limits(max_connections=10)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            for _ in range(10):
                await asyncio.gather(*[one(c) for _ in range(10)])

    asyncio.run(main())
    stats = wait_idle(server)
    # 100 requests asked for 200 tokens each; aborted early, they made far fewer.
    assert stats["engine"]["generation_tokens_total"] < 100 * 200 / 2
    integrity = httpx.get(server.base_url + "/v1/debug/integrity").json()
    assert integrity["ok"], integrity


def test_metrics(server, client, model):
    client.completions.create(model=model, prompt=SYSTEM, max_tokens=2, **GREEDY)
    client.completions.create(model=model, prompt=SYSTEM, max_tokens=2, **GREEDY)
    text = httpx.get(server.base_url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    for name in (
        "prefixcache:prefix_cache_queries_total", "prefixcache:prefix_cache_hits_total",
        "prefixcache:prompt_tokens_total", "prefixcache:generation_tokens_total",
        "prefixcache:time_to_first_token_seconds_count",
        "prefixcache:time_per_output_token_seconds_count",
        "prefixcache:e2e_request_latency_seconds_count", "prefixcache:num_requests_running",
        "prefixcache:num_requests_waiting", "prefixcache:kv_cache_usage_perc",
        "prefixcache:prefix_cache_evicted_blocks_total", "prefixcache:num_preemptions_total",
    ):  # fmt: skip
        assert name in values, name
    assert values["prefixcache:prefix_cache_hits_total"] > 0
    assert values["prefixcache:time_to_first_token_seconds_count"] >= 2
    assert 0 <= values["prefixcache:kv_cache_usage_perc"] <= 1


def test_request_log(server, client, model):
    r = client.completions.create(model=model, prompt=SYSTEM + " Log me.", max_tokens=1)
    # The log is written by a background thread, after the answer: wait for the line.
    deadline = time.monotonic() + 30
    while True:
        lines = [json.loads(x) for x in server.request_log.read_text().splitlines()]
        if lines and lines[-1]["num_prompt_tokens"] == r.usage.prompt_tokens:
            break
        assert time.monotonic() < deadline, "the request was never logged"
        time.sleep(0.1)
    last = lines[-1]
    assert last["tenant"] == "default" and last["namespace"] == "default"
    assert last["num_prompt_tokens"] > 32 and len(last["block_hashes"]) >= 2
    assert "text" not in last


def test_a_web_page_cannot_drive_an_open_server(server, client, model):
    """CSRF and DNS rebinding (server/edge/origin.py): this server has no keys, so every caller is
    the admin. A page in the operator's browser can send a text/plain POST without a preflight,
    send a POST from its own Origin, or re-point its name at 127.0.0.1 (Host: its name). Each is
    refused before it reaches a route; the openai client is not affected."""
    base = server.base_url
    salt = {"cache_salt": "csrf"}
    prompt = list(range(2000, 2040))  # 40 tokens: 2 full blocks

    def cached() -> int:
        r = httpx.post(base + "/v1/cache/lookup", json={"prompt": prompt, **salt})
        assert r.status_code == 200, r.text
        return r.json()["num_cached_tokens"]

    def refused(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
        assert r.headers["x-request-id"]

    client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=salt)
    assert cached() == 32
    body = json.dumps(salt).encode()
    url = base + "/v1/cache/invalidate"
    # A "simple" cross-site request: no JSON content type (or none at all).
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "application/json; charset=latin-1"}, {}):  # fmt: skip
        r = httpx.post(url, content=body, headers=headers)
        refused(r, 415, "unsupported_media_type")
        assert "application/json" in r.json()["error"]["message"]
    # A JSON POST from another site's page (or a sandboxed one: Origin null).
    for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example:8000"):
        r = httpx.post(url, json=salt, headers={"origin": origin})
        refused(r, 403, "origin_not_allowed")
    # DNS rebinding: the page's own name in Host, on every route (GETs read data).
    for method, path in (("POST", "/v1/cache/invalidate"), ("GET", "/v1/cache/dashboard"),
                         ("GET", "/v1/cache/stats")):  # fmt: skip
        r = httpx.request(method, base + path, json=salt, headers={"host": "evil.example:8000"})
        refused(r, 403, "host_not_allowed")
        assert "--allowed-hosts" in r.json()["error"]["message"]
    assert cached() == 32  # nothing was invalidated

    # What stays allowed: the loopback names on any port, a page served from one of them, a
    # charset parameter, GETs without a content type, the openai client.
    for host in ("localhost:1234", "127.0.0.1", "[::1]:8000"):
        assert httpx.get(base + "/v1/cache/stats", headers={"host": host}).status_code == 200
    r = httpx.post(base + "/v1/cache/lookup", content=json.dumps({"prompt": prompt, **salt}),
                   headers={"content-type": "application/json; charset=UTF-8",
                            "origin": "http://localhost:5173"})  # fmt: skip
    assert r.status_code == 200 and r.json()["num_cached_tokens"] == 32, r.text
    assert httpx.get(base + "/dashboard/dashboard.js").status_code == 200
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, **GREEDY)  # fmt: skip
    assert c.choices[0].message.content is not None
    r = httpx.post(url, json=salt)
    assert r.status_code == 200 and r.json()["dropped_blocks"] == 2, r.text
    assert cached() == 0
