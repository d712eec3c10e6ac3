"""``prompt_cache_diagnostics``: a comparison with an earlier response (base/comparison.py)
in the shape of OpenAI's Responses API."""

from __future__ import annotations

from prefixcache.server.base.comparison import Comparison, details


def openai_diagnostics(c: Comparison | None, cached_tokens: int, block_size: int) -> dict:
    """``prompt_cache_diagnostics``, shaped as OpenAI's Responses API: ``cache_hit``,
    ``cache_miss`` with a ``reason`` (``model_changed``, ``prompt_cache_key_changed``,
    ``input_changed``; ours: ``cache_salt_changed``, ``evicted``) and our details, or
    ``comparison_response_not_found``."""
    if c is None:
        return {"type": "comparison_response_not_found"}
    reusable = c.reusable(block_size)
    if c.changed is None and cached_tokens >= reusable:
        return {"type": "cache_hit", "comparison_reusable_tokens": reusable}
    reason = {"model": "model_changed", "cache_salt": "cache_salt_changed",
              "prompt_cache_key": "prompt_cache_key_changed", "prompt": "input_changed",
              None: "evicted"}[c.changed]  # fmt: skip
    return {"type": "cache_miss", "reason": reason,
            "cache_missed_tokens": c.current_tokens - min(c.diverged_at_token, cached_tokens)
            if c.changed is not None else reusable - cached_tokens,
            "comparison_reusable_tokens": reusable, **details(c)}  # fmt: skip
