"""How fast is `prefixcache analyze` on a large token-id log?

Generates (once, cached under /tmp) a deterministic log of N requests of 2,000 tokens on average,
token ids given, with the shared structure of real traffic, then times the whole analysis
(scan + hash + trie + LRU/LFU/Belady curves + report data), as `prefixcache analyze` runs it:

- 10 system prompts (150-600 tokens, Zipf popularity);
- RAG, 55%: system prompt + one of 400 documents (600-1,200 tokens, Zipf 1.1) + a unique
  question filling the prompt to exactly 2,000 tokens;
- chat, 30%: sessions of 5 turns of 1,200/1,600/2,000/2,400/2,800 tokens, each turn's prompt
  extending the previous one (history + new message), sessions interleaved;
- 10% unique prompts after a system prompt; 5% with a timestamp 12 tokens into system prompt 0
  (a planted cache killer).

    .venv/bin/python benchmarks/analyze_bench.py                    # 100,000 requests
    .venv/bin/python benchmarks/analyze_bench.py --requests 10000   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixcache.analyze.analyzer import AnalyzeOptions, analyze_file
from prefixcache.analyze.report import text_summary

VERSION = 1
VOCAB = (100, 49_000)
TURN_LENS = (1200, 1600, 2000, 2400, 2800)


def generate(path: Path, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def toks(k: int) -> np.ndarray:
        return rng.integers(*VOCAB, size=k, dtype=np.int64)

    systems = [toks(int(k)) for k in rng.integers(150, 601, size=10)]
    sys_p = 1 / np.arange(1, 11)
    sys_p /= sys_p.sum()
    docs = [toks(int(k)) for k in rng.integers(600, 1201, size=400)]
    doc_p = 1 / np.arange(1, 401) ** 1.1
    doc_p /= doc_p.sum()
    active: list[list] = []  # [system, transcript, next turn]
    kinds = rng.choice(4, size=n, p=[0.55, 0.30, 0.10, 0.05])
    counts = {"rag": 0, "chat": 0, "unique": 0, "timestamp": 0}
    total = 0
    with open(path, "w") as f:
        for i, kind in enumerate(kinds.tolist()):
            if kind == 1:
                if len(active) < 200 or rng.random() < 0.05:
                    s = systems[rng.choice(10, p=sys_p)]
                    active.append([s, toks(TURN_LENS[-1] - len(s)), 0])
                j = int(rng.integers(len(active)))
                s, transcript, turn = active[j]
                ids = np.concatenate([s, transcript[: TURN_LENS[turn] - len(s)]])
                active[j][2] += 1
                if active[j][2] == len(TURN_LENS):
                    active.pop(j)
                counts["chat"] += 1
            else:
                s = systems[rng.choice(10, p=sys_p)]
                if kind == 3:  # "Current time: 2024-05-01 10:32:11" 12 tokens in
                    stamp = np.array([7001, 7002, 7100 + i % 60, 7200 + (i // 60) % 60, 7300 + i])
                    s = np.concatenate([systems[0][:12], stamp, systems[0][12:]])
                    counts["timestamp"] += 1
                if kind in (0, 3):
                    parts = [s, docs[rng.choice(400, p=doc_p)]]
                    counts["rag"] += kind == 0
                else:
                    parts = [s]
                    counts["unique"] += 1
                used = sum(len(p) for p in parts)
                ids = np.concatenate(parts + [toks(2000 - used)])
            total += len(ids)
            f.write('{"prompt_token_ids":[')
            f.write(",".join(map(str, ids.tolist())))
            f.write(f'],"timestamp":{1_700_000_000 + i * 0.05:.2f}}}\n')
    return {"requests": n, "tokens": total, "kinds": counts}


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the worker pools)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=0, help="0: one per core")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--log", default=None, help="log path (default: cached under /tmp)")
    ap.add_argument("--model", default=None, help="for KV bytes/token (default model)")
    ap.add_argument("--out", default=None, help="write the timings and summary as JSON here")
    args = ap.parse_args()

    log = Path(args.log or f"/tmp/prefixcache_analyze_bench_v{VERSION}_{args.requests}.jsonl")
    meta_path = log.with_suffix(".meta.json")
    if not (log.is_file() and meta_path.is_file()):
        t0 = time.perf_counter()
        meta = generate(log, args.requests)
        meta_path.write_text(json.dumps(meta))
        print(f"generated {log} ({log.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.0f} s: {meta}")
    meta = json.loads(meta_path.read_text())

    jobs = args.jobs or os.cpu_count() or 1
    options = AnalyzeOptions(jobs=jobs, model=args.model)
    times, cpu, summary = [], [], None
    for _ in range(args.repeats):
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        summary = analyze_file(str(log), options)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_seconds() - c0)
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(text_summary(summary))
    result = {
        "requests": meta["requests"],
        "prompt_tokens": meta["tokens"],
        "log_bytes": log.stat().st_size,
        "jobs": jobs,
        "seconds": times,
        "median_s": statistics.median(times),
        "cpu_s": [round(c, 1) for c in cpu],  # all processes: main, scan workers, simulations
        "load_avg_1min_after": round(os.getloadavg()[0], 2),
        "timing_s": summary["timing_s"],
        "distinct_blocks": summary["distinct_blocks"],
        "peak_rss_mib": {"main": round(rss_self), "largest_worker": round(rss_kids)},
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "ideal_hit_rate": summary["ideal_hit_rate"],
        "lru_90pct_tokens": summary["lru_90pct_tokens"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": result, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
