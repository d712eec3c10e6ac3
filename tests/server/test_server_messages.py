"""``POST /v1/messages`` (Anthropic's Messages API) on a live `prefixcache serve`, with the
official ``anthropic`` client: answers, stop reasons, errors and the event stream as Anthropic
sends them; cache breakpoints that create then read with exact usage and change no output;
tenants that learn nothing of each other's prompts through hits, usage or leases; a
breakpoint under a shared salt declaring the public prefix; tools through the chat template.

One server (module scope) with three keys and a shared namespace. Greedy sampling
(``temperature`` 0, which this client version passes through ``extra_body``).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from prefixcache.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"keys": {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": {"tenant": "ops", "admin": True}},
        "shared_namespaces": ["public"]}  # fmt: skip
SYSTEM = ("You are the handbook assistant of the Example company. Answer every question about "
          "holidays, expenses and travel in one short sentence, and name the section of the "
          "handbook the answer comes from.")  # fmt: skip
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--api-keys-file", str(keys), "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
    with ServerProcess(args) as srv:
        yield srv


def client(server, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=server.base_url, max_retries=0)


def system(text: str = SYSTEM, ttl: str | None = "5m") -> list[dict]:
    block = {"type": "text", "text": text}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return [block]


def ask(c, user: str, max_tokens: int = 8, **kw):
    extra = {**GREEDY, **kw.pop("extra_body", {})}
    kw.setdefault("system", system())
    return c.messages.create(model=MODEL, max_tokens=max_tokens, extra_body=extra,
                             messages=[{"role": "user", "content": user}], **kw)  # fmt: skip


def text_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def prompt_tokens(u) -> int:
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def test_answers_stop_reasons_and_errors_like_anthropic(server):
    alice = client(server, "sk-alice")
    m = ask(alice, "Name a planet.", max_tokens=12, extra_body={"cache_salt": "basics"})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    count = alice.messages.count_tokens(model=MODEL, system=system(),
                                        messages=[{"role": "user", "content": "Name a planet."}])
    assert prompt_tokens(m.usage) == count.input_tokens and m.usage.output_tokens >= 1
    text = text_of(m)
    # A stop sequence from the middle of the greedy answer stops it there.
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    s = ask(alice, "Name a planet.", max_tokens=12, stop_sequences=[stop],
            extra_body={"cache_salt": "basics"})  # fmt: skip
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", stop)
    assert text_of(s) == text[: text.index(stop)]
    assert ask(alice, "Name a planet.", max_tokens=1).stop_reason == "max_tokens"
    # Errors: Anthropic's shape and status, through the official client's exception classes.
    with pytest.raises(anthropic.NotFoundError) as e:
        alice.messages.create(model="claude-nope", max_tokens=4,
                              messages=[{"role": "user", "content": "x"}])  # fmt: skip
    assert e.value.body["error"]["type"] == "not_found_error"
    for bad in ({"messages": []}, {"max_tokens": 0}, {"extra_body": {"top_k": -1}},
                {"extra_body": {"temperature": 1.5}},
                {"system": [{"type": "text", "text": f"{i}", "cache_control": {"type": "ephemeral"}}
                            for i in range(5)]}):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as e:
            alice.messages.create(**{"model": MODEL, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "x"}], **bad})
        assert e.value.status_code == 400 and e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "sk-nobody").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "incorrect API key provided"}}


def test_x_api_key_version_header_and_a_body_missing_max_tokens(server):
    url = server.base_url + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
            "temperature": 0}  # fmt: skip
    for headers in ({"x-api-key": "sk-bob"}, {"Authorization": "Bearer sk-bob"},
                    {"x-api-key": "sk-bob", "anthropic-version": "2023-06-01"}):  # fmt: skip
        r = httpx.post(url, json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
    r = httpx.post(url, json=body, headers={"x-api-key": "sk-bob", "anthropic-version": "v1"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json=body, headers={"x-api-key": "sk-bob", "authorization": "Bearer sk-alice"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json={k: v for k, v in body.items() if k != "max_tokens"},
                   headers={"x-api-key": "sk-bob"})  # fmt: skip
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{", headers={"x-api-key": "sk-bob", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_the_stream_is_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0,
            "system": SYSTEM, "messages": [{"role": "user", "content": "Name a color."}]}  # fmt: skip
    events = []
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body,
                      headers={"x-api-key": "sk-bob"}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(data)
    names = [e["type"] for e in events]
    k = names.count("content_block_delta")
    assert k >= 1 and names == ["message_start", "content_block_start", "ping"] + [
        "content_block_delta"] * k + ["content_block_stop", "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] == 6 or delta["delta"]["stop_reason"] == "end_turn"
    # The official client's stream helper and a non-streamed answer agree with it.
    bob = client(server, "sk-bob")
    with bob.messages.stream(model=MODEL, max_tokens=6, system=SYSTEM, extra_body=GREEDY,
                             messages=[{"role": "user", "content": "Name a color."}]) as s:
        final = s.get_final_message()
    whole = ask(bob, "Name a color.", max_tokens=6, system=SYSTEM)
    assert text_of(final) == streamed == text_of(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_breakpoints_create_then_read_and_never_change_outputs(server):
    alice = client(server, "sk-alice")
    salt = {"cache_salt": "bp"}
    first = ask(alice, "How many vacation days do I get?", extra_body=salt)
    lease = first.model_extra["cache_leases"][0]
    held = lease["cached_tokens"]
    assert lease["status"] == "accepted" and held == lease["prompt_tokens"] // 16 * 16 >= 32
    u = first.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (0, held)
    assert u.cache_creation.ephemeral_5m_input_tokens == held
    total = prompt_tokens(u)
    # Another question after the same system prompt reads the breakpoint's prefix.
    second = ask(alice, "Can I carry days over to next year?", extra_body=salt)
    v = second.usage
    # (and, token-exactly, the template's tokens after it that her first question's block holds)
    assert held <= v.cache_read_input_tokens < held + 16 and v.cache_creation_input_tokens == 0
    # A 1-hour breakpoint is reported as such; the read needs no breakpoint at all.
    third = ask(alice, "Who approves travel?", system=system(ttl=None), extra_body=salt)
    assert held <= third.usage.cache_read_input_tokens < held + 16  # no breakpoint: a read
    assert "cache_leases" not in (third.model_extra or {})
    # cold == warm: the same request without breakpoints, in a fresh salt (nothing cached),
    # says the same tokens as the one with them, served from the cache.
    cold = ask(alice, "Can I carry days over to next year?", system=system(ttl=None),
               extra_body={"cache_salt": "bp-cold"})  # fmt: skip
    assert cold.usage.cache_read_input_tokens == 0
    assert text_of(cold) == text_of(second) and cold.usage.output_tokens == v.output_tokens
    assert prompt_tokens(cold.usage) == prompt_tokens(v) and total > held


def test_tenants_learn_nothing_from_each_others_breakpoints(server):
    alice, bob = client(server, "sk-alice"), client(server, "sk-bob")
    secret = SYSTEM + " The merger with Initech closes on May 3."
    mine = ask(alice, "When does it close?", system=system(secret), extra_body={"cache_salt": "s"},
               diagnostics={"previous_message_id": None})  # fmt: skip
    assert mine.model_extra["cache_leases"][0]["status"] == "accepted" and mine.diagnostics is None
    theirs = ask(bob, "When does it close?", system=system(secret), extra_body={"cache_salt": "s"},
                 diagnostics={"previous_message_id": mine.id})  # fmt: skip
    # Naming alice's message gets bob what a made-up id gets him.
    assert theirs.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    again = ask(alice, "When does it close, exactly?", system=system(secret),
                extra_body={"cache_salt": "s"}, diagnostics={"previous_message_id": mine.id})
    reason = again.diagnostics.cache_miss_reason
    assert reason.type == "messages_changed" and reason.model_extra["message_index"] == 0
    assert reason.model_extra["content_offset"] == len("When does it close")
    # Bob's identical request reads nothing of alice's and his lease is his own, granted the
    # same way: no figure of his answer depends on what alice sent.
    assert theirs.usage.cache_read_input_tokens == 0
    assert theirs.usage.cache_creation_input_tokens == mine.usage.cache_creation_input_tokens
    assert theirs.model_extra["cache_leases"] == mine.model_extra["cache_leases"]


def test_a_breakpoint_under_a_shared_salt_declares_the_public_prefix(server):
    alice, bob = client(server, "sk-alice"), client(server, "sk-bob")
    public = {"cache_salt": "public"}
    a = ask(alice, "My badge number is 4471. Is it valid?", extra_body=public)
    shared = a.model_extra["cache_leases"][0]["cached_tokens"]
    assert shared >= 32
    b = ask(bob, "How many vacation days do I get?", extra_body=public)
    assert b.usage.cache_read_input_tokens == shared  # the system prompt, computed once
    # Alice's question and answer stayed hers: bob replaying it reads the public part only.
    replay = ask(bob, "My badge number is 4471. Is it valid?", extra_body=public)
    # (plus, token-exactly, the template tokens his own first question's block holds: < a block)
    assert shared <= replay.usage.cache_read_input_tokens < shared + 16
    assert ask(alice, "My badge number is 4471. Is it valid?",
               extra_body=public).usage.cache_read_input_tokens > shared  # fmt: skip


def test_tools_tool_use_and_tool_results_through_the_template(server):
    bob = client(server, "sk-bob")
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]},
              "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny, 21 C"}]},
    ]  # fmt: skip
    with_tools = bob.messages.count_tokens(model=MODEL, tools=tools, messages=turns)
    without = bob.messages.count_tokens(model=MODEL, messages=turns[:1])
    assert with_tools.input_tokens > without.input_tokens + 40
    m = bob.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=turns,
                            extra_body={**GREEDY, "cache_salt": "tools"})  # fmt: skip
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert m.model_extra["cache_leases"][0]["breakpoint"] == "tools.0"
    again = bob.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=turns[:1],
                                extra_body={**GREEDY, "cache_salt": "tools"})  # fmt: skip
    assert again.usage.cache_read_input_tokens >= m.model_extra["cache_leases"][0]["cached_tokens"]
    with pytest.raises(anthropic.BadRequestError):
        bob.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])


BAD_BODIES = [
    {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": [{"type": "image"}]}]}]},
    {"messages": [{"role": "system", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": []}]},
    {"system": [{"type": "image", "source": {}}]},
    {"system": 7},
    {"tools": [{"name": "bad name!", "input_schema": {}}]},
    {"tools": [{"name": "t", "input_schema": []}]},
    {"tools": [{"name": "t", "input_schema": {}}] * 200},
    {"tool_choice": {"type": "tool", "name": "t"}},
    {"max_tokens": 10**9},
    {"max_tokens": "many"},
    {"stop_sequences": [""]},
    {"stop_sequences": ["x" * 1000]},
    {"top_p": 0},
    {"temperature": -1},
    {"priority": 2**40},
    {"metadata": {"user_id": "u" * 1000}},
    {"cache_control": {"type": "persistent"}},
    {"diagnostics": {"previous_message_id": ""}},
    {"messages": [{"role": "user", "content": "x" * (1024 * 81 + 1)}]},
]


def test_bad_input_is_a_4xx_in_anthropics_shape_never_a_5xx(server):
    for extra in BAD_BODIES:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                **extra}  # fmt: skip
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(server.base_url + path, json=body, headers={"x-api-key": "sk-ops"},
                           timeout=120)  # fmt: skip
            if path.endswith("count_tokens") and r.status_code == 200:
                continue  # a field only a message checks (max_tokens, sampling)
            assert 400 <= r.status_code < 500, (extra, path, r.text)
            assert r.json()["type"] == "error", r.text
