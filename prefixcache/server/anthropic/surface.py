"""Anthropic's Messages API as the shared base takes it (base/app.py ``Surface``): the
``/v1/messages`` routes, the renderer the base keeps for it per server (``MessagesRenderer``,
built from the tokenizer: ``Serving.renderer(MessagesRenderer)``), and its error dialect."""

from __future__ import annotations

from prefixcache.server.anthropic import errors, messages
from prefixcache.server.anthropic.prompt import MessagesRenderer
from prefixcache.server.base.app import Surface

ANTHROPIC = Surface("anthropic", (messages.router,), MessagesRenderer, errors.DIALECT)
