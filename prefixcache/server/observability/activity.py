"""Request outcomes per tenant, for the dashboard: what the engine's counters do not say.

The engine counts tokens; an operator also asks how many *requests* hit, whether a hit made the
first token come sooner, why the last requests missed and which prefixes the cache pays off on.
:class:`Activity` records one line per finished engine request (``Run`` calls ``record`` where it
observes the TTFT histogram) and answers those questions for one viewer at a time.

Everything is kept **per tenant**, in bounded structures of that tenant alone: another tenant's
traffic can never push a tenant's records out, change its counts, or show in its view (tenants
are hostile, docs/design.md §9). Tenants come from the keys file, so their number is bounded; a
tenant's namespaces (one per ``cache_salt``) and prefixes are kept LRU-bounded.

A prefix is named by a digest of its namespace and token ids under a key drawn at startup, so
the name identifies a prefix within this server's life and cannot be computed outside it (a
guess at another tenant's prompt cannot be confirmed from a digest). Its excerpt (a few of its
first and last tokens, decoded) is shown only to the tenant whose request it came from; see
``view``.

All methods run on the event loop (``Run`` and the routes): no lock.
"""

from __future__ import annotations

import os
import statistics
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

RECENT_REQUESTS = 256  # per tenant: TTFT percentiles and miss reasons are over these
MAX_PREFIXES = 64  # per tenant, least recently hit dropped first
MAX_NAMESPACES = 64  # per tenant (a tenant can make a namespace per cache_salt)
EXCERPT_HEAD, EXCERPT_TAIL = 12, 6  # tokens decoded for a prefix's excerpt
SHOWN_RECENT, SHOWN_PREFIXES = 20, 10
# Explanations that are no miss: every full block hit (a partial tail block is never cached).
_HITS = ("full_hit", "partial_block")
NOT_EXPLAINED = "not_explained"  # the miss reason of a request that did not ask for one


@dataclass(frozen=True)
class RequestRecord:
    time: float
    tenant: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None
    reason: str | None  # the engine's explanation (CacheExplanation.reason), when asked for
    missed: bool  # some full block of the prompt was not cached


@dataclass
class PrefixUse:
    id: str
    tenant: str
    namespace: str
    tokens: int
    hits: int = 0
    saved_tokens: int = 0
    last_time: float = 0.0
    excerpt: str = ""


@dataclass
class Usage:
    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, r: RequestRecord) -> None:
        self.requests += 1
        self.hit_requests += r.cached_tokens > 0
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens

    def as_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": _ratio(self.cached_tokens, self.prompt_tokens),
                "request_hit_rate": _ratio(self.hit_requests, self.requests)}  # fmt: skip


@dataclass
class _TenantLog:
    total: Usage = field(default_factory=Usage)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    prefixes: OrderedDict = field(default_factory=OrderedDict)  # id -> PrefixUse, LRU order
    namespaces: OrderedDict = field(default_factory=OrderedDict)  # namespace -> Usage, LRU


class Activity:
    """``decode(ids) -> str`` renders excerpts (the server's tokenizer); ``block_size`` tells
    a full hit (every full block but the one holding the last token, which is always computed)
    from a miss when the request carries no explanation."""

    def __init__(self, decode: Callable[[list[int]], str], block_size: int) -> None:
        self._decode = decode
        self._block = block_size
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._tenants: dict[str, _TenantLog] = {}

    def record(
        self,
        tenant: str,
        namespace: str,
        prompt_token_ids: list[int],
        cached_tokens: int,
        ttft: float | None,
        reason: str | None,
        now: float,
    ) -> None:
        """One finished engine request (one choice). ``reason``: its explanation, present
        when the client asked for one (``return_cache_info``): explaining costs the engine a
        scan of the cached siblings of the first missed block, so it is never done unasked."""
        n = len(prompt_token_ids)
        cacheable = max(n - 1, 0) // self._block * self._block
        missed = reason not in _HITS if reason is not None else cached_tokens < cacheable
        r = RequestRecord(now, tenant, namespace, n, cached_tokens, ttft, reason, missed)
        log = self._tenants.setdefault(tenant, _TenantLog())
        log.total.add(r)
        log.recent.append(r)
        _lru(log.namespaces, namespace, MAX_NAMESPACES, Usage).add(r)
        if cached_tokens > 0:
            self._count_prefix(log, r, prompt_token_ids[:cached_tokens])

    def _count_prefix(self, log: _TenantLog, r: RequestRecord, ids: list[int]) -> None:
        h = xxhash.xxh3_64(r.namespace.encode("utf-8"), seed=self._seed)
        h.update(b"\0")
        h.update(array("I", ids).tobytes())
        pid = h.hexdigest()[:12]
        p = _lru(
            log.prefixes,
            pid,
            MAX_PREFIXES,
            lambda: PrefixUse(pid, r.tenant, r.namespace, len(ids), excerpt=self._excerpt(ids)),
        )
        p.hits += 1
        p.saved_tokens += len(ids)
        p.last_time = r.time

    def _excerpt(self, ids: list[int]) -> str:
        try:
            if len(ids) <= EXCERPT_HEAD + EXCERPT_TAIL:
                return _one_line(self._decode(ids))
            head = _one_line(self._decode(ids[:EXCERPT_HEAD]))
            return f"{head} … {_one_line(self._decode(ids[-EXCERPT_TAIL:]))}"
        except Exception:  # noqa: BLE001 - an excerpt is decoration, never an error
            return ""

    def view(self, viewer: str, tenants: Callable[[str], bool]) -> dict:
        """What ``viewer`` may see of the tenants for which ``tenants(name)`` is true (an admin:
        all; anyone else: itself only). A prefix's excerpt is text a tenant sent: it is shown
        to that tenant only, never to another one, admins included (they get its namespace,
        length, hits and digest)."""
        logs = {t: log for t, log in self._tenants.items() if tenants(t)}
        total = Usage()
        for log in logs.values():
            for k, v in log.total.__dict__.items():
                setattr(total, k, getattr(total, k) + v)
        recent = sorted((r for log in logs.values() for r in log.recent), key=lambda r: r.time)
        misses = [r for r in recent if r.missed]
        prefixes = sorted((p for log in logs.values() for p in log.prefixes.values()),
                          key=lambda p: (-p.saved_tokens, -p.last_time))[:SHOWN_PREFIXES]  # fmt: skip
        namespaces: dict[str, Usage] = {}
        for log in logs.values():
            for ns, u in log.namespaces.items():
                agg = namespaces.setdefault(ns, Usage())
                for k, v in u.__dict__.items():
                    setattr(agg, k, getattr(agg, k) + v)
        return {
            "requests": total.as_dict(),
            "ttft": {
                "hit": _summary([r.ttft for r in recent if r.cached_tokens > 0]),
                "miss": _summary([r.ttft for r in recent if r.cached_tokens == 0]),
            },
            "miss_reasons": dict(Counter(r.reason or NOT_EXPLAINED for r in misses).most_common()),
            "recent_misses": [_record(r) for r in reversed(misses[-SHOWN_RECENT:])],
            "top_prefixes": [_prefix(p, p.tenant == viewer) for p in prefixes],
            "namespaces": {ns: u.as_dict() for ns, u in sorted(namespaces.items())},
            "tenants": {t: log.total.as_dict() for t, log in sorted(logs.items())},
        }


def _lru(d: OrderedDict, key, bound: int, make: Callable):
    """``d[key]``, made if missing and moved to the end; the oldest go past ``bound``."""
    v = d.get(key)
    if v is None:
        v = d[key] = make()
        while len(d) > bound:
            d.popitem(last=False)
    else:
        d.move_to_end(key)
    return v


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _summary(xs: list[float | None]) -> dict:
    v = sorted(x for x in xs if x is not None)
    if not v:
        return {"count": 0, "p50": None, "p90": None, "mean": None}
    return {"count": len(v), "p50": statistics.median(v), "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
            "mean": statistics.fmean(v)}  # fmt: skip


def _record(r: RequestRecord) -> dict:
    return {"time": r.time, "namespace": r.namespace, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "reason": r.reason}  # fmt: skip


def _prefix(p: PrefixUse, own: bool) -> dict:
    return {"id": p.id, "namespace": p.namespace, "tokens": p.tokens, "hits": p.hits,
            "saved_tokens": p.saved_tokens, "last_time": p.last_time,
            "excerpt": p.excerpt if own else None}  # fmt: skip
