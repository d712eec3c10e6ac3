"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over
the same engine, tenants, limits and fair shares as the chat completions.

A request is authenticated (``x-api-key`` or ``Authorization: Bearer``, the same keys), parsed
(protocol.py), rendered (prompt.py: tools, system, messages, and where each
cache breakpoint falls), and started as a one-choice :class:`~prefixcache.server.base.run.Run` with
its breakpoints as cache leases (cache_breakpoints.py). The answer is Anthropic's message, or its
stream of events::

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    (more blocks: a tool_use block per tool call), message_delta, message_stop

``message_start`` is sent with the first token, when the usage of the prompt (what the cache
served) is known. Errors are Anthropic's shape (errors.py); one after the stream began is an
``error`` event. Our extension fields (documented in docs/server.md): ``cache_leases`` (what
each breakpoint's lease got), ``cache_info`` (with ``return_cache_info``) and
``prompt_cache_comparison`` (with ``prompt_cache_options.comparison_response_id``), on the
message (in a stream: the ``message_start`` event's message).
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.request import SamplingParams
from prefixcache.server.anthropic import cache_breakpoints
from prefixcache.server.anthropic.diagnostics import anthropic_diagnostics
from prefixcache.server.anthropic.errors import DIALECT
from prefixcache.server.anthropic.prompt import MessagesPrompt, MessagesRenderer, text_chars
from prefixcache.server.anthropic.protocol import (
    ANTHROPIC_VERSION,
    FIRST_ANTHROPIC_VERSION,
    CountTokensRequest,
    MessagesRequest,
    _MessagesPrompt,
)
from prefixcache.server.anthropic.tool_calls import ToolCall, ToolCallReader, split_output
from prefixcache.server.base.comparison import PromptRecord
from prefixcache.server.base.run import Choice, Run
from prefixcache.server.base.serving import PRIORITY_BOUND, Serving, accept, as_api_error
from prefixcache.server.edge.errors import (
    APIError,
    from_engine_error,
    internal_error,
    request_id_of,
)
from prefixcache.server.edge.http import TimedStreamingResponse

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    s, tenant, req, scope = await accept(request, MessagesRequest)
    _check_version(request)
    req.check_unsupported()
    _check_limits(s, req)
    s.check_admission(tenant, 1)  # 429 before the request is rendered
    prompt = await messages_prompt(s, req, system_prefix=scope.shared is not None)
    params = _sampling(s, req, len(prompt.ids))
    record = diagnosis = None
    if req.diagnostics is not None:  # Anthropic's: compare with an earlier response
        renderer = s.renderer(MessagesRenderer)
        record = PromptRecord.of(prompt.ids, renderer.parts(req), req.model, scope.namespace)
        previous = req.diagnostics.previous_message_id
        if previous is not None:
            diagnosis = (await s.compare_with(
                tenant, previous, record, lambda k: renderer.prefix_ids(req, k)),)
    run = s.start(
        "msg_", [prompt.ids], [params], 1, tenant, scope.namespace, req.priority,
        req.return_cache_info, shared_prefix=cache_breakpoints.shared_prefix(prompt, scope),
        leases=cache_breakpoints.leases(prompt.breakpoints),
        retention_priority=s.retention_priority(req),
    )  # fmt: skip
    if record is not None:
        s.responses.put(tenant.name, run.id, record)
    answer = _Answer(s, run, req, prompt, diagnosis)
    if req.stream:
        return TimedStreamingResponse(
            answer.events(request_id_of(request.scope)),
            send_timeout=s.limits.send_timeout,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        if not await run.collect_while_connected(request):
            return Response(status_code=499)  # nobody reads it; the finally aborts the run
        return JSONResponse(answer.message())
    finally:
        run.close()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    """The prompt's tokens as ``/v1/messages`` would render it (breakpoints checked too)."""
    # Up to five renders (the prompt and each breakpoint's cut) and no queue to wait in: a
    # call of the tenant's cache-call rate, charged before the body is read, and rendered on
    # the cache routes' threads within the tenant's cap (base/cache_gate.py).
    s, tenant, req, _scope = await accept(request, CountTokensRequest, charge=True)
    _check_version(request)
    req.check_unsupported()
    _check_limits(s, req)
    prompt = await s.cache_gate.run(tenant.name, _render, s, req, rated=False)
    return {"input_tokens": len(prompt.ids)}


def _check_version(request: Request) -> None:
    """``anthropic-version``: a date from Anthropic's first version on (absent: accepted)."""
    v = request.headers.get("anthropic-version")
    if v is not None and not (re.match(ANTHROPIC_VERSION, v) and v >= FIRST_ANTHROPIC_VERSION):
        raise APIError(
            400, f"anthropic-version: {v[:32]!r} is not a version (a date such as 2023-06-01)"
        )


def _check_limits(s: Serving, req: _MessagesPrompt) -> None:
    lim = s.limits
    if len(req.messages) > lim.max_messages:
        raise APIError(400, f"at most {lim.max_messages} messages per request", param="messages")
    if len(req.tools or ()) > lim.max_tools:
        raise APIError(400, f"at most {lim.max_tools} tools per request", param="tools")
    stop = getattr(req, "stop_sequences", None) or []
    if len(stop) > lim.max_stop_sequences:
        raise APIError(400, f"at most {lim.max_stop_sequences} stop sequences",
                       param="stop_sequences")  # fmt: skip
    if any(len(x) > lim.max_stop_chars for x in stop):
        raise APIError(400, f"stop sequences are at most {lim.max_stop_chars} characters",
                       param="stop_sequences")  # fmt: skip
    if abs(getattr(req, "priority", 0)) > PRIORITY_BOUND:
        raise APIError(400, "priority must be a 32-bit integer", param="priority")


async def messages_prompt(s: Serving, req: _MessagesPrompt, system_prefix: bool = False) -> MessagesPrompt:
    """Rendered in a worker thread (``_render``)."""
    return await asyncio.to_thread(_render, s, req, system_prefix)


def _render(s: Serving, req: _MessagesPrompt, system_prefix: bool = False) -> MessagesPrompt:
    """After the length pre-check (a text that cannot fit the context is refused untokenized);
    the ids checked like any prompt's. ``system_prefix``: count the tools and system's tokens
    too (a shared salt's declared prefix, cache_breakpoints.py)."""
    s.check_text_fits(text_chars(req), "messages")
    prompt = s.renderer(MessagesRenderer).prompt(req, system_prefix)
    if not prompt.ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    s.prompt_ids(prompt.ids, "messages")
    return prompt


def _sampling(s: Serving, req: MessagesRequest, prompt_len: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            stop=req.stop_sequences or (),
        )
    except InvalidRequestError as e:
        raise as_api_error(e) from None


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class _Answer:
    """One Messages request's answer: the message, or its events."""

    def __init__(self, s: Serving, run: Run, req: MessagesRequest, prompt: MessagesPrompt,
                 diagnosis: tuple | None = None) -> None:  # fmt: skip
        self.diagnosis = diagnosis  # (Comparison | None,) when an earlier message was named
        self.s = s
        self.run = run
        self.req = req
        self.prompt = prompt
        self.tool_names = [t.name for t in req.tools or ()] if req.tools_enabled else []

    @property
    def choice(self) -> Choice:
        return self.run.choices[0]

    def usage(self) -> dict:
        c = self.choice
        return cache_breakpoints.usage(
            c.num_prompt_tokens or len(c.prompt_token_ids), c.cache.num_cached_tokens,
            c.num_output_tokens, self.prompt.breakpoints, self.s.engine.config.block_size,
            self.s.engine.config.enable_prefix_caching,
        )  # fmt: skip

    def _envelope(self, content: list, stop_reason, stop_sequence) -> dict:
        body = {
            "id": self.run.id,
            "type": "message",
            "role": "assistant",
            "model": self.s.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(),
        }
        return self._extensions(body)

    def _extensions(self, body: dict) -> dict:
        c = self.choice
        if self.prompt.breakpoints:
            body["cache_leases"] = cache_breakpoints.lease_report(
                self.prompt.breakpoints, c.cache.lease_grants
            )
        info = self.run.cache_info(c)
        if info is not None:
            body["cache_info"] = info
        if self.req.diagnostics is not None:  # null: no divergence found (or none asked)
            body["diagnostics"] = None if self.diagnosis is None else anthropic_diagnostics(
                self.diagnosis[0], c.cache.num_cached_tokens, self.s.engine.config.block_size)
        return body

    def _stop(self, used_tools: bool) -> tuple[str, str | None]:
        c = self.choice
        if used_tools:
            return "tool_use", None
        if c.finish_reason == "length":
            return "max_tokens", None
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    # -- the whole message ---------------------------------------------------------------------

    def message(self) -> dict:
        text = "".join(self.choice.text)
        items = split_output(text, self.tool_names) if self.tool_names else [text]
        calls = [x for x in items if isinstance(x, ToolCall)]
        if not calls:
            content = [{"type": "text", "text": text}]
        else:
            content = [_tool_use(x) if isinstance(x, ToolCall) else {"type": "text", "text": x}
                       for x in items]  # fmt: skip
        return self._envelope(content, *self._stop(bool(calls)))

    # -- the stream ----------------------------------------------------------------------------

    async def events(self, request_id: str | None):
        """Anthropic's event stream; ``run.close()`` in ``finally`` aborts the run when the
        client leaves. A failure after the 200 is one ``error`` event."""
        blocks = _Blocks()
        reader = ToolCallReader(self.tool_names) if self.tool_names else None
        try:
            started = False
            async for _c, d in self.run.deltas():
                if not started:
                    started = True
                    yield _sse("message_start", {"type": "message_start",
                                                 "message": self._start()})  # fmt: skip
                    if reader is None:
                        yield blocks.open_text()
                    yield _sse("ping", {"type": "ping"})
                if d.text_delta:
                    pieces = reader.feed(d.text_delta) if reader is not None else [d.text_delta]
                    out = "".join(blocks.emit(p) for p in pieces)
                    if out:
                        yield out
            if reader is not None:
                out = "".join(blocks.emit(p) for p in reader.finish())
                if out:
                    yield out
            yield blocks.close_all()
            stop_reason, stop_sequence = self._stop(blocks.tool_uses > 0)
            yield _sse("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": self.usage(),
            })  # fmt: skip
            yield _sse("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the error is an event
            err = from_engine_error(e, request_id) or internal_error(request_id, e)
            yield _sse("error", DIALECT.body_of(err))
        finally:
            self.run.close()

    def _start(self) -> dict:
        return self._envelope([], None, None)


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}


class _Blocks:
    """The content blocks of a stream: indices, and the start/stop events around each."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.tool_uses = 0

    def open_text(self) -> str:
        self.index += 1
        self.open_kind = "text"
        return _sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": {"type": "text", "text": ""}})  # fmt: skip

    def _stop(self) -> str:
        if self.open_kind is None:
            return ""
        self.open_kind = None
        return _sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def emit(self, piece: str | ToolCall) -> str:
        if isinstance(piece, ToolCall):
            self.tool_uses += 1
            out = self._stop()
            self.index += 1
            start = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            out += _sse("content_block_start", {"type": "content_block_start",
                                                "index": self.index, "content_block": start})  # fmt: skip
            delta = {"type": "input_json_delta", "partial_json": json.dumps(piece.input)}
            out += _sse("content_block_delta", {"type": "content_block_delta",
                                                "index": self.index, "delta": delta})  # fmt: skip
            return out + _sse("content_block_stop", {"type": "content_block_stop",
                                                     "index": self.index})  # fmt: skip
        if not piece:
            return ""
        out = self.open_text() if self.open_kind != "text" else ""
        delta = {"type": "text_delta", "text": piece}
        return out + _sse("content_block_delta", {"type": "content_block_delta",
                                                  "index": self.index, "delta": delta})  # fmt: skip

    def close_all(self) -> str:
        if self.index < 0:  # nothing was said at all: one empty text block, as without tools
            return self.open_text() + self._stop()
        return self._stop()
