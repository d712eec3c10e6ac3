"""`prefixcache analyze` without the CLI: log in, summary dict out.

    scan (parallel, ordered) ──▶ LogPass.feed: block trie, ideal hits, roles, killer candidates
                                    │  (memory: distinct blocks + a few numbers per request)
                                    ▼
    finish: compress trie ──▶ LRU curve (all sizes) + LFU/Belady (per size) ──▶ top prefixes,
            killer examples (re-read two lines each), position shares ──▶ summary dict

The summary's keys are documented in docs/analyze.md; ``report.py`` renders it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from prefixcache.analyze import simulate, trie
from prefixcache.analyze.examples import killer_report, top_prefixes
from prefixcache.analyze.logpass import AnalyzeOptions, LogPass, Source
from prefixcache.analyze.reader import Prompt
from prefixcache.analyze.scan import PromptHasher, ScanConfig, Scanned, scan_file, scan_prompts

_DEFAULTS = AnalyzeOptions()  # frozen: one default for every call


def analyze_file(path: str, options: AnalyzeOptions = _DEFAULTS, tokenizer: Any = None):
    jobs = options.jobs
    if jobs <= 0:
        jobs = (os.cpu_count() or 1) if os.path.getsize(path) > (16 << 20) else 1
    if tokenizer is not None:
        jobs = 1  # an object given by the caller lives in this process only
    config = ScanConfig(options.block_size, options.tokenizer, options.killers)
    stream = scan_file(path, config, jobs=jobs, tokenizer=tokenizer)
    return _analyze(stream, Source(path=path), options, config, tokenizer, jobs, str(path))


def analyze_prompts(
    prompts: Iterable[Prompt], options: AnalyzeOptions = _DEFAULTS, tokenizer: Any = None,
    name: str = "<prompts>",
):
    prompts = list(prompts)
    config = ScanConfig(options.block_size, options.tokenizer, options.killers)
    stream = scan_prompts(prompts, config, tokenizer=tokenizer)
    jobs = options.jobs if options.jobs > 0 else 1
    return _analyze(stream, Source(prompts=prompts), options, config, tokenizer, jobs, name)


def _analyze(
    stream: Iterator[Scanned], source: Source, options: AnalyzeOptions, config: ScanConfig,
    tokenizer: Any, jobs: int, name: str,
) -> dict:
    t0 = time.perf_counter()
    kv = _KVLookup(options)  # reads GGUF metadata (seconds) while the log is scanned
    lp = LogPass(options.block_size, options.killers)
    for s in stream:
        lp.feed(s)
    t_scan = time.perf_counter() - t0
    lp.trie.drop_index()
    stages: dict[str, float] = {}
    summary = _summarize(lp, options, jobs, stages)
    summary["kv"] = kv.result()
    bpt = summary["kv"].get("bytes_per_token")
    for point in summary["curve"]:
        point["cache_bytes"] = None if bpt is None else point["cache_tokens"] * bpt
    summary["lru_90pct_bytes"] = None if bpt is None else summary["lru_90pct_tokens"] * bpt
    t_sim = time.perf_counter() - t0 - t_scan
    if options.measure:
        from prefixcache.analyze.measure import measure_prefill, ttft_estimate

        points = measure_prefill(options.model, device=options.device)
        n_tok = np.frombuffer(lp.n_tokens, dtype=np.int64)
        cached = np.frombuffer(lp.known, dtype=np.int32).astype(np.int64) * options.block_size
        summary["ttft"] = ttft_estimate(points, n_tok, cached, options.device)
    hasher = PromptHasher(config, tokenizer)
    summary["top_prefixes"] = top_prefixes(
        lp, summary.pop("_prefix_nodes"), source, hasher, options
    )
    killers, shifted = killer_report(lp, options, source, hasher)
    summary["cache_killers"] = killers
    summary["shared_after_divergence"] = shifted
    summary["source"] = name
    summary["timing_s"] = {
        "scan": round(t_scan, 3),
        "simulate": round(t_sim, 3),
        **{k: round(v, 3) for k, v in stages.items()},
        "total": round(time.perf_counter() - t0, 3),
        "jobs": jobs,
    }
    return summary


class _KVLookup:
    """KV bytes per token of the model, looked up in a background process."""

    def __init__(self, options: AnalyzeOptions) -> None:
        self._fixed = None
        self._future = None
        self._pool = None
        if options.kv_bytes_per_token is not None:
            self._fixed = {"bytes_per_token": int(options.kv_bytes_per_token), "model": None}
            return
        import concurrent.futures as cf
        import multiprocessing as mp

        self._pool = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork"))
        model = options.model or options.tokenizer
        self._future = self._pool.submit(_kv_info, model, options.kv_dtype_bytes)

    def result(self) -> dict:
        if self._fixed is not None:
            return self._fixed
        try:
            return self._future.result()
        finally:
            self._pool.shutdown()


def _kv_info(model: str | None, dtype_bytes: int) -> dict:
    from prefixcache.analyze.model_info import kv_layout

    try:
        layout = kv_layout(model, dtype_bytes)
    except Exception as e:  # noqa: BLE001 - sizes in bytes are optional in the report
        return {"bytes_per_token": None, "error": f"{type(e).__name__}: {e}"[:300]}
    return {
        "model": layout.model,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype_bytes": layout.dtype_bytes,
        "bytes_per_token": layout.bytes_per_token,
    }


def _summarize(lp: LogPass, options: AnalyzeOptions, jobs: int, stages: dict) -> dict:
    """The summary's numbers; ``stages`` gets the seconds of each step."""
    t = time.perf_counter()
    bs = options.block_size
    leaves = np.frombuffer(lp.leaf, dtype=np.int32).astype(np.int64)
    n_tok = np.frombuffer(lp.n_tokens, dtype=np.int64)
    known = np.frombuffer(lp.known, dtype=np.int32).astype(np.int64)
    total = int(n_tok.sum())
    ideal_hits = int(known.sum()) * bs
    parent, depth, _ = lp.trie.arrays()
    n_blocks = len(parent)

    out: dict[str, Any] = {
        "requests": len(leaves),
        "prompt_tokens": total,
        "block_size": bs,
        "malformed": {
            "count": sum(lp.malformed.values()),
            "by_reason": dict(lp.malformed.most_common()),
            "first_lines": lp.malformed_lines,
        },
        "namespaces": len(lp.namespaces),
        "time_span_s": (lp.t_max - lp.t_min) if lp.t_max >= lp.t_min else None,
        "distinct_blocks": n_blocks,
        "ideal_hit_rate": ideal_hits / total if total else 0.0,
        "ideal_saved_tokens": ideal_hits,
        "share_by_role": _shares(lp.role_tokens, total),
        "cached_share_by_role": {
            role: (lp.role_cached[role] / n if n else 0.0) for role, n in lp.role_tokens.items()
        },
        "share_by_position": _position_shares(n_tok, known * bs, total),
    }

    # Hit rate vs size: LRU exact at every size, LFU and Belady at curve_points sizes.
    edges = trie.compress(parent, leaves, depth)
    path, start = trie.request_paths(edges, leaves)
    length = edges.length.tolist()
    stages["compress"], t = time.perf_counter() - t, time.perf_counter()
    hist = simulate.lru_distance_histogram(path, start, length, n_blocks)
    stages["lru"], t = time.perf_counter() - t, time.perf_counter()
    cum = np.concatenate(([0], np.cumsum(hist)))
    full = int(np.flatnonzero(hist)[-1]) + 1 if hist.any() else 0  # LRU == ideal from here
    target = 0.9 * cum[-1]
    lru90 = int(np.searchsorted(cum, target - 1e-9)) if cum[-1] else 0
    caps = _capacities(full, options.curve_points, lru90)
    tasks = [(p, c) for p in ("lfu", "belady") for c in caps]
    bottom_depth = (edges.top_depth + edges.length - 1).tolist()
    nxt = simulate.next_uses(path, start)
    hits = simulate.run_simulations(tasks, path, start, length, bottom_depth, nxt, jobs=jobs)
    by_task = dict(zip(tasks, hits))
    stages["lfu_belady"], t = time.perf_counter() - t, time.perf_counter()
    curve = []
    for c in caps:
        curve.append({
            "cache_tokens": c * bs,
            "lru": _rate(int(cum[min(c, len(cum) - 1)]), bs, total),
            "lfu": _rate(by_task[("lfu", c)], bs, total),
            "belady": _rate(by_task[("belady", c)], bs, total),
        })
    out["curve"] = curve
    out["lru_90pct_tokens"] = lru90 * bs
    out["lru_full_tokens"] = full * bs
    out["_prefix_nodes"] = (edges, trie.subtree_counts(parent, depth, leaves), depth)
    stages["prefixes"] = time.perf_counter() - t
    return out


def _capacities(full: int, points: int, lru90: int) -> list[int]:
    """Cache sizes (blocks) for the curve: geometric up to where LRU reaches the ideal."""
    if full <= 0:
        return [1]
    lo = max(1, full // 1000)
    caps = set(np.unique(np.geomspace(lo, full, points).round().astype(int)).tolist())
    if lru90 > 0:
        caps.add(lru90)
    return sorted(caps)


def _rate(hit_blocks: int, bs: int, total: int) -> float:
    return hit_blocks * bs / total if total else 0.0


def _shares(counter: Counter, total: int) -> dict[str, float]:
    return {k: v / total for k, v in counter.most_common()} if total else {}


def _position_shares(n_tok: np.ndarray, cached: np.ndarray, total: int) -> list[dict]:
    """Prompt tokens and ideal hits by position bucket: [0,256), [256,512), [512,1k), ..."""
    if not total:
        return []
    bounds = [0, 256]
    while bounds[-1] < n_tok.max():
        bounds.append(bounds[-1] * 2)
    out = []
    for a, b in itertools.pairwise(bounds):
        toks = int(np.clip(n_tok - a, 0, b - a).sum())
        hit = int(np.clip(cached - a, 0, b - a).sum())
        if toks:
            out.append({"start": a, "end": b, "share": toks / total, "ideal_hit_rate": hit / toks})
    return out
