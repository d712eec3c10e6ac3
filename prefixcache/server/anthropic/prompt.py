"""An Anthropic Messages request as a prompt: rendered through the model's chat template, and
where each cache breakpoint falls in its tokens.

Anthropic's order is kept: tools, then system, then the messages, so a prefix that agents
resend unchanged (tool definitions, the system prompt, the history) is a prefix of the tokens.
Tools render one of two ways:

- **native**, when the model's template takes them (it names both ``tools`` and
  ``tool_calls``, as transformers passes them): ``tools`` as JSON-schema functions, assistant
  ``tool_use`` blocks as ``tool_calls``, user ``tool_result`` blocks as ``tool`` messages;
- **as text** otherwise (the default model's template knows neither): the tools are described
  at the start of the system message, an assistant's tool calls are written into its message
  as ``<tool_call>{"name", "arguments"}</tool_call>`` and tool results into the user's as
  ``<tool_response>...</tool_response>``: the Hermes/Qwen convention, which
  ``tool_calls.py`` reads back from the model's output. Each Anthropic message stays one
  template message, so a template's user/assistant alternation holds.

A **breakpoint** (``cache_control`` on a tool, a system block or a message's content block; or
the top-level automatic mode, on the last block of the last message) covers the prompt up to
and including its block. Its length in tokens is the longest common prefix of the prompt and
the rendering of the request cut after that block (no generation prompt): every token counted
is a token of the prompt that nothing after the cut produces; a token merging across the cut
is not counted (so a breakpoint never claims a token a later block could change).

A final assistant message is a prefill (Anthropic's): the prompt ends with its text and the
output continues it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jinja2

from prefixcache.server.anthropic.protocol import (
    CacheControl,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    _MessagesPrompt,
)
from prefixcache.server.edge.errors import APIError

MAX_BREAKPOINTS = 4  # Anthropic's limit, automatic mode included
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more of these tools. To call one, answer with\n"
    f'{TOOL_CALL_OPEN}\n{{"name": <tool name>, "arguments": <its input as JSON>}}\n'
    f"{TOOL_CALL_CLOSE}\n\nTools:"
)


@dataclass(frozen=True)
class Breakpoint:
    """``where`` (``tools.2``, ``system.0``, ``messages.3.content.1``, ``automatic``), its
    ``ttl`` ("5m" or "1h"), ``num_tokens``: the prompt tokens it covers, and ``shared``: its
    cache_control's ``shared`` (our extension)."""

    where: str
    ttl: str
    num_tokens: int
    shared: bool = False


@dataclass(frozen=True)
class MessagesPrompt:
    ids: list[int]
    breakpoints: tuple[Breakpoint, ...]
    # The chat as the template saw it (role and content of each message), for comparisons.
    dicts: tuple[dict, ...]
    # The leading ids that render the tools and the system alone (counted when asked: where a
    # shared prefix stops unless a breakpoint says otherwise, cache_breakpoints.py).
    system_tokens: int = 0


@dataclass(frozen=True)
class _Cut:
    """The request up to and including one block: the first ``tools`` tools, ``system``
    system blocks, ``messages`` whole messages, then ``blocks`` blocks of the next one."""

    tools: int
    system: int
    messages: int
    blocks: int = 0


def _json(x) -> str:
    return json.dumps(x, ensure_ascii=False)


def tool_call_text(name: str, arguments: dict) -> str:
    return f"{TOOL_CALL_OPEN}\n{_json({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def text_chars(req: _MessagesPrompt) -> int:
    """Characters the request puts into the prompt (the length pre-check before rendering)."""
    n = sum(len(b.text) for b in req.system_blocks())
    for t in req.tools or ():
        n += len(t.name) + len(t.description or "") + len(_json(t.input_schema))
    for m in req.messages:
        for b in m.blocks():
            if isinstance(b, ToolUseBlock):
                n += len(b.name) + len(_json(b.input))
            elif isinstance(b, ToolResultBlock):
                n += len(b.text())
            elif hasattr(b, "text"):
                n += len(b.text)
    return n


class MessagesRenderer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template and "tool_calls" in template

    # -- the prompt -----------------------------------------------------------------------------

    def prompt(self, req: _MessagesPrompt, system_prefix: bool = False) -> MessagesPrompt:
        """The ids (400 when the template cannot render the request) and the breakpoints
        (400 over ``MAX_BREAKPOINTS``, or a 1-hour one after a 5-minute one, as Anthropic);
        with ``system_prefix`` (and a breakpoint), how many leading ids render the tools and
        the system alone."""
        marks = self._marks(req)
        full = _Cut(len(req.tools or ()), len(req.system_blocks()), len(req.messages))
        last = req.messages[-1]
        prefill = last.role == "assistant"
        dicts, tools = self._dicts(req, full)
        text = self._render(dicts, tools, add_generation_prompt=not prefill)
        if prefill:
            text = _continue_final(text, dicts[-1]["content"])
        ids = self._encode(text)
        points = []
        for where, cc, cut in marks:
            points.append(Breakpoint(where, cc.ttl, self._covered(req, cut, ids), cc.shared))
        system = 0
        if system_prefix and points:
            system = self._covered(req, _Cut(full.tools, full.system, 0), ids)
        return MessagesPrompt(ids, tuple(points), tuple(dicts), system)

    def _covered(self, req: _MessagesPrompt, cut: _Cut, ids: list[int]) -> int:
        """The prompt tokens the request cut at ``cut`` renders (no generation prompt): the
        longest common prefix of the two renderings."""
        d, t = self._dicts(req, cut)
        head = self._encode(self._render(d, t, add_generation_prompt=False, strict=False))
        return _common_prefix(head, ids)

    def parts(self, req: _MessagesPrompt) -> list[tuple[str, str]]:
        """The request's parts as comparisons see them (base/comparison.py): its tools, its system
        text, then each message (its role, then its text as rendered)."""
        tools = "\n".join(_json(t.model_dump(exclude={"cache_control"}, exclude_none=True))
                          for t in req.tools or ())  # fmt: skip
        out = [("tools", tools), ("system", "\n".join(b.text for b in req.system_blocks()))]
        for i, m in enumerate(req.messages):
            text = "\n".join(_as_text(b) for b in m.blocks() if not isinstance(b, ThinkingBlock))
            out.append((f"messages.{i}", f"{m.role}\n{text}"))
        return out

    def prefix_ids(self, req: _MessagesPrompt, k: int) -> list[int]:
        """The ids of the request's first ``k`` parts (``parts``) alone, no generation prompt."""
        if k <= 0:
            return []
        tools = len(req.tools or ())
        cut = _Cut(tools, 0 if k < 2 else len(req.system_blocks()), max(0, k - 2))
        d, t = self._dicts(req, cut)
        return self._encode(self._render(d, t, add_generation_prompt=False, strict=False))

    def _marks(self, req: _MessagesPrompt) -> list[tuple[str, CacheControl, _Cut]]:
        tools, system = req.tools or [], req.system_blocks()
        marks = [(f"tools.{i}", t.cache_control, _Cut(i + 1, 0, 0))
                 for i, t in enumerate(tools) if t.cache_control is not None]  # fmt: skip
        for j, b in enumerate(system):
            if b.cache_control is not None:
                _nonempty(b.text, f"system.{j}")
                marks.append((f"system.{j}", b.cache_control, _Cut(len(tools), j + 1, 0)))
        for m, msg in enumerate(req.messages):
            for k, b in enumerate(msg.blocks()):
                cc = getattr(b, "cache_control", None)
                if isinstance(b, ToolResultBlock) and cc is None and isinstance(b.content, list):
                    # A mark on a text block inside a tool result covers the result.
                    cc = next((x.cache_control for x in b.content if x.cache_control), None)
                if cc is None:
                    continue
                if hasattr(b, "text") and isinstance(b.text, str):
                    _nonempty(b.text, f"messages.{m}.content.{k}")
                marks.append(
                    (f"messages.{m}.content.{k}", cc, _Cut(len(tools), len(system), m, k + 1))
                )
        if req.cache_control is not None:
            full = _Cut(len(tools), len(system), len(req.messages))
            marks.append(("automatic", req.cache_control, full))
        if len(marks) > MAX_BREAKPOINTS:
            raise APIError(
                400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                f"provided. Found {len(marks)}.", param="cache_control",
            )  # fmt: skip
        seen_short = None
        for where, cc, _ in marks:
            if cc.ttl == "5m" and seen_short is None:
                seen_short = where
            elif cc.ttl == "1h" and seen_short is not None:
                raise APIError(
                    400, f'{where}: a cache_control with ttl "1h" must come before any with '
                    f'ttl "5m" (the first is at {seen_short})', param="cache_control",
                )  # fmt: skip
        return marks

    # -- rendering ------------------------------------------------------------------------------

    def _dicts(self, req: _MessagesPrompt, cut: _Cut) -> tuple[list[dict], list | None]:
        """The template's messages and tools for the request up to ``cut``."""
        tools = (req.tools or [])[: cut.tools]
        system = "\n".join(b.text for b in req.system_blocks()[: cut.system])
        tools_arg = None
        if tools and self.native_tools:
            tools_arg = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema}} for t in tools]  # fmt: skip
        elif tools:
            lines = [_json({"name": t.name, "description": t.description or "",
                            "input_schema": t.input_schema}) for t in tools]  # fmt: skip
            desc = TOOLS_HEADER + "\n" + "\n".join(lines)
            system = f"{desc}\n\n{system}" if system else desc
        dicts = [{"role": "system", "content": system}] if system else []
        messages = [(m.role, m.blocks()) for m in req.messages[: cut.messages]]
        if cut.blocks:
            m = req.messages[cut.messages]
            messages.append((m.role, m.blocks()[: cut.blocks]))
        for role, blocks in messages:
            blocks = [b for b in blocks if not isinstance(b, ThinkingBlock)]
            if self.native_tools:
                dicts.extend(_native(role, blocks))
            else:
                dicts.append({"role": role, "content": "\n".join(_as_text(b) for b in blocks)})
        return dicts, tools_arg

    def _render(self, dicts, tools, add_generation_prompt: bool, strict: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except (ValueError, KeyError, TypeError, jinja2.TemplateError):
            if not strict:  # a cut the template refuses (e.g. no user message yet): 0 tokens
                return ""
            # The template's own message may quote internals; say what is wrong in our words.
            raise APIError(
                400, "these messages cannot be rendered with the model's chat template "
                "(check roles and their order)", param="messages",
            ) from None  # fmt: skip

    def _encode(self, text: str) -> list[int]:
        """The ids of a rendered chat, BOS as ``Tokenizer.encode_chat`` puts it."""
        if not text:
            return []
        tok = self.tokenizer
        ids = tok.encode(text)
        if tok.add_bos_token and ids[:1] != [tok.bos_token_id]:
            ids.insert(0, tok.bos_token_id)
        return ids


def _nonempty(text: str, where: str) -> None:
    if not text:
        raise APIError(400, f"{where}: cache_control cannot be set for empty text blocks",
                       param=where)  # fmt: skip


def _as_text(b) -> str:
    if isinstance(b, ToolUseBlock):
        return tool_call_text(b.name, b.input)
    if isinstance(b, ToolResultBlock):
        tag = '<tool_response error="true">' if b.is_error else "<tool_response>"
        return f"{tag}\n{b.text()}\n</tool_response>"
    return b.text


def _native(role: str, blocks: list) -> list[dict]:
    """One Anthropic message as the template's messages: an assistant's text and tool calls in
    one message; a user's tool results as ``tool`` messages and its text as user messages, in
    block order."""
    if role == "assistant":
        d = {"role": "assistant",
             "content": "\n".join(b.text for b in blocks if not isinstance(b, ToolUseBlock))}
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]  # fmt: skip
        if calls:
            d["tool_calls"] = calls
        return [d]
    out: list[dict] = []
    text: list[str] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        else:
            text.append(b.text)
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _continue_final(text: str, final: str) -> str:
    """The rendering cut right after the final assistant message's text (a prefill): the
    output continues it rather than starting a new turn."""
    if not final or final != final.rstrip():
        raise APIError(
            400, "final assistant content cannot be empty or end with trailing whitespace",
            param="messages",
        )  # fmt: skip
    at = text.rfind(final)
    if at < 0:
        raise APIError(400, "the final assistant message cannot be continued with this "
                       "model's chat template", param="messages")  # fmt: skip
    return text[: at + len(final)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
