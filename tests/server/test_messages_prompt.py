"""Anthropic Messages requests as prompts (server/anthropic/prompt.py), tool calls read back from
the output (server/anthropic/tool_calls.py), the usage of cache breakpoints (server/anthropic/cache_breakpoints.py)
and Anthropic's error shape: no engine, the default model's tokenizer only."""

from __future__ import annotations

import copy
import json

import pytest

from prefixcache.server.anthropic.cache_breakpoints import lease_report, usage
from prefixcache.server.anthropic.errors import DIALECT
from prefixcache.server.anthropic.prompt import Breakpoint, MessagesRenderer
from prefixcache.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from prefixcache.server.anthropic.tool_calls import ToolCall, ToolCallReader, split_output
from prefixcache.server.base.auth import credential
from prefixcache.server.edge.errors import APIError
from prefixcache.tokenizer.tokenizer import load_tokenizer

SYSTEM = "You are the handbook assistant of the Example company. Answer in one short sentence."
TOOLS = [
    {"name": "get_weather", "description": "The weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "description": "The time in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
]  # fmt: skip
# A template that takes tools natively (the shape of Qwen2.5's, much shortened).
NATIVE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' or not tools %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def renderer(tok):
    return MessagesRenderer(tok)


def body(**fields) -> MessagesRequest:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi!"}]}
    return MessagesRequest.model_validate({**base, **fields})


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_plain_chat_renders_as_the_chat_completions_do(tok, renderer):
    req = body(system=SYSTEM, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a planet."}])  # fmt: skip
    want = tok.encode_chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Hi!"},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": "Name a planet."}])  # fmt: skip
    p = renderer.prompt(req)
    assert p.ids == want and p.breakpoints == ()
    # Thinking blocks of earlier turns are dropped, as Anthropic drops them.
    req2 = body(system=SYSTEM, messages=[
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Name a planet."}])  # fmt: skip
    assert renderer.prompt(req2).ids == want


def test_breakpoints_cover_their_block_and_nothing_after_it(tok, renderer):
    cc = {"type": "ephemeral"}
    req = body(
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "First part of the question.", "cache_control": cc},
            {"type": "text", "text": "Second part."}]}],
        cache_control=cc,
    )  # fmt: skip
    p = renderer.prompt(req)
    assert [(b.where, b.ttl) for b in p.breakpoints] == [
        ("system.0", "1h"), ("messages.0.content.0", "5m"), ("automatic", "5m")]
    system_only = tok.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert p.breakpoints[0].num_tokens == lcp(system_only, p.ids)
    assert tok.decode(p.ids[: p.breakpoints[0].num_tokens]).rstrip().endswith(SYSTEM)
    first = tok.decode(p.ids[: p.breakpoints[1].num_tokens])
    assert first.rstrip().endswith("First part of the question.") and "Second" not in first
    # Automatic: the whole conversation, without the generation prompt.
    whole = tok.encode_chat(
        [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "First part of the question.\nSecond part."}],
        add_generation_prompt=False,
    )  # fmt: skip
    assert p.ids[: len(whole)] == whole and p.breakpoints[2].num_tokens == len(whole)
    assert p.breakpoints[0].num_tokens < p.breakpoints[1].num_tokens < p.breakpoints[2].num_tokens


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"cache_control": {"type": "ephemeral"}, "system": [
            {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
            for i in range(4)]}, "maximum of 4"),
        ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                     {"type": "text", "text": "b",
                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}, '"1h" must come'),
        ({"system": [{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}]},
         "empty text"),
        ({"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Sure "}]}, "trailing whitespace"),
    ],
)  # fmt: skip
def test_refused_like_anthropic(renderer, fields, words):
    with pytest.raises(APIError) as e:
        renderer.prompt(body(**fields))
    assert e.value.status == 400 and words in e.value.message


def test_bad_ttl_or_media_or_forced_tools_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        body(system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}])
    for fields, param in [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages.0.content.0.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{**TOOLS[0], "type": "web_search_20250305"}]}, "tools.0.type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]},
         "messages.0.content.0"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as e:
            body(**fields).check_unsupported()
        assert e.value.status == 400 and e.value.param == param


def agent_turns():
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C",
             "cache_control": {"type": "ephemeral"}}]},
    ]  # fmt: skip


def test_tools_render_as_text_where_the_template_knows_none(tok, renderer):
    assert not renderer.native_tools  # the default model's template
    tools = [TOOLS[0], {**TOOLS[1], "cache_control": {"type": "ephemeral"}}]
    p = renderer.prompt(body(system=SYSTEM, tools=tools, messages=agent_turns()))
    text = tok.decode(p.ids, skip_special_tokens=False)
    # Tools first (in order), then the system text, in the system message.
    assert text.index('"name": "get_weather"') < text.index('"name": "get_time"') < text.index(SYSTEM)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    tools_bp, result_bp = p.breakpoints
    head = tok.decode(p.ids[: tools_bp.num_tokens])
    assert head.rstrip().endswith("}") and SYSTEM not in head and '"get_time"' in head
    assert tok.decode(p.ids[: result_bp.num_tokens]).rstrip().endswith("</tool_response>")
    # A count of tokens renders exactly the same prompt.
    count = CountTokensRequest.model_validate(
        {"model": "m", "system": SYSTEM, "tools": tools, "messages": agent_turns()})
    assert renderer.prompt(count).ids == p.ids


def test_tools_render_natively_where_the_template_takes_them(tok):
    native = copy.copy(tok)
    native.chat_template = NATIVE
    r = MessagesRenderer(native)
    assert r.native_tools
    p = r.prompt(body(system=SYSTEM, tools=TOOLS, messages=agent_turns()))
    text = native.decode(p.ids, skip_special_tokens=False)
    schema = json.dumps({"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": TOOLS[0]["input_schema"]}}, ensure_ascii=False)  # fmt: skip
    assert schema in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_final_assistant_message_is_continued(tok, renderer):
    p = renderer.prompt(body(messages=[{"role": "user", "content": "Pick A or B."},
                                       {"role": "assistant", "content": "The answer is ("}]))
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe answer is (")


def test_tool_calls_read_back_at_any_split():
    out = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
           '</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call> done <tool')
    whole = split_output(out, ["get_weather"])
    assert isinstance(whole[1], ToolCall) and whole[1].input == {"city": "Oslo"}
    assert whole[0] == "Checking."
    assert whole[2] == '<tool_call>{"name": "nope", "arguments": {}}</tool_call> done <tool'
    for step in (1, 2, 3, 7):
        r = ToolCallReader(["get_weather"])
        got = []
        for i in range(0, len(out), step):
            got += r.feed(out[i : i + step])
        got += r.finish()
        texts = "".join(x for x in got if isinstance(x, str))
        calls = [x for x in got if isinstance(x, ToolCall)]
        assert texts == whole[0] + whole[2] and [c.input for c in calls] == [{"city": "Oslo"}]
    # A call the output ends in without its closing tag still counts; broken JSON is text.
    assert isinstance(split_output('<tool_call>{"name": "get_weather", "arguments": {}}',
                                   ["get_weather"])[0], ToolCall)  # fmt: skip
    assert split_output("<tool_call>{oops", ["get_weather"]) == ["<tool_call>{oops"]


def test_a_whole_answer_of_many_tags_is_read_in_linear_work():
    """Issue #37: a non-streamed answer is fed whole, and each tag cut the rest of the buffer
    off with a copy (quadratic in the number of tags). The buffer is now cut once per feed:
    the characters the reader keeps, counted as assigned, stay a small multiple of the text."""
    kept = [0]

    class Counting(ToolCallReader):
        @property
        def _buf(self):
            return self.__dict__["buf"]

        @_buf.setter
        def _buf(self, value):
            kept[0] += len(value)
            self.__dict__["buf"] = value

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    out = ("x" + call) * 2000
    r = Counting(["get_weather"])
    got = r.feed(out) + r.finish()
    assert sum(isinstance(x, ToolCall) for x in got) == 2000 and "".join(
        x for x in got if isinstance(x, str)) == "x" * 2000  # fmt: skip
    assert kept[0] <= 2 * len(out), kept[0]  # (it was ~n^2 / 2: ~8e7 here)


def test_usage_adds_up_and_counts_every_cached_prefix_as_a_read():
    bps = (Breakpoint("system.0", "1h", 40), Breakpoint("automatic", "5m", 90))
    first = usage(100, 0, 5, bps, 16, True)
    assert first["cache_creation_input_tokens"] == 80  # up to 90, whole blocks
    assert first["cache_creation"] == {"ephemeral_1h_input_tokens": 32,
                                       "ephemeral_5m_input_tokens": 48}
    assert first["input_tokens"] + 80 == 100 and first["cache_read_input_tokens"] == 0
    again = usage(100, 96, 5, bps, 16, True)  # read past the last breakpoint: no creation
    assert (again["cache_read_input_tokens"], again["cache_creation_input_tokens"],
            again["input_tokens"]) == (96, 0, 4)  # fmt: skip
    no_bp = usage(100, 64, 5, (), 16, True)  # cached without a breakpoint: still a read
    assert (no_bp["cache_read_input_tokens"], no_bp["cache_creation_input_tokens"]) == (64, 0)
    assert usage(100, 0, 5, bps, 16, False)["cache_creation_input_tokens"] == 0
    report = lease_report(bps, None)
    assert [e["status"] for e in report] == ["rejected", "rejected"]


def test_errors_speak_anthropic_on_the_messages_routes():
    e = APIError(422, "max_tokens: field required", param="max_tokens")
    r = e.response_for("/v1/messages", [DIALECT])
    assert r.status_code == 400
    assert json.loads(r.body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: field required"}}
    slow = APIError(429, "slow down").response_for("/v1/messages/count_tokens", [DIALECT])
    assert json.loads(slow.body)["error"]["type"] == "rate_limit_error"
    openai = e.response_for("/v1/chat/completions", [DIALECT])
    assert openai.status_code == 422 and json.loads(openai.body)["error"]["param"] == "max_tokens"
    assert APIError(401, "x").response_for("/v1/messagesX", [DIALECT]).status_code == 401
    assert APIError(422, "x").response_for("/v1/messages").status_code == 422  # no dialect given


def test_x_api_key_is_a_bearer_key():
    assert credential({"x-api-key": "sk-a"}) == "Bearer sk-a"
    assert credential({"authorization": "Bearer sk-a"}) == "Bearer sk-a"
    assert credential({"x-api-key": "sk-a", "authorization": "Bearer sk-a"}) == "Bearer sk-a"
    with pytest.raises(APIError) as e:
        credential({"x-api-key": "sk-a", "authorization": "Bearer sk-b"})
    assert e.value.status == 401
