"""``diagnostics``: a comparison with an earlier message (base/comparison.py) in the shape of
Anthropic's ``cache_miss_reason``."""

from __future__ import annotations

from prefixcache.server.base.comparison import Comparison, details


def anthropic_diagnostics(c: Comparison | None, cached_tokens: int, block_size: int) -> dict | None:
    """``diagnostics``, shaped as Anthropic's: ``{"cache_miss_reason": {"type", ...}}``, null
    when the prompts do not diverge and the cache served what they share. Types:
    ``model_changed``, ``tools_changed``, ``system_changed``, ``messages_changed``,
    ``previous_message_not_found``, ``unavailable`` (ours: with ``cause`` "chat_template",
    or "evicted"; a changed ``cache_salt``)."""
    if c is None:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    reusable = c.reusable(block_size)
    if c.changed is None and cached_tokens >= reusable:
        return None
    missed = max(0, min(c.previous_tokens, c.current_tokens - 1) // block_size * block_size
                 - min(cached_tokens, reusable))  # fmt: skip
    if c.changed == "model":
        kind = "model_changed"
    elif c.changed == "prompt" and c.cause == "text" and c.part in ("tools", "system"):
        kind = f"{c.part}_changed"
    elif c.changed == "prompt" and c.cause == "text":
        kind = "messages_changed"
    else:
        kind = "unavailable"
    extra = details(c)
    if c.changed is None:
        extra["cause"] = "evicted"
    elif c.changed in ("cache_salt", "prompt_cache_key"):
        extra["cause"] = f"{c.changed}_changed"
    return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": missed, **extra}}
