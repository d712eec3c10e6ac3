"""``POST /v1/completions`` and ``POST /v1/chat/completions``, plain and streamed (SSE).

Both routes share one path: authenticate, parse, derive the namespace, tokenize, start a
:class:`~prefixcache.server.base.run.Run`, then either stream its deltas as server-sent events or
collect them into one JSON body. Only the shape of a choice differs, and that lives in the two
small formatter classes at the bottom.

The event loop serves every tenant's streams, so what it does per generated token is bounded
by a constant: a chunk costs its own tokens only (the text offset is a running total, never a
sum over earlier chunks), and a token of logprobs costs list lookups in the process's table of
token texts (``Serving.token_texts``), not a tokenizer call per alternative. A big non-streamed
body is built and serialized in a worker thread, in pieces that each hold the GIL briefly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.api.request import StreamDelta
from prefixcache.server.base.comparison import PromptRecord
from prefixcache.server.base.run import Choice, Run
from prefixcache.server.base.serving import Serving, accept
from prefixcache.server.edge.errors import (
    APIError,
    from_engine_error,
    internal_error,
    request_id_of,
)
from prefixcache.server.edge.http import TimedStreamingResponse
from prefixcache.server.openai.diagnostics import openai_diagnostics
from prefixcache.server.openai.prompt import (
    chat_prefix,
    chat_prompt,
    check_generation_limits,
    completion_prompts,
    num_prompts,
    sampling_params,
    segment_request,
)
from prefixcache.server.openai.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("prefixcache.server")
router = APIRouter()

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
# A non-streamed body of more entries than this (a token, or one of its top logprobs) is built
# and serialized in a worker thread (about a millisecond of work on the loop at most; a thread
# hop for every small response would cost more than it saves).
OFF_LOOP_ENTRIES = 512
# Items of a long list that one call of the C JSON encoder writes: the worker thread building a
# big body lets go of the GIL between such pieces, so the event loop is never held for long.
_JSON_PIECE = 64


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    # A raw prompt declares nothing shared: with a shared salt it is cached in the tenant's own
    # part only (a prompt has no marked system part, and its output is never shared).
    s, tenant, req, scope = await accept(request, CompletionRequest)
    req.check_unsupported()
    check_generation_limits(s, req, req.logprobs)
    s.check_admission(tenant, num_prompts(s, req.prompt) * req.n)  # 429 before tokenizing
    prompts = await completion_prompts(s, req)
    params = [
        sampling_params(
            s, req, len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs
        )
        for ids in prompts
    ]
    texts = None if req.logprobs is None else await s.token_texts()
    record = diagnosis = None
    if req.prompt_cache_options is not None:  # remembered, and maybe compared (base/comparison.py)
        record = PromptRecord.of(prompts[0], (), req.model or s.model_name, scope.namespace,
                                 req.prompt_cache_key)  # fmt: skip
        diagnosis = await _diagnosis(s, tenant, req, record, None)
    run = s.start(
        "cmpl", prompts, params, req.n, tenant, scope.namespace, req.priority,
        req.return_cache_info, retention=req.prompt_cache_retention,
        prompt_cache_key=req.prompt_cache_key, retention_priority=s.retention_priority(req),
    )  # fmt: skip
    fmt = _CompletionFormat(s, run, req.logprobs, texts)
    _keep(s, tenant, run, req, record, diagnosis, fmt)
    return await _respond(request, run, fmt, req.stream, req.include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    s, tenant, req, scope = await accept(request, ChatCompletionRequest)
    req.check_unsupported()
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    check_generation_limits(s, req, k)
    s.check_admission(tenant, req.n)  # 429 before the chat is rendered
    seg = req.cache_mode == "segments"
    # With a shared salt, the leading system/developer messages are the declared shared prefix.
    chat = await chat_prompt(s, req.messages, req.add_generation_prompt, segments=seg,
                             system_prefix=scope.shared is not None)  # fmt: skip
    ids = chat.ids
    segments = segment_request(req, chat.spans) if seg else None
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    params = sampling_params(s, req, len(ids), max_tokens, None, k)
    texts = None if k is None else await s.token_texts()
    record = diagnosis = None
    if req.prompt_cache_options is not None:  # remembered, and maybe compared (base/comparison.py)
        dicts = [m.as_template_dict() for m in req.messages]
        parts = [(f"messages.{i}", f"{d['role']}\n{d['content']}") for i, d in enumerate(dicts)]
        record = PromptRecord.of(ids, parts, req.model or s.model_name, scope.namespace,
                                 req.prompt_cache_key)  # fmt: skip
        diagnosis = await _diagnosis(s, tenant, req, record, chat_prefix(s, dicts))
    run = s.start(
        "chatcmpl", [ids], [params], req.n, tenant, scope.namespace, req.priority,
        req.return_cache_info, segments, scope.prefix(chat.system_tokens),
        retention=req.prompt_cache_retention, prompt_cache_key=req.prompt_cache_key,
        retention_priority=s.retention_priority(req),
    )  # fmt: skip
    fmt = _ChatFormat(s, run, k, texts)
    _keep(s, tenant, run, req, record, diagnosis, fmt)
    return await _respond(request, run, fmt, req.stream, req.include_usage)


async def _diagnosis(s: Serving, tenant, req, record: PromptRecord, render_prefix):
    """With ``prompt_cache_options.comparison_response_id``: this prompt compared with that
    earlier response's (base/comparison.py); a tuple, so that "not found" (None) is an answer."""
    opts = req.prompt_cache_options
    if opts.comparison_response_id is None:
        return None
    return (await s.compare_with(tenant, opts.comparison_response_id, record, render_prefix),)


def _keep(s: Serving, tenant, run: Run, req, record: PromptRecord | None, diagnosis, fmt) -> None:
    """A request with ``prompt_cache_options`` is remembered for later comparisons."""
    if record is not None:
        s.responses.put(tenant.name, run.id, record)
    fmt.diagnosis = diagnosis


async def _respond(request: Request, run: Run, fmt, stream: bool, include_usage: bool) -> Response:
    rid = request_id_of(request.scope)
    if stream:
        return TimedStreamingResponse(
            _sse(run, fmt, include_usage, rid),
            send_timeout=run.serving.limits.send_timeout,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        if not await run.collect_while_connected(request):
            return Response(status_code=499)  # nobody reads it; the finally aborts the run
        if fmt.num_entries() <= OFF_LOOP_ENTRIES:
            return JSONResponse(fmt.response())
        body = await asyncio.to_thread(_render, fmt)
        return Response(body, media_type=JSONResponse.media_type)
    finally:
        run.close()


def _render(fmt) -> bytes:
    """The whole body (worker thread): the bytes ``JSONResponse`` writes, built in pieces."""
    out: list[str] = []
    _json_pieces(fmt.response(), out, 0)
    return "".join(out).encode("utf-8")


_dumps = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":")
).encode  # JSONResponse's options: pieces joined are byte for byte its text of the whole


def _json_pieces(obj, out: list[str], depth: int) -> None:
    """Append the JSON text of ``obj`` to ``out``. A body holds its bulk four levels down
    (``choices[i].logprobs.content``, ``.top_logprobs``, ...): dicts and lists above that are
    written item by item, lists at that depth ``_JSON_PIECE`` items per encoder call, and
    anything else (a text, one token's entry; a dict with keys json.dumps would convert) in
    one call."""
    if depth < 4 and isinstance(obj, dict) and all(type(k) is str for k in obj):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(key) + ":")
            _json_pieces(value, out, depth + 1)
        out.append("}")
    elif depth < 4 and isinstance(obj, list):
        out.append("[")
        for i, value in enumerate(obj):
            if i:
                out.append(",")
            _json_pieces(value, out, depth + 1)
        out.append("]")
    elif isinstance(obj, list) and len(obj) > _JSON_PIECE:
        out.append("[")
        for i in range(0, len(obj), _JSON_PIECE):
            out.append(("," if i else "") + _dumps(obj[i : i + _JSON_PIECE])[1:-1])
        out.append("]")
    else:
        out.append(_dumps(obj))


def _event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(run: Run, fmt, include_usage: bool, request_id: str | None):
    """Server-sent events; ``run.close()`` in ``finally`` aborts the run if the client leaves
    (Starlette cancels this generator when it sees the disconnect). An error after the 200 was
    sent is one error event in OpenAI's format, then ``[DONE]``."""
    try:
        for c in run.choices:
            first = fmt.first_chunk(c)
            if first is not None:
                yield _event(fmt.with_usage_field(first, include_usage))
        diagnose = fmt.diagnosis is not None  # with the first delta: what was cached is known
        async for c, d in run.deltas():
            if not (d.text_delta or d.new_token_ids or d.finished or _explains(d)):
                continue
            chunk = fmt.chunk(c, d)
            if diagnose:
                diagnose = False
                chunk["prompt_cache_diagnostics"] = fmt.diagnostics(c.cache.num_cached_tokens)
            yield _event(fmt.with_usage_field(chunk, include_usage))
        if include_usage:
            yield _event(fmt.envelope([], usage=run.usage()))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the 200 is sent: the error is an event
        err = from_engine_error(e, request_id) or internal_error(request_id, e)
        yield _event(err.body())
        yield "data: [DONE]\n\n"
    finally:
        run.close()


def _lp(x: float | None) -> float:
    # JSON has no -inf; vLLM clamps the same way.
    if x is None or math.isnan(x):
        return -9999.0
    return max(x, -9999.0)


class _Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, s: Serving, run: Run, top_k: int | None, texts: list[str] | None = None
    ) -> None:
        self.s = s
        self.run = run
        self.top_k = top_k  # None: no logprobs; else the number of alternatives per token
        self._texts = texts  # with logprobs: Serving.token_texts(), each id's text alone
        # (Comparison | None,) when the request asked for one (base/comparison.py), else None.
        self.diagnosis: tuple | None = None

    def diagnostics(self, cached_tokens: int) -> dict:
        """``prompt_cache_diagnostics``: what the comparison with the named response found."""
        return openai_diagnostics(self.diagnosis[0], cached_tokens, self.s.engine.config.block_size)

    def envelope(self, choices: list, usage: dict | None = None, chunk: bool = True) -> dict:
        body = {
            "id": self.run.id,
            "object": self.chunk_object_name if chunk else self.object_name,
            "created": self.run.created,
            "model": self.s.model_name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def with_usage_field(self, body: dict, include_usage: bool) -> dict:
        if include_usage:
            body.setdefault("usage", None)
        return body

    def first_chunk(self, c: Choice) -> dict | None:
        return None

    def response(self) -> dict:
        choices = [self.choice(c) for c in self.run.choices]
        body = self.envelope(choices, usage=self.run.usage(), chunk=False)
        if self.diagnosis is not None:
            cached = min(c.cache.num_cached_tokens for c in self.run.choices)
            body["prompt_cache_diagnostics"] = self.diagnostics(cached)
        return body

    def num_entries(self) -> int:
        """The size of ``response()``: a token counts 1, with logprobs 2 + top_k (its text and
        logprob, and its alternatives)."""
        per_token = 1 if self.top_k is None else 2 + self.top_k
        return per_token * sum(len(c.token_ids) for c in self.run.choices)

    def _extras(self, c: Choice, out: dict) -> dict:
        if c.stop_reason is not None:
            out["stop_reason"] = c.stop_reason
        info = self.run.cache_info(c)
        if info is not None:
            out["cache_info"] = info
        return out

    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lp.items(), key=lambda kv: -kv[1])[: self.top_k or 0]

    def _token(self, tid: int) -> str:
        texts = self._texts
        if texts is not None and 0 <= tid < len(texts):
            return texts[tid]
        return self.s.tokenizer.decode([tid])  # not reached: the table covers every row


class _CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        # Per choice: the characters of the text streamed before its current chunk (a
        # chunk's text_offset starts there), a running total so a chunk costs O(its size).
        self._streamed: dict[int, int] = {}

    def logprobs(self, token_ids: list[int], lps: list[dict[int, float]], offset: int):
        if self.top_k is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, lps, strict=False):
            tok = self._token(tid)
            out["tokens"].append(tok)
            out["token_logprobs"].append(_lp(lp.get(tid)))
            out["top_logprobs"].append({self._token(t): _lp(v) for t, v in self._top(lp)})
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    def choice(self, c: Choice) -> dict:
        out = {
            "index": c.index,
            "text": "".join(c.text),
            "logprobs": self.logprobs(c.token_ids, c.logprobs, 0),
            "finish_reason": c.finish_reason,
        }
        return self._extras(c, out)

    def chunk(self, c: Choice, d: StreamDelta) -> dict:
        offset = self._streamed.get(c.index, 0)
        self._streamed[c.index] = offset + len(d.text_delta)
        out = {
            "index": c.index,
            "text": d.text_delta,
            "logprobs": self.logprobs(d.new_token_ids, d.new_logprobs or [], offset),
            "finish_reason": d.finish_reason if d.finished else None,
        }
        if _explains(d):
            out["cache_info"] = self.run.cache_info(c)
        return self.envelope([out])


class _ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], lps: list[dict[int, float]]):
        if self.top_k is None:
            return None
        content = []
        for tid, lp in zip(token_ids, lps, strict=False):
            tok = self._token(tid)
            top = [self._entry(self._token(t), v) for t, v in self._top(lp)]
            content.append({**self._entry(tok, lp.get(tid)), "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _entry(tok: str, lp: float | None) -> dict:
        return {"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode("utf-8"))}

    def choice(self, c: Choice) -> dict:
        out = {
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": self.logprobs(c.token_ids, c.logprobs),
            "finish_reason": c.finish_reason,
        }
        return self._extras(c, out)

    def first_chunk(self, c: Choice) -> dict:
        # Sent before the first token, as OpenAI does: the role, empty content.
        delta = {"role": "assistant", "content": ""}
        return self.envelope(
            [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def chunk(self, c: Choice, d: StreamDelta) -> dict:
        out = {
            "index": c.index,
            "delta": {"content": d.text_delta} if d.text_delta or not d.finished else {},
            "logprobs": self.logprobs(d.new_token_ids, d.new_logprobs or []),
            "finish_reason": d.finish_reason if d.finished else None,
        }
        if _explains(d):
            out["cache_info"] = self.run.cache_info(c)
        return self.envelope([out])


def _explains(d) -> bool:
    """The first delta carries the explanation a request asked for (return_cache_info)."""
    return d.cache.cache_info is not None and d.first
