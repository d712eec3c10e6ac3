"""Property-based schema fuzz of every endpoint of a live `prefixcache serve` (hypothesis).

Bodies are drawn field by field from each endpoint's schema: mostly plausible values mixed with
the hostile ones (NaN and infinities, 1e-40 and 1e-300, integers past 64 bits, lone surrogates,
wrong types, nested garbage), plus raw bytes (broken JSON, NaN literals, 5,000-digit integers,
deep nesting, invalid UTF-8), random model ids and auth headers. The properties: no response is
a 5xx; every error, whether a 4xx body or an event inside a 200 stream, is in OpenAI's format;
a 200 stream carries no error event; afterwards the server is healthy, idle and consistent.

Examples are derandomized (the same every run) and the context is 64 tokens, so a request that
is valid runs a few short steps.
"""

from __future__ import annotations

import collections
import json
import math
import time
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

KEYS = {"keys": {"sk-a": "alice", "sk-ops": {"tenant": "ops", "admin": True}}}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # The fuzz sends refusals back to back on purpose: the refusal limit (refusals.py, tested
    # in test_cache_gate) would answer most of them 429 before their bodies are looked at, and
    # the cache-call rate (charged before a body is read: cache_gate.py) most of its cache calls,
    # and its bursts of 401s would cut its address off (refusals.PeerGuard).
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", "16MiB", "--max-model-len", "64",
            "--max-body-bytes", "256KiB", "--max-refusals-per-second", "1000000",
            "--max-cache-calls-per-second", "1000000",
            "--max-unauthenticated-per-second", "1000000"]  # fmt: skip
    with ServerProcess(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


# ---- values -------------------------------------------------------------------------------------
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
texts = st.one_of(st.text(max_size=30), surrogates, st.just(""), st.just("x" * 5000))
big_ints = st.sampled_from([-(2**63) - 1, -(2**63), -1, 2**31, 2**32, 2**63, 2**64, 10**30])
ints = st.one_of(st.integers(-3, 5), big_ints)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-40, 1e-300, 5e-324, 1e308, -0.0, 0.5, 1.0, 2.0]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
garbage = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def body(required: dict, optional: dict):
    """Bodies of the schema: well-typed ones whose values are edge cases (``required``/
    ``optional`` as given), or hostile ones where any field may be anything at all."""
    hostile = {k: st.one_of(v, garbage) for k, v in required.items()}
    hostile_opt = {k: st.one_of(v, garbage) for k, v in optional.items()}
    return st.one_of(
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries(hostile, optional=hostile_opt),
    )


def edge(plausible, *hostile):
    """Mostly ``plausible``; sometimes one of the well-typed hostile strategies."""
    return st.one_of(plausible, plausible, plausible, *hostile)


token_ids = st.lists(st.one_of(st.integers(0, 49151), ints), max_size=40)
good_ids = st.lists(st.integers(1, 49151), min_size=1, max_size=40)
good_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
prompts = edge(
    st.one_of(good_text, good_ids, st.lists(good_text, min_size=1, max_size=2)),
    texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3), big_ints,
)
roles = st.sampled_from(["system", "user", "assistant", "document", "tool", "wizard"])
messages = edge(
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": good_text}),
             min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": roles}, optional={
        "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": texts}), max_size=2)), "title": texts}),
        max_size=3),
)  # fmt: skip
sampling = {
    "max_tokens": edge(st.integers(1, 4), ints),
    "temperature": edge(st.floats(0, 2), floats),
    "top_p": edge(st.floats(0.01, 1), floats),
    "top_k": edge(st.integers(-1, 50), ints),
    "n": edge(st.integers(1, 3), ints),
    "seed": edge(st.integers(0, 2**32), ints),
    "stop": edge(st.lists(good_text, max_size=3), texts, st.lists(texts, max_size=20)),
    "stop_token_ids": edge(st.lists(st.integers(0, 49151), max_size=3), st.lists(ints, max_size=70)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "priority": edge(st.integers(-5, 5), ints),
    "cache_salt": edge(good_text, texts),
    "return_cache_info": st.booleans(),
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "gpt-9"]),
    "presence_penalty": edge(st.just(0.0), floats),
    "include_stop_str_in_output": st.booleans(),
}
completion = body(
    {"prompt": prompts, "max_tokens": sampling["max_tokens"]},
    {**{k: v for k, v in sampling.items() if k != "max_tokens"},
     "logprobs": edge(st.integers(0, 5), ints), "echo": edge(st.just(False), st.booleans()),
     "best_of": edge(st.just(1), ints), "suffix": edge(st.just(""), texts)},
)  # fmt: skip
chat = body(
    {"messages": messages, "max_tokens": sampling["max_tokens"]},
    {**{k: v for k, v in sampling.items() if k != "max_tokens"},
     "logprobs": st.booleans(), "top_logprobs": edge(st.integers(0, 5), ints),
     "max_completion_tokens": edge(st.integers(1, 4), ints),
     "add_generation_prompt": st.booleans()},
)  # fmt: skip
cache_query = body(
    {},
    {"prompt": prompts, "messages": messages, "cache_salt": sampling["cache_salt"],
     "pin": st.booleans(), "ttl_seconds": edge(st.floats(0.1, 60), floats),
     "add_generation_prompt": st.booleans(), "model": sampling["model"]},
)  # fmt: skip
invalidate = body(
    {}, {"namespace": edge(good_text, texts), "cache_salt": sampling["cache_salt"],
         "all": st.booleans()},
)  # fmt: skip
auth = st.sampled_from(["sk-a"] * 6 + ["sk-ops", "sk-nobody", None, "\x7f bad"])
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([
        b'{"prompt": "Hi", "temperature": NaN}', b'{"prompt": "Hi", "top_p": -Infinity}',
        b'{"prompt": "Hi", "max_tokens": ' + b"7" * 5000 + b"}",
        b"[" * 20_000 + b"]" * 20_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
        b'{"prompt": "\\ud800\\udc00\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        b"\xff\xfe{}", b'{"prompt": "Hi"', b"null", b"[]", b'"x"', b"{}", b" " * 300_000,
    ]),
)  # fmt: skip
post_paths = st.sampled_from([
    "/v1/completions", "/v1/chat/completions", "/v1/cache/warm", "/v1/cache/lookup",
    "/v1/cache/invalidate",
])  # fmt: skip


# ---- the properties -----------------------------------------------------------------------------
# path -> status -> count: printed at the end, to see that the fuzz reaches the engine too.
STATUSES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def check_error_body(body: dict) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"]


def send(http: httpx.Client, method: str, path: str, key: str | None, content: bytes | None):
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    with http.stream(method, path, content=content, headers=headers) as r:
        raw = r.read()
    STATUSES[path.split("?")[0] if not path.startswith("/v1/models/") else "/v1/models/*"][
        r.status_code
    ] += 1
    assert r.status_code < 500, (path, content[:300] if content else None, raw[:500])
    if r.status_code >= 400:
        check_error_body(json.loads(raw))
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
        errors = [e for e in events if "error" in e]
        for e in errors:
            check_error_body(e)
        assert not errors, (content[:300], errors)  # bad input is refused before the 200
    return r


def dumps(body) -> bytes:
    # Python's json writes NaN/Infinity literals, as a careless client would.
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@FUZZ
@given(body=completion, key=auth)
def test_completions(http, body, key):
    send(http, "POST", "/v1/completions", key, dumps(body))


@FUZZ
@given(body=chat, key=auth)
def test_chat_completions(http, body, key):
    send(http, "POST", "/v1/chat/completions", key, dumps(body))


@FUZZ
@given(body=cache_query, path=st.sampled_from(["/v1/cache/warm", "/v1/cache/lookup"]), key=auth)
def test_cache_warm_and_lookup(http, body, path, key):
    send(http, "POST", path, key, dumps(body))


@FUZZ
@given(body=invalidate, key=auth)
def test_cache_invalidate(http, body, key):
    send(http, "POST", "/v1/cache/invalidate", key, dumps(body))


@FUZZ
@given(raw=raw_bodies, path=post_paths, key=auth)
def test_raw_bodies(http, raw, path, key):
    send(http, "POST", path, key, raw)


@FUZZ
@given(
    path=st.one_of(
        st.sampled_from(["/v1/models", "/v1/cache/stats", "/health", "/version", "/metrics",
                         "/v1/debug/integrity", "/v1/completions", "/nothing",
                         "/v1/cache/dashboard", "/dashboard", "/dashboard/dashboard.js"]),
        st.one_of(st.text(max_size=20), surrogates)
        .map(lambda s: "/v1/models/" + quote(s.encode("utf-8", "surrogatepass"), safe="/")),
        st.one_of(st.text(max_size=20), surrogates)
        .map(lambda s: "/dashboard/" + quote(s.encode("utf-8", "surrogatepass"), safe="/")),
    ),
    key=auth,
)  # fmt: skip
def test_get_routes(http, path, key):
    send(http, "GET", path, key, None)


def test_the_server_is_healthy_idle_and_consistent_after(http):
    """Runs after the fuzz (module order)."""
    assert http.get("/health").json() == {"status": "ok"}
    admin = {"Authorization": "Bearer sk-ops"}
    deadline = time.monotonic() + 60
    while True:
        e = http.get("/v1/cache/stats", headers=admin).json()["engine"]
        if e["num_running"] == e["num_waiting"] == e["in_use_blocks"] == 0:
            break
        assert time.monotonic() < deadline, e
        time.sleep(0.1)
    assert http.get("/v1/debug/integrity", headers=admin).json()["ok"]
    assert math.isfinite(e["kv_cache_usage"])
    print({path: dict(c) for path, c in STATUSES.items()})
    # The fuzz is not all refusals: every generation endpoint also served requests.
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/cache/lookup"):
        assert STATUSES[path][200] > 0, dict(STATUSES[path])
