"""Request bodies of the OpenAI API (plus vLLM's extra fields).

Pydantic checks types and shapes (a failure is a 422 naming the field; floats must be finite);
value ranges are checked by :class:`prefixcache.api.request.SamplingParams` (a failure is a 400), so
both the server and the offline API enforce the same rules, and the server's size limits
(``edge/limits.py``) by openai/prompt.py (400). Fields OpenAI clients send that the engine does
not use are ignored, as vLLM does; a non-default value of a feature the engine lacks is refused
instead of being silently dropped. The body is read and parsed by base/protocol.py (size, time,
strict JSON, valid text) before it gets here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt

from prefixcache.server.base.protocol import _Body
from prefixcache.server.edge.errors import APIError

PromptInput = str | list[int] | list[str] | list[list[int]]


class PromptCacheOptions(_Body):
    """OpenAI's ``prompt_cache_options``. ``comparison_response_id`` (as in OpenAI's Responses
    API; on chat and completions our extension): explain this request's cache hit against an
    earlier response of the same tenant (base/comparison.py). OpenAI's ``mode`` and ``ttl``
    (implicit/explicit breakpoints) are refused: there are no explicit breakpoints here."""

    comparison_response_id: str | None = Field(None, min_length=1, max_length=128)
    mode: str | None = None
    ttl: str | None = None

    def check_unsupported(self) -> None:
        for name in ("mode", "ttl"):
            if getattr(self, name) is not None:
                raise APIError(400, f"prompt_cache_options.{name} is not supported",
                               param=f"prompt_cache_options.{name}", code="unsupported")  # fmt: skip


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """Fields common to completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)  # at most --max-n (prompt.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0
    # Cache fields: a partition inside the tenant's namespace, and the hit/miss explanation.
    cache_salt: str | None = None
    return_cache_info: bool = False
    # OpenAI's prompt caching fields (docs/server.md "Anthropic and OpenAI caching fields"):
    # prompt_cache_key routes a cluster's requests and keys per-key stats, never what a request
    # may hit; prompt_cache_retention: "in_memory" (RAM only) or "24h" (written through to the
    # disk/Redis tiers, expiring there after 24 h).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # Our extension, TensorRT-LLM's retention priority: how the blocks this request uses rank
    # for eviction among the tenant's own (0-100, range checked by RetentionPriority), for
    # retention_priority_seconds (None: while cached).
    retention_priority: StrictInt | None = None
    retention_priority_seconds: float | None = None
    # Segment caching (docs/segments.md): "segments" reuses each document message's KV wherever
    # it appears (approximate; chat only). Any other value is a 422.
    cache_mode: Literal["prefix", "segments"] = "prefix"
    segment_recompute_tokens: int | None = None  # default 16; range checked by SegmentOptions
    segment_recompute_ratio: float | None = None
    segment_selection: str | None = None  # first | deviation | both; checked by SegmentOptions

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported")
        if self.prompt_cache_options is not None:
            self.prompt_cache_options.check_unsupported()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Generation):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of must equal n", param="best_of", code="unsupported")
        if self.cache_mode == "segments":
            raise APIError(
                400, 'cache_mode "segments" needs document messages: use /v1/chat/completions',
                param="cache_mode", code="unsupported",
            )  # fmt: skip


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    # "document": retrieved context, rendered into the system context before the conversation,
    # so the system prompt and the documents form one stable, cacheable prefix.
    role: Literal["system", "developer", "user", "assistant", "document", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    title: str | None = None  # of a document (its heading in the rendered system context)

    def as_template_dict(self) -> dict:
        if isinstance(self.content, list):
            text = "\n".join(p.text for p in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": text}
        if role == "document":
            out.update({k: v for k, v in (("title", self.title), ("name", self.name)) if v})
        return out


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def template_text_chars(dicts: list[dict]) -> int:
    """Characters a chat's template dicts put into the prompt: each content and a document's
    heading (its title, else its name: tokenizer/chat.py), for the length pre-checks of
    the server and the cluster ingress."""
    return sum(len(d["content"]) + len(d.get("title") or d.get("name") or "") for d in dicts)
