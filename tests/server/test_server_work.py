"""What the server does on its event loop per generated token, counted (never timed), and the
bytes it answers with: the app in this process on a real engine (default model), driven by the
official `openai` client over httpx's ASGI transport.

- logprobs name tokens from a table built once, not with tokenizer calls per token: the
  decodes a request makes do not grow with its length;
- a streamed chunk's work (Python instructions executed) does not grow with its index;
- a big non-streamed body is built in a worker thread, byte for byte what JSONResponse writes;
- streamed and non-streamed answers carry the same text and logprobs;
- a chat whose document titles/names cannot fit the context is refused untokenized (400).
"""

from __future__ import annotations

import asyncio
import sys
import threading

import httpx
import openai
import pytest
from _helpers import shared_default_weights
from fastapi.responses import JSONResponse

from prefixcache.config import EngineConfig
from prefixcache.engine.async_engine import AsyncEngine
from prefixcache.server.app import create_app
from prefixcache.server.openai import completions

PROMPT = "The capital of France is Paris. The capital of Germany is"
SHORT, LONG = 4, 24  # tokens generated
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MODEL = "SmolLM2-135M-Instruct"  # the default model's served name


@pytest.fixture(scope="module")
def app():
    config = EngineConfig(kv_cache_memory="32MiB", max_model_len=512, seed=0)
    with shared_default_weights():
        engine = AsyncEngine(config)
    app = create_app(engine)
    yield app
    asyncio.run(engine.shutdown(drain=False))


class CountingTokenizer:
    """The real tokenizer; counts the calls that decode token ids."""

    def __init__(self, real) -> None:
        self.real = real
        self.decodes = 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.real.decode(*args, **kwargs)

    def decode_each(self, *args, **kwargs):
        self.decodes += 1
        return self.real.decode_each(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _serve(app, test) -> None:
    """Run ``test(client)`` against the app on a started engine, in this thread's event loop."""

    async def main():
        await app.state.serving.engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0
            )
            await test(client)

    asyncio.run(main())


async def _stream_completion(client, max_tokens: int, logprobs: int | None):
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, logprobs=logprobs, stream=True, **GREEDY
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks)
    if logprobs is None:
        return text, None
    lps = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for c in chunks:
        if c.choices[0].logprobs is not None:
            for k in lps:
                lps[k] += getattr(c.choices[0].logprobs, k)
    return text, lps


def test_logprobs_cost_no_tokenizer_call_per_token_and_stream_equals_plain(app, monkeypatch):
    serving = app.state.serving
    counting = CountingTokenizer(serving.tokenizer)

    async def test(client):
        texts = await serving.token_texts()  # the table: once per process
        real = counting.real
        assert len(texts) >= serving.engine.vocab_size
        assert texts == [real.decode([i]) for i in range(len(texts))]  # the names of before
        monkeypatch.setattr(serving, "tokenizer", counting)
        decodes = []
        for n in (SHORT, LONG):
            before = counting.decodes
            text, lps = await _stream_completion(client, n, 5)
            decodes.append(counting.decodes - before)
            assert len(lps["tokens"]) == n
        # Decoding is per request at most, not per token (it was 1 + top_logprobs per token).
        assert decodes[1] <= decodes[0], decodes

        plain = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=LONG, logprobs=5, **GREEDY
        )
        assert plain.choices[0].text == text
        assert plain.choices[0].logprobs.model_dump() == lps

        msgs = [{"role": "user", "content": PROMPT}]
        kw = {"model": MODEL, "messages": msgs, "max_tokens": LONG, "logprobs": True,
              "top_logprobs": 5, **GREEDY}  # fmt: skip
        before = counting.decodes
        stream = await client.chat.completions.create(stream=True, **kw)
        chunks = [c async for c in stream]
        assert counting.decodes == before
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e.model_dump() for c in chunks if c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
        whole = (await client.chat.completions.create(**kw)).choices[0]
        assert whole.message.content == content and len(entries) == LONG
        assert [e.model_dump() for e in whole.logprobs.content] == entries

    _serve(app, test)


def _opcodes(fn, *args):
    """``fn(*args)`` and the number of Python instructions it executed (nested calls too)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args), count
    finally:
        sys.settrace(previous)


def test_a_streamed_chunk_costs_the_same_whatever_its_index(app, monkeypatch):
    counts = []
    real = completions._CompletionFormat.chunk

    def counted(self, c, d):
        out, n = _opcodes(real, self, c, d)
        counts.append(n)
        return out

    monkeypatch.setattr(completions._CompletionFormat, "chunk", counted)

    async def test(client):
        text, _ = await _stream_completion(client, LONG, None)
        assert text

    _serve(app, test)
    assert len(counts) == LONG
    # Every chunk but the last (it says why the stream finished) runs the same instructions;
    # summing the earlier chunks' text for the offset added a few per earlier chunk.
    assert len(set(counts[:-1])) == 1, counts


def test_a_big_plain_body_is_built_off_the_loop_as_jsonresponse_writes_it(app, monkeypatch):
    built = []  # (on the event loop's thread?, the body)
    real = completions._Format.response

    def recorded(self):
        body = real(self)
        built.append((threading.current_thread() is threading.main_thread(), body))
        return body

    monkeypatch.setattr(completions._Format, "response", recorded)
    monkeypatch.setattr(completions, "OFF_LOOP_ENTRIES", 64)

    async def test(client):
        small = await client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=SHORT, **GREEDY
        )
        # 3 choices x 4 tokens x (2 + 5) entries = 84 > 64: built in a worker thread.
        big = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=SHORT, n=3,
            logprobs=True, top_logprobs=5, **GREEDY,
        )  # fmt: skip
        assert [on_loop for on_loop, _ in built] == [True, False]
        for raw, (_, body) in zip((small, big), built, strict=True):
            assert raw.http_response.content == JSONResponse(body).body
            assert raw.headers["content-type"] == "application/json"
        assert len(big.parse().choices) == 3

    _serve(app, test)


def test_document_titles_and_names_count_toward_the_context(app):
    longest = app.state.serving.max_token_chars
    too_long = 512 * longest + 1  # characters no tokenization of which fits 512 tokens

    async def test(client):
        half = "x" * (too_long // 2 + 1)
        for docs in ([{"title": half}, {"title": half}], [{"name": half}, {"title": half}]):
            msgs = [{"role": "document", "content": "", **d} for d in docs]
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model=MODEL, messages=[*msgs, {"role": "user", "content": "Hi"}], max_tokens=1
                )
            # Refused from its length alone, before it is tokenized.
            assert e.value.code == "context_length_exceeded" and "characters" in e.value.message
        ok = await client.chat.completions.create(
            model=MODEL, max_tokens=1,
            messages=[{"role": "document", "title": "Capitals", "content": PROMPT},
                      {"role": "user", "content": "Which?"}],
        )  # fmt: skip
        assert ok.choices[0].finish_reason == "length"

    _serve(app, test)
