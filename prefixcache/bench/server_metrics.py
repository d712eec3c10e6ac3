"""The server's prefix-cache hit rate, from its Prometheus ``/metrics`` counters.

Read before and after a run; the hit rate of the run is Δhits / Δqueries (in tokens, as vLLM and
our server count them). Counters are looked up under our ``prefixcache:`` names first, then vLLM's
``vllm:`` names, each with or without the ``_total`` suffix, summed over label sets (vLLM labels by
engine and model). A server that exposes neither gives ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

SOURCES = ("prefixcache", "vllm")


@dataclass(frozen=True)
class CacheCounters:
    source: str  # "prefixcache" or "vllm"
    queries: float
    hits: float


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets; comments and malformed lines skipped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        values[name.strip()] = values.get(name.strip(), 0.0) + value
    return values


def cache_counters(samples: dict[str, float]) -> CacheCounters | None:
    for source in SOURCES:
        q = _counter(samples, f"{source}:prefix_cache_queries")
        h = _counter(samples, f"{source}:prefix_cache_hits")
        if q is not None and h is not None:
            return CacheCounters(source, q, h)
    return None


def _counter(samples: dict[str, float], base: str) -> float | None:
    for name in (f"{base}_total", base):
        if name in samples:
            return samples[name]
    return None


async def read_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict
) -> CacheCounters | None:
    """The counters now, or None when the server has no /metrics or none of the names."""
    try:
        resp = await client.get(f"{base_url}/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return cache_counters(parse_prometheus(resp.text))


def hit_rate(before: CacheCounters | None, after: CacheCounters | None) -> dict:
    """JSON fields for the run: source, Δqueries, Δhits, and hits/queries (0.0 when the counters
    exist but the run made no queries, as a server with caching off may; None without them)."""
    if before is None or after is None or before.source != after.source:
        return {"prefix_cache_metrics_source": None, "prefix_cache_queries": None,
                "prefix_cache_hits": None, "prefix_cache_hit_rate": None}
    dq, dh = after.queries - before.queries, after.hits - before.hits
    return {
        "prefix_cache_metrics_source": after.source,
        "prefix_cache_queries": dq,
        "prefix_cache_hits": dh,
        "prefix_cache_hit_rate": (dh / dq) if dq > 0 else 0.0,
    }
