"""Why did this miss (server/base/comparison.py): a prompt compared with an earlier response's of the
same tenant: where they diverge (token, message, character) and whether the text or the chat
template changed; in OpenAI's and Anthropic's shapes; each tenant's store its own and bounded.

The last test runs the app in this process (a real engine) with the official ``openai`` and
``anthropic`` clients, and changes the model's chat template between two requests: the
comparison blames the template, not the text."""

from __future__ import annotations

import asyncio
import copy

import pytest
from _helpers import shared_default_weights

from prefixcache.server.anthropic.diagnostics import anthropic_diagnostics
from prefixcache.server.base.comparison import PromptRecord, ResponseStore, compare
from prefixcache.server.openai.diagnostics import openai_diagnostics
from prefixcache.tokenizer.tokenizer import load_tokenizer

SYSTEM = "You are the travel desk of the Example company. Answer in one sentence."
OTHER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} said:\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def record(tok, messages, template=None, **kw) -> tuple[PromptRecord, object]:
    t = tok
    if template is not None:
        t = copy.copy(tok)
        t.chat_template = template
    ids = t.encode_chat(messages)
    parts = [(f"messages.{i}", f"{m['role']}\n{m['content']}") for i, m in enumerate(messages)]
    fields = {"model": "m", "namespace": "alice", **kw}

    def render(k):
        return t.encode_chat(messages[:k], add_generation_prompt=False) if k else []

    return PromptRecord.of(ids, parts, fields["model"], fields["namespace"], fields.get("key")), render


def chat(system: str, *turns: str) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system}] + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def test_a_conversation_that_only_grows_does_not_diverge(tok):
    prev, _ = record(tok, chat(SYSTEM, "Can I fly business?"))
    cur, render = record(tok, chat(SYSTEM, "Can I fly business?", "No.", "Why not?"))
    c = compare(prev, cur, render)
    assert c.changed is None and c.diverged_at_token == len(prev.ids)
    assert openai_diagnostics(c, c.reusable(16), 16)["type"] == "cache_hit"
    assert anthropic_diagnostics(c, c.reusable(16), 16) is None
    # The same prompts, but less was read than they share: the prefix was evicted.
    evicted = anthropic_diagnostics(c, 0, 16)["cache_miss_reason"]
    assert (evicted["type"], evicted["cause"]) == ("unavailable", "evicted")
    assert evicted["cache_missed_input_tokens"] == c.reusable(16) > 0
    assert openai_diagnostics(c, 0, 16)["reason"] == "evicted"


def test_a_text_change_is_located_to_its_message_and_character(tok):
    prev, _ = record(tok, chat(SYSTEM, "Can I fly business?", "No.", "Why not?"))
    edited = SYSTEM.replace("one sentence", "two sentences")
    cur, render = record(tok, chat(edited, "Can I fly business?", "No.", "Why not?"))
    c = compare(prev, cur, render)
    assert (c.changed, c.cause, c.part, c.message_index) == ("prompt", "text", "messages.0", 0)
    assert c.content_offset == SYSTEM.index("one sentence")
    assert tok.decode(cur.ids[: c.diverged_at_token]).endswith(SYSTEM[: c.content_offset].rstrip())
    later, render = record(tok, chat(SYSTEM, "Can I fly business?", "Yes.", "Why?"))
    c = compare(prev, later, render)
    assert (c.part, c.cause, c.content_offset) == ("messages.2", "text", 0)
    body = openai_diagnostics(c, 16, 16)
    assert (body["type"], body["reason"], body["message_index"]) == ("cache_miss", "input_changed", 2)
    assert body["cache_missed_tokens"] == len(later.ids) - 16
    reason = anthropic_diagnostics(c, 16, 16)["cache_miss_reason"]
    assert reason["type"] == "messages_changed" and reason["cache_missed_input_tokens"] > 0


def test_a_template_change_is_told_from_a_text_change(tok):
    messages = chat(SYSTEM, "Can I fly business?")
    prev, _ = record(tok, messages, template=OTHER_TEMPLATE)
    cur, render = record(tok, messages)
    c = compare(prev, cur, render)
    assert (c.changed, c.cause, c.message_index) == ("prompt", "chat_template", 0)
    assert anthropic_diagnostics(c, 0, 16)["cache_miss_reason"]["cause"] == "chat_template"
    # Model, salt and key changes are named before any prompt difference.
    for field, changed in (("model", "model"), ("namespace", "cache_salt"), ("key", "prompt_cache_key")):
        other, render = record(tok, messages, **{field: "x"})
        assert compare(cur, other, render).changed == changed


def test_each_tenant_compares_with_its_own_responses_only_and_the_store_is_bounded(tok):
    store = ResponseStore(max_responses=3, max_tokens=10_000, max_chars=10_000)
    rec, _ = record(tok, chat(SYSTEM, "Hi"))
    store.put("alice", "chatcmpl-1", rec)
    assert store.get("alice", "chatcmpl-1") is rec
    assert store.get("bob", "chatcmpl-1") is None  # another tenant's id: not found
    for i in range(2, 5):
        store.put("alice", f"chatcmpl-{i}", rec)
    assert store.get("alice", "chatcmpl-1") is None  # the oldest went first
    big = PromptRecord.of([1] * 20_000, (), "m", "alice")
    store.put("alice", "huge", big)
    assert store.get("alice", "huge") is None
    # Every tenant's together are bounded too (issue #37): past it, the tenant holding the
    # most gives up its oldest; a tenant within its share keeps what it has.
    store = ResponseStore(max_responses=100, max_tokens=10_000, max_chars=10_000,
                          max_total_tokens=4 * len(rec.ids), max_total_chars=10**9)  # fmt: skip
    store.put("bob", "b1", rec)
    for i in range(20):  # a tenant remembering response after response
        store.put("alice", f"a{i}", rec)
    assert store.get("bob", "b1") is rec and store.total_tokens <= 4 * len(rec.ids)
    assert [store.get("alice", f"a{i}") is not None for i in range(17, 20)] == [True] * 3
    assert store.get("alice", "a16") is None
    assert openai_diagnostics(None, 0, 16) == {"type": "comparison_response_not_found"}
    assert anthropic_diagnostics(None, 0, 16) == {
        "cache_miss_reason": {"type": "previous_message_not_found"}}


@pytest.mark.slow
def test_the_clients_hear_why_through_their_own_fields():
    import anthropic
    import httpx
    import httpx2
    import openai

    from prefixcache.config import EngineConfig
    from prefixcache.engine.async_engine import AsyncEngine
    from prefixcache.server.app import create_app

    with shared_default_weights():
        engine = AsyncEngine(EngineConfig(kv_cache_memory="32MiB", max_model_len=512, seed=0))
    app = create_app(engine)
    tokenizer = engine.tokenizer
    original = tokenizer.chat_template

    async def main():
        await engine.start()
        oa = openai.AsyncOpenAI(api_key="x", base_url="http://127.0.0.1/v1", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
        an = anthropic.AsyncAnthropic(api_key="x", base_url="http://127.0.0.1", max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
        msgs = chat(SYSTEM, "Can I fly business to Oslo?")
        first = await oa.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs,
                                                 max_tokens=2, extra_body={"prompt_cache_options": {}})
        try:  # the operator changes the model's chat template between two requests
            tokenizer.chat_template = OTHER_TEMPLATE
            second = await oa.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=2,
                extra_body={"prompt_cache_options": {"comparison_response_id": first.id}})
        finally:
            tokenizer.chat_template = original
        diag = second.model_extra["prompt_cache_diagnostics"]
        assert (diag["type"], diag["reason"], diag["cause"]) == ("cache_miss", "input_changed",
                                                                 "chat_template")
        other = await oa.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=chat(SYSTEM + " Be kind.", "Can I fly business to Oslo?"),
            max_tokens=2, extra_body={"prompt_cache_options": {"comparison_response_id": first.id}})
        diag = other.model_extra["prompt_cache_diagnostics"]
        assert (diag["cause"], diag["message_index"], diag["content_offset"]) == ("text", 0, len(SYSTEM))
        # Anthropic's field on /v1/messages: opt in with null, then name that message.
        a1 = await an.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, system=SYSTEM,
                                      messages=[{"role": "user", "content": "Hi"}],
                                      diagnostics={"previous_message_id": None})
        assert a1.diagnostics is None
        a2 = await an.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, system=SYSTEM + " Hi.",
                                      messages=[{"role": "user", "content": "Hi"}],
                                      diagnostics={"previous_message_id": a1.id})
        reason = a2.diagnostics.cache_miss_reason
        assert reason.type == "system_changed" and reason.model_extra["content_offset"] == len(SYSTEM)
        a3 = await an.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2, system=SYSTEM,
                                      messages=[{"role": "user", "content": "Hi"}],
                                      diagnostics={"previous_message_id": "msg_nope"})
        assert a3.diagnostics.cache_miss_reason.type == "previous_message_not_found"
        await engine.shutdown(drain=False)

    asyncio.run(main())
