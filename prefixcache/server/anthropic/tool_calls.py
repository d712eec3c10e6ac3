"""Tool calls read back from a model's output text, as it streams.

A request with tools (prompt.py) asks the model to call one by answering
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes/Qwen convention,
which tool-calling templates of that family also use). :class:`ToolCallReader` splits the
output into text and calls: text is handed on as it comes, except the few characters that
could be the start of ``<tool_call>`` (held back until they are not); a call is handed on
whole once its closing tag arrives (or the output ends). A call that is not valid JSON, names
a tool the request did not declare, or has no object of arguments is handed on as the text it
was: the client sees what the model said, never a call it did not make.

Per fed piece the work is bounded by the piece (searches start where the last one stopped), so
a long output costs the event loop O(its length); a call longer than ``MAX_CALL_CHARS`` is text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from prefixcache.server.anthropic.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_CALL_CHARS = 1 << 16


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    input: dict


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    def __init__(self, tool_names) -> None:
        self.tool_names = frozenset(tool_names)
        self._buf = ""
        self._in_call = False
        self._searched = 0  # the buffer before this was searched for the current tag already
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        """What of the output so far can be handed on: texts and calls, in order. The buffer is
        walked with a cursor and cut once at the end: a text of many tags costs O(its length),
        not a copy of the rest per tag (a non-streamed answer is fed whole, issue #37)."""
        buf = self._buf + text
        out: list[str | ToolCall] = []
        start, searched = 0, self._searched  # the buffer begins at ``start``
        while True:
            tag = TOOL_CALL_CLOSE if self._in_call else TOOL_CALL_OPEN
            at = buf.find(tag, start + searched)
            if at < 0:
                break
            if self._in_call:
                out.append(self._call(buf[start:at]))
            elif at > start:
                out.append(buf[start:at])
            start = at + len(tag)
            self._in_call = not self._in_call
            searched = 0
        self._buf = buf[start:] if start else buf
        self._searched = searched
        if self._in_call:
            if len(self._buf) > MAX_CALL_CHARS:  # not a call after all: what it was
                out.append(TOOL_CALL_OPEN + self._buf)
                self._buf, self._in_call = "", False
            self._searched = max(0, len(self._buf) - len(TOOL_CALL_CLOSE) + 1)
            return _merge(out)
        keep = _held(self._buf)
        if len(self._buf) > keep:
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
        self._searched = 0
        return _merge(out)

    def finish(self) -> list[str | ToolCall]:
        """The rest, at the end of the output: an unclosed call whose JSON is whole counts
        (a model may stop right after it)."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return [self._call(rest, closed=False)]
        return [rest] if rest else []

    def _call(self, inner: str, closed: bool = True) -> str | ToolCall:
        try:
            obj = json.loads(inner)
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("input")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if isinstance(name, str) and name in self.tool_names and isinstance(args, dict):
            self.calls += 1
            return ToolCall(new_tool_use_id(), name, args)
        return TOOL_CALL_OPEN + inner + (TOOL_CALL_CLOSE if closed else "")


def split_output(text: str, tool_names) -> list[str | ToolCall]:
    """The whole output at once (a non-streamed answer)."""
    r = ToolCallReader(tool_names)
    return _merge(r.feed(text) + r.finish())


def _held(buf: str) -> int:
    """How many trailing characters of ``buf`` could start the opening tag."""
    for n in range(min(len(buf), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(buf[-n:]):
            return n
    return 0


def _merge(items: list[str | ToolCall]) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    for x in items:
        if isinstance(x, str):
            if not x:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += x
                continue
        out.append(x)
    return out
