"""Request bodies of the cache routes (``/v1/cache/...``): a prompt as text or token ids, or
OpenAI chat messages rendered with the model's template (openai/prompt.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prefixcache.server.base.protocol import _Body
from prefixcache.server.edge.errors import APIError
from prefixcache.server.openai.protocol import ChatMessage


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
