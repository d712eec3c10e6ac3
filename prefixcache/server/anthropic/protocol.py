"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/count_tokens``).

The shapes Anthropic documents, checked by pydantic (a wrong type or a missing field is a 400
``invalid_request_error`` on these routes, errors.py), plus our extensions, each named where it
is declared. What the engine cannot do is refused with a 400 saying so (``check_unsupported``)
rather than silently ignored: image and document blocks, server tools, extended thinking,
``tool_choice`` "any"/"tool" (nothing here can force a model to call a tool). Thinking blocks
of earlier assistant turns are accepted and dropped, as Anthropic drops them from the context.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt

from prefixcache.server.base.protocol import _Body
from prefixcache.server.edge.errors import APIError

# The ``anthropic-version`` header: a date, at least Anthropic's first version; later ones (the
# official client sends its own) are served with the same behaviour.
ANTHROPIC_VERSION = r"^\d{4}-\d{2}-\d{2}$"
FIRST_ANTHROPIC_VERSION = "2023-01-01"
# Anthropic's rule for tool names.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


class CacheControl(_Body):
    """A cache breakpoint (docs/server.md "Anthropic and OpenAI caching fields"). ``shared``
    (our extension): with a shared ``cache_salt``, everything up to and including this block
    is declared shared with every tenant of the salt (without it a shared prefix stops at the
    tools and system: cache_breakpoints.shared_tokens)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"
    shared: bool = False


class _Block(_Body):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


class ThinkingBlock(_Body):
    """An earlier turn's (redacted) thinking: accepted and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


class MediaBlock(_Block):
    """Images and documents: parsed so the refusal can say what is not supported."""

    type: Literal["image", "document", "search_result", "container_upload"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    # "custom" or absent: a client tool. Anthropic's server tools (web search, code execution,
    # ...) carry their own type and run on Anthropic's side: refused here.
    type: str | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Body):
    user_id: str | None = Field(None, max_length=256)


class Diagnostics(_Body):
    """Anthropic's prompt-cache diagnostics: compare with this client's earlier response
    (null: remember this one, compare with none)."""

    previous_message_id: str | None = Field(None, min_length=1, max_length=128)


class Thinking(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class _MessagesPrompt(_Body):
    """What renders the prompt: shared by a message and a token count."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # The automatic mode: one breakpoint on the last block of the last message.
    cache_control: CacheControl | None = None
    # Our extension: a cache partition inside the tenant's namespace, as on the OpenAI routes
    # (with a shared salt, a breakpoint declares a shared prefix: cache_breakpoints.py).
    cache_salt: str | None = None

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [TextBlock(type="text", text=self.system)] if self.system else []
        return list(self.system)

    def check_unsupported(self) -> None:
        if self.thinking is not None and self.thinking.type == "enabled":
            raise APIError(400, "extended thinking is not supported by this server",
                           param="thinking", code="unsupported")  # fmt: skip
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise APIError(
                400, f'tool_choice "{self.tool_choice.type}" is not supported: this server '
                'cannot force a tool call; use "auto" or "none"', param="tool_choice",
                code="unsupported",
            )  # fmt: skip
        for i, t in enumerate(self.tools or ()):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools.{i}: server tool {t.type!r} is not supported",
                               param=f"tools.{i}.type", code="unsupported")  # fmt: skip
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: tool names must be unique", param="tools")
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.blocks()):
                if isinstance(b, MediaBlock):
                    raise APIError(
                        400, f"messages.{i}.content.{j}: {b.type} content blocks are not "
                        "supported by this server", param=f"messages.{i}.content.{j}.type",
                        code="unsupported",
                    )  # fmt: skip
                if m.role == "user" and isinstance(b, ToolUseBlock):
                    raise APIError(400, f"messages.{i}.content.{j}: tool_use blocks belong to "
                                   "assistant messages", param=f"messages.{i}.content.{j}")  # fmt: skip
                if m.role == "assistant" and isinstance(b, ToolResultBlock):
                    raise APIError(400, f"messages.{i}.content.{j}: tool_result blocks belong "
                                   "to user messages", param=f"messages.{i}.content.{j}")  # fmt: skip

    @property
    def tools_enabled(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")


class MessagesRequest(_MessagesPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Anthropic's ranges: temperature in [0, 1] (default 1), top_p in (0, 1], top_k >= 0.
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted; there is one tier here
    # Our extensions (docs/server.md): the hit/miss explanation, the caller's own queue order.
    return_cache_info: bool = False
    priority: int = 0
    # How the blocks it uses rank for eviction among the tenant's own (as on the OpenAI routes).
    retention_priority: StrictInt | None = None
    retention_priority_seconds: float | None = None
    # Anthropic's: why the cache could not reuse an earlier response's prefix (base/comparison.py).
    diagnostics: Diagnostics | None = None


class CountTokensRequest(_MessagesPrompt):
    pass
