"""The OpenAI API as the shared base takes it (base/app.py ``Surface``): completions, chat
completions and models. Its prompts are rendered by openai/prompt.py over the shared
``Serving``, with no per-server state of its own; errors are the base's OpenAI shape."""

from __future__ import annotations

from prefixcache.server.base.app import Surface
from prefixcache.server.openai import completions, models

OPENAI = Surface("openai", (completions.router, models.router))
