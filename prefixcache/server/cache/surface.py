"""The cache routes (``/v1/cache/warm``, ``/lookup``, ``/invalidate``, ``/stats``) as the shared
base takes them (base/app.py ``Surface``). They render chat ``messages`` as the OpenAI routes
do (openai/prompt.py) and answer errors in OpenAI's shape."""

from __future__ import annotations

from prefixcache.server.base.app import Surface
from prefixcache.server.cache import routes

CACHE = Surface("cache", (routes.router,))
