"""Load and shutdown of `prefixcache serve`: a full queue answers 429 with Retry-After, caching
can be switched off, SIGTERM lets a running stream finish before the process exits.

One live server (one running sequence, one waiting slot, prefix caching off); the SIGTERM test
stops it, so it runs last.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    args = ["--no-enable-prefix-caching", "--max-num-seqs", "1", "--max-waiting-requests", "1",
            "--kv-cache-memory", "32MiB"]  # fmt: skip
    with ServerProcess(args) as srv:
        yield srv


def test_caching_disabled(server):
    body = {"prompt": list(range(2000, 2040)), "max_tokens": 1, "return_cache_info": True}
    for _ in range(2):
        r = httpx.post(server.base_url + "/v1/completions", json=body).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r["choices"][0]["cache_info"]["reason"] == "caching_disabled"
    lookup = httpx.post(server.base_url + "/v1/cache/lookup", json={"prompt": body["prompt"]})
    assert lookup.json()["num_cached_tokens"] == 0


def test_full_queue_is_429_with_retry_after(server):
    body = {"prompt": "Count slowly:", "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(6)])

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"].isdigit()
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 12
    # The refused requests disturbed nobody: the server still serves.
    ok = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 1})
    assert ok.status_code == 200


def test_sigterm_drains_running_stream(server):
    body = {"prompt": "Count slowly:", "max_tokens": 16, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, signalled = [], False
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append(None)
                break
            chunks.append(json.loads(line[6:]))
            if not signalled:
                server.terminate()  # the server stops listening but finishes this stream
                signalled = True
    assert chunks[-1] is None, "the stream was cut off"
    assert chunks[-2]["usage"]["completion_tokens"] == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]][-1] == "length"
    # uvicorn re-raises the SIGTERM after its graceful shutdown: rc 0 or -SIGTERM.
    assert server.wait(timeout=60) in (0, -15)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health")
