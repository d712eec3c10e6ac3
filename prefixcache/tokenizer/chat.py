"""Chat prompts: the jinja environment chat templates expect (as transformers sets it up), and
the merging of ``role: "document"`` messages into one stable system prefix."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _message_text(content: Any) -> str:
    """A message's text, whether a string or OpenAI-style content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def merge_documents(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Move ``role: "document"`` messages into the system message, after its text, in order.

    The system prompt and the documents then render as one stable prefix ahead of the
    conversation, so requests about the same documents share their cache blocks:

        <system text>

        # Documents

        ## <title or name, else "Document N">
        <content>

    Without a system message one is created holding only the documents. Messages without
    documents come back unchanged (as a new list of new dicts).
    """
    messages = [dict(m) for m in messages]
    docs = [m for m in messages if m.get("role") == "document"]
    if not docs:
        return messages
    sections = []
    for n, doc in enumerate(docs, 1):
        title = doc.get("title") or doc.get("name") or f"Document {n}"
        sections.append(f"## {title}\n{_message_text(doc.get('content'))}")
    block = "# Documents\n\n" + "\n\n".join(sections)
    rest = [m for m in messages if m.get("role") != "document"]
    for i, message in enumerate(rest):
        if message.get("role") == "system":
            text = _message_text(message.get("content"))
            rest[i] = {**message, "content": f"{text}\n\n{block}" if text else block}
            return rest
    return [{"role": "system", "content": block}, *rest]


@lru_cache(maxsize=16)
def compile_template(source: str):
    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
        rendering only needs the body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def plain_message(message: Any) -> dict[str, Any]:
    if isinstance(message, Mapping):
        return dict(message)
    if hasattr(message, "model_dump"):  # pydantic request models
        return message.model_dump(exclude_none=True)
    raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
