"""Anthropic's cache breakpoints mapped onto what the engine has (docs/server.md, "Anthropic
and OpenAI caching fields"): each breakpoint is a lease (a pin with its TTL, charged to the
tenant's pin quota: engine/leases.py) and, under a shared ``cache_salt``, the breakpoints declare
the shared prefix (``SharedPrefix``: up to the first, no further than the tools and system
unless a breakpoint is marked ``shared``; ``shared_tokens``). And the usage figures Anthropic
reports, from what the engine measured.

What differs from Anthropic, on purpose:

- Every request's prompt is cached, breakpoint or not (the prefix cache is the product), so a
  prefix cached by an earlier request without a breakpoint still counts as a read; a
  breakpoint adds a *guarantee*: its prefix stays for its TTL.
- No lookback window: a hit is the longest cached prefix, however far before a breakpoint it
  ends (Anthropic looks back at most 20 blocks).
- The minimum cacheable length is one block (16 tokens by default), not 1,024 or more; only
  whole blocks are cached, so a breakpoint covers its tokens rounded down to a block.
- TTLs are at most ``--max-pin-ttl`` (a longer one is *clipped*, and the response says so), and
  a lease the tenant's pin quota cannot hold is *rejected*, with the reason, while the request
  runs on unchanged.
"""

from __future__ import annotations

from prefixcache.api.request import CacheLease, SharedPrefix
from prefixcache.server.anthropic.prompt import Breakpoint, MessagesPrompt
from prefixcache.server.base.auth import CacheScope

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


def leases(breakpoints: tuple[Breakpoint, ...]) -> tuple[CacheLease, ...]:
    return tuple(CacheLease(bp.num_tokens, TTL_SECONDS[bp.ttl]) for bp in breakpoints)


def shared_tokens(prompt: MessagesPrompt) -> int:
    """The prefix a request with a shared salt declares shared (issue #37): up to its first
    breakpoint, but **no further than its tools and system** (``prompt.system_tokens``), as a
    chat's declared prefix stops at its system messages, unless a breakpoint says
    ``"shared": true`` (our extension): then everything up to the last such breakpoint. Without
    a breakpoint, nothing. So automatic caching, or a breakpoint on the last user turn, never
    publishes the conversation to every tenant of the salt."""
    points = prompt.breakpoints
    if not points:
        return 0
    marked = [bp.num_tokens for bp in points if bp.shared]
    if marked:
        return max(marked)
    return min(points[0].num_tokens, prompt.system_tokens)


def shared_prefix(prompt: MessagesPrompt, scope: CacheScope) -> SharedPrefix | None:
    """With a shared salt, the declared shared prefix (``shared_tokens``): public to every
    tenant of the salt (as a chat's system messages are)."""
    if scope.shared is None:
        return None
    return scope.prefix(shared_tokens(prompt))


def usage(
    num_prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    breakpoints: tuple[Breakpoint, ...],
    block_size: int,
    caching: bool,
) -> dict:
    """Anthropic's usage. ``cache_read_input_tokens``: the prompt tokens served from the cache
    (every cached prefix counts, breakpoint or not); ``cache_creation_input_tokens``: the
    tokens up to the last breakpoint (whole blocks) that were computed and cached now, split
    by the TTL of the breakpoint each lies before; ``input_tokens``: the rest. The three add
    up to the prompt."""
    created = {"5m": 0, "1h": 0}
    covered = cached_tokens
    if caching:
        for bp in breakpoints:
            end = min(bp.num_tokens, num_prompt_tokens) // block_size * block_size
            if end > covered:
                created[bp.ttl] += end - covered
                covered = end
    creation = sum(created.values())
    return {
        "input_tokens": num_prompt_tokens - cached_tokens - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": created["5m"],
            "ephemeral_1h_input_tokens": created["1h"],
        },
        "output_tokens": output_tokens,
    }


def lease_report(breakpoints: tuple[Breakpoint, ...], grants: tuple | None) -> list[dict]:
    """Our extension field ``cache_leases``: per breakpoint, in order, what its lease got."""
    out = []
    for i, bp in enumerate(breakpoints):
        g = grants[i] if grants is not None and i < len(grants) else None
        entry = {"breakpoint": bp.where, "ttl": bp.ttl, "prompt_tokens": bp.num_tokens}
        if g is None:  # the request ended before its prompt was computed
            entry.update(status="rejected", reason="not_computed", cached_tokens=0,
                         ttl_seconds=0.0)  # fmt: skip
        else:
            entry.update(status=g.status, cached_tokens=g.num_tokens, ttl_seconds=g.ttl_seconds)
            if g.reason is not None:
                entry["reason"] = g.reason
        out.append(entry)
    return out
