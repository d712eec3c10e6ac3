"""Where a prefix-cache hit's time goes: TTFT of 50 new tokens over a cached prefix, and the
kernels' self time in it (torch.profiler): attention vs the linear layers. Default model,
offline, one run per prefix length (docs/benchmarks-journal.md "Where a hit's time goes now").

Usage: .venv/bin/python benchmarks/hit_time_split.py [--contexts 2000,8000] [--new 50] [--json results/hit_time_split.json]
       (--contexts 0 --new 1000: a cold prefill of 1,000 tokens)
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2000,8000")
    ap.add_argument("--new", type=int, default=50, help="new tokens after the cached prefix")
    ap.add_argument("--json", default="results/hit_time_split.json")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="1GiB", kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        salt = f"split-{ctx}-{os.urandom(4).hex()}"
        prefix = [rng.randrange(100, 40000) for _ in range(ctx)]
        q = [rng.randrange(100, 40000) for _ in range(args.new)]
        if ctx:
            llm.generate([prefix + [7]], one, cache_salt=salt)  # the prefix cached
        # warm-up: a hit on the cached prefix, or (cold) a short prompt in another namespace
        llm.generate([prefix + q[:10]], one, cache_salt=salt if ctx else salt + "-warm-up")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = llm.generate([prefix + q], one, cache_salt=salt)[0]
        self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        row = {
            "cached_prefix": ctx,
            "new_tokens": args.new,
            "num_cached_tokens": out.num_cached_tokens,
            "ttft_ms": (out.metrics.first_token_time - out.metrics.arrival_time) * 1e3,
            "attention_ms": sum(v for k, v in self_ms.items() if "paged_attention" in k),
            "linear_ms": sum(
                v for k, v in self_ms.items() if "int4_linear" in k or "int8_linear" in k
            ),
        }
        row["other_ms"] = row["ttft_ms"] - row["attention_ms"] - row["linear_ms"]
        rows.append(row)
        print(
            json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
            flush=True,
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"load_average_at_end": os.getloadavg(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
