"""Request bodies of the OpenAI API (plus vLLM's extra fields and the cache endpoints).

Pydantic checks types and shapes (a failure is a 422 naming the field; floats must be finite);
value ranges are checked by :class:`prefixcache.api.request.SamplingParams` (a failure is a 400), so
both the server and the offline API enforce the same rules, and the server's size limits
(``limits.py``) by the serving layer (400). Fields OpenAI clients send that the engine does not
use are ignored, as vLLM does; a non-default value of a feature the engine lacks is refused
instead of being silently dropped. The body is read and parsed by ``body.py`` (size, time,
strict JSON, valid text) before it gets here.
"""

from __future__ import annotations

import asyncio
from typing import Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from prefixcache.server.edge.body import check_containers, parse_json, read_body
from prefixcache.server.edge.errors import APIError, validation_error
from prefixcache.server.edge.limits import ServerLimits

PromptInput = str | list[int] | list[str] | list[list[int]]


class _Body(BaseModel):
    # allow_inf_nan: a float field never holds NaN or an infinity (1e400 parses as inf).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_B = TypeVar("_B", bound=_Body)


class PromptCacheOptions(_Body):
    """OpenAI's ``prompt_cache_options``. ``comparison_response_id`` (as in OpenAI's Responses
    API; on chat and completions our extension): explain this request's cache hit against an
    earlier response of the same tenant (comparison.py). OpenAI's ``mode`` and ``ttl``
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
    n: int = Field(1, ge=1)  # at most --max-n (serving.py)
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


class _CacheQuery(_Body):
    """A prompt as text or token ids, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    cache_salt: str | None = None

    def check_one_input(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")


class CacheWarmRequest(_CacheQuery):
    # "segments": store each document message of ``messages`` as a segment (no pin, no prefill
    # of the rest); "prefix" (default): prefill the whole prompt into the prefix cache.
    cache_mode: Literal["prefix", "segments"] = "prefix"
    pin: bool = False
    ttl_seconds: float | None = Field(None, gt=0)  # at most the engine's max_pin_ttl_seconds


class CacheLookupRequest(_CacheQuery):
    pass


class CacheInvalidateRequest(_Body):
    # Absent: the caller's own namespace (with cache_salt: that partition of it).
    namespace: str | None = None
    cache_salt: str | None = None
    all: bool = False  # every namespace; admin only


# Bodies larger than this, or holding more objects and arrays than OFF_LOOP_CONTAINERS, are
# parsed and validated in a worker thread: a few MiB of JSON, or a few thousand containers,
# take tens of milliseconds, and the Python parts of that work then let the event loop (every
# other request's stream) in between. The containers are bounded first (body.py).
OFF_LOOP_BYTES = 256 << 10
OFF_LOOP_CONTAINERS = 256


async def parse_body(request: Request, model: type[_B], limits: ServerLimits) -> _B:
    """The body as ``model``: size/time/JSON/text failures are 4xx (body.py), a wrong shape 422."""
    raw = await read_body(request, limits)
    containers = check_containers(raw, limits)  # 400 over the limit, before any parsing
    if len(raw) > OFF_LOOP_BYTES or containers > OFF_LOOP_CONTAINERS:
        return await asyncio.to_thread(_parse, raw, model, limits)
    return _parse(raw, model, limits)


def template_text_chars(dicts: list[dict]) -> int:
    """Characters a chat's template dicts put into the prompt: each content and a document's
    heading (its title, else its name: model/tokenizer_chat.py), for the length pre-checks of
    the server and the cluster ingress."""
    return sum(len(d["content"]) + len(d.get("title") or d.get("name") or "") for d in dicts)


def _parse(raw: bytes, model: type[_B], limits: ServerLimits) -> _B:
    data = parse_json(raw, limits, counted=True)  # parse_body counted its containers
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
