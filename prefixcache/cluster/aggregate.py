"""Merge the replicas' answers into the cluster's: ``/v1/cache/stats`` JSON and ``/metrics`` text.

Stats: counts and sizes add up; geometry that is the same everywhere (block size, bytes per
token, dtype) is kept once; rates are recomputed from their parts where the parts are there
(``hit_rate`` = hit_tokens / query_tokens, or a tenant's hits / prompt tokens), otherwise averaged. Each replica's own answer is kept
under ``replicas``. Metrics: every replica's samples get a ``replica`` label (its rank), grouped
by family so the exposition stays valid; sum over ``replica`` in PromQL for the cluster total.
"""

from __future__ import annotations

import re

# Same on every replica by construction: kept once, never summed.
_SAME = {"block_size", "bytes_per_token", "kv_cache_dtype", "enable_prefix_caching", "model",
         "dtype", "device", "max_model_len"}  # fmt: skip
_RATIO = re.compile(r"(rate|perc|ratio|fraction|_per_\w+)$")


def merge_values(key: str, values: list):
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: merge_values(k, [v.get(k) for v in values]) for k in keys}
    if isinstance(first, (bool, str)) or key in _SAME:
        return first if all(v == first for v in values) else values
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if _RATIO.search(key):
            return sum(values) / len(values)
        return sum(values)
    return values


def merge_stats(per_replica: list[tuple[dict, dict]]) -> dict:
    """``per_replica``: (replica info, its stats body) pairs. The totals plus ``replicas``."""
    bodies = [b for _, b in per_replica]
    out = merge_values("", bodies) if bodies else {}
    _recompute_hit_rate(out)
    out["replicas"] = [{"replica": info["rank"], "replica_id": info["replica_id"],
                        "pid": info["pid"], "node": info["node"], **body}
                       for info, body in per_replica]  # fmt: skip
    return out


def _recompute_hit_rate(d) -> None:
    if not isinstance(d, dict):
        return
    for query, hit in (("query_tokens", "hit_tokens"), ("prompt_tokens_total", "prefix_cache_hits_total"),
                       ("prompt_tokens", "cached_tokens")):  # the last: per prompt_cache_key
        if "hit_rate" in d and isinstance(d.get(query), int) and isinstance(d.get(hit), int):
            d["hit_rate"] = d[hit] / d[query] if d[query] else 0.0
    for v in d.values():
        _recompute_hit_rate(v)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(.*)$")


def merge_metrics(per_replica: list[tuple[str, str]]) -> str:
    """``per_replica``: (replica label, exposition text) pairs, in replica order."""
    families: dict[str, dict] = {}  # family name -> {"meta": [lines], "samples": [lines]}
    for label, text in per_replica:
        current = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], {"meta": [], "samples": []})
                    if line not in current["meta"]:
                        current["meta"].append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.groups()
            fam = current if current is not None else families.setdefault(name, {"meta": [], "samples": []})
            inner = labels[1:-1] if labels else ""
            extra = f'replica="{label}"'
            fam["samples"].append(f"{name}{{{extra}{',' + inner if inner else ''}}} {value}")
    lines: list[str] = []
    for fam in families.values():
        lines += fam["meta"] + fam["samples"]
    return "\n".join(lines) + "\n"
