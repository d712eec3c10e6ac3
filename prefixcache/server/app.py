"""The server's app: the shared base (base/app.py) with every API it speaks.

``create_app(engine, ...)`` takes an engine implementing :class:`~prefixcache.api.engine.EngineAPI`
(an ``AsyncEngine``) that is built but not started, and the options of
:func:`~prefixcache.server.base.app.build_app`; the app's lifespan starts the engine's step loop
and, at shutdown, drains it. This is the one place that names the APIs: each package hands its
routes, renderer and error dialect to the base as a ``Surface``.
"""

from __future__ import annotations

from fastapi import FastAPI

from prefixcache.api.engine import EngineAPI
from prefixcache.server.anthropic.surface import ANTHROPIC
from prefixcache.server.base.app import build_app
from prefixcache.server.cache.surface import CACHE
from prefixcache.server.openai.surface import OPENAI

SURFACES = (OPENAI, ANTHROPIC, CACHE)


def create_app(engine: EngineAPI, **options) -> FastAPI:
    """The app serving ``SURFACES`` on ``engine``; ``options``: ``build_app``'s."""
    return build_app(engine, SURFACES, **options)
