"""The report's examples: top shared prefixes and cache killers, with excerpts.

The log pass keeps only hashes and a few numbers per request; for the handful of requests the
report shows, their prompts are read back from the log (``Source``) and re-tokenized here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.analyze.killers import divergence
from prefixcache.analyze.logpass import AnalyzeOptions, LogPass, Source
from prefixcache.analyze.reader import MalformedLine
from prefixcache.analyze.scan import PromptHasher


def _tokens_of(source: Source, hasher: PromptHasher, lp: LogPass, r: int) -> list[int] | None:
    try:
        p = source.prompt(lp.line[r], lp.offset[r], lp.sub[r])
        ids, _ = hasher.token_ids(p)
    except (MalformedLine, OSError, IndexError):
        return None
    return ids


def _excerpt(hasher: PromptHasher, ids: list[int], a: int, b: int, decode: bool) -> str:
    a, b = max(0, a), min(len(ids), b)
    if decode:
        try:
            return hasher.tokenizer().decode(ids[a:b])
        except Exception:  # noqa: BLE001, S110 - an excerpt is a nicety; fall back to ids
            pass
    return "[" + " ".join(map(str, ids[a:b])) + "]"


def _can_decode(lp: LogPass, options: AnalyzeOptions, hasher: PromptHasher) -> bool:
    # Token-id logs may come from any tokenizer: decode only when asked or when text was read.
    return options.tokenizer is not None or hasher._tok is not None or (
        "unknown" not in lp.role_tokens
    )


def top_prefixes(
    lp: LogPass, nodes: tuple, source: Source, hasher: PromptHasher, options: AnalyzeOptions
) -> list[dict]:
    edges, counts, depth = nodes
    bs = lp.block_size
    bottoms = edges.bottom
    c = counts[bottoms]
    keep = c >= 2
    bottoms, c = bottoms[keep], c[keep]
    length = (depth[bottoms].astype(np.int64) + 1) * bs
    saved = (c - 1) * length
    order = np.argsort(-saved, kind="stable")[: options.top_k]
    n_req = max(1, len(lp.leaf))
    total = max(1, sum(lp.n_tokens))
    _, _, creator = lp.trie.arrays()
    decode = _can_decode(lp, options, hasher)
    out = []
    for k in order.tolist():
        node = int(bottoms[k])
        first = int(creator[node])
        entry = {
            "tokens": int(length[k]),
            "requests": int(c[k]),
            "request_share": int(c[k]) / n_req,
            "saved_tokens": int(saved[k]),
            "saved_share": int(saved[k]) / total,
            "first_line": int(lp.line[first]),
        }
        ids = _tokens_of(source, hasher, lp, first)
        if ids is not None:
            n = int(length[k])
            entry["head"] = _excerpt(hasher, ids, 0, min(n, 24), decode)
            entry["tail"] = _excerpt(hasher, ids, max(0, n - 24), n, decode)
        out.append(entry)
    return out


VOLATILE_MAX_TOKENS = 64  # a differing span up to this long is "volatile" (a stamp, a name)


def killer_report(
    lp: LogPass, options: AnalyzeOptions, source: Source, hasher: PromptHasher
) -> tuple[list[dict], list[dict]]:
    """``(cache killers, shared content after a different prefix)``, largest loss first.

    A group whose example pair realigns after a short differing span is a cache killer (the
    fix: move that span after the stable part). Otherwise the prompts share content behind
    genuinely different prefixes (documents after different system prompts): reordering or
    position-independent caching would be needed to reuse it.
    """
    if lp.killers is None:
        return [], []
    total = max(1, sum(lp.n_tokens))
    decode = _can_decode(lp, options, hasher)
    killers, shifted = [], []
    # Groups whose examples diverge at the same token after the same text are one pattern
    # (a dated and an undated prompt can be either side of a pair): merged.
    merged: dict[tuple, dict] = {}
    for g in lp.killers.top(4 * options.top_k):
        r, q = g.example
        a, b = _tokens_of(source, hasher, lp, r), _tokens_of(source, hasher, lp, q)
        entry: dict[str, Any] = {
            "requests": g.requests,
            "lost_tokens": round(g.lost_tokens),
            "lost_share": g.lost_tokens / total,
            "example_lines": [int(lp.line[r]), int(lp.line[q])],
        }
        volatile = None
        if a is not None and b is not None:
            d = divergence(a, b)
            if d.shared_after < max(2 * lp.block_size, 0.1 * len(a)):
                continue  # the sampled features overestimated what this pair shares
            same = merged.get((d.position, tuple(a[max(0, d.position - 8) : d.position])))
            if same is not None:
                same["requests"] += g.requests
                same["lost_tokens"] += round(g.lost_tokens)
                same["lost_share"] += g.lost_tokens / total
                continue
            merged[(d.position, tuple(a[max(0, d.position - 8) : d.position]))] = entry
            if d.resync is not None:
                volatile = max(d.resync, d.other_resync) - d.position
            span = 24 if volatile is None else min(volatile, 24)
            entry.update(
                divergence_token=d.position,
                resync_token=d.resync,
                volatile_tokens=volatile,
                excerpt=_excerpt(hasher, a, d.position - 8, d.position + span + 8, decode),
                other_excerpt=_excerpt(hasher, b, d.position - 8, d.position + span + 8, decode),
                suggestion=_suggestion(d.position, volatile),
            )
        if volatile is not None and volatile <= VOLATILE_MAX_TOKENS:
            killers.append(entry)
        else:
            shifted.append(entry)
    order = {"key": lambda e: -e["lost_tokens"]}
    return sorted(killers, **order)[: options.top_k], sorted(shifted, **order)[: options.top_k]


def _suggestion(position: int, volatile: int | None) -> str:
    if volatile is not None and volatile <= VOLATILE_MAX_TOKENS:
        return (
            f"{volatile} volatile tokens at position {position} (a timestamp, name or id?) make "
            "everything after them uncacheable: move them after the stable part of the prompt"
        )
    return (
        f"prompts diverge at token {position} but share content later: put the shared part "
        "(system prompt, documents) first and per-request content last"
    )
