"""Live replay of a Mooncake trace window against the simulator, per eviction policy.

For each ``--eviction-policy``: start ``prefixcache serve`` with a KV pool of exactly the
simulated size (``--cache-fraction`` of the window's working set, in blocks of
``--block-tokens``), replay the window with ``prefixcache bench serve --dataset-name
mooncake-trace`` one request at a time with one output token, and put the server's hit rate
(its own counters, ``prefix_cache_hit_rate``) next to

- ``engine``: the simulator replaying the window through the engine's cache core
  (``prefixcache analyze --trace-format mooncake --engine-model``: partial tails never shared,
  hits at most len - 1 tokens, the request's blocks held while it runs), and
- ``trace``: the trace model of the issue (``analyze --trace-format mooncake``),

with the TTFT distribution of the run. The replay's conditions remove what the engine-model
simulation leaves out: generated blocks (one output token: its KV is never computed) and
overlapping requests (``--max-concurrency 1``).

``--scheduling-policy fcfs,lpm,sjf --time-scale S --max-concurrency N`` compares scheduling
policies instead: the window's requests arrive at their trace times divided by S, up to N at
once, so a queue forms and its order matters (the engine model then no longer applies:
requests overlap); TTFT percentiles and throughput per policy.

Usage (docs/benchmarks-journal.md "Real traces: eviction" has the recorded run):
  PYTHONPATH=. .venv/bin/python benchmarks/trace_replay.py TRACE --start-s 928.334 \\
      --requests 300 --block-tokens 8 --cache-fraction 0.2 --eviction-policy lru,hit-density
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import servers  # benchmarks/servers.py

from prefixcache.analyze.engine_sim import simulate_engine, trace_prompts
from prefixcache.analyze.trace_sim import capacity_for, simulate_trace
from prefixcache.bench.mooncake import infinite_hit_rate, read_trace, working_set_blocks

BYTES_PER_TOKEN = 46080  # the default model's float32 KV (checked against the server's pool)


def replay(args, policy: str, blocks: int, out: Path, scheduling: str = "fcfs") -> dict:
    port = servers.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port),
           "--kv-cache-memory", str(blocks * args.block_tokens * BYTES_PER_TOKEN),
           "--block-size", str(args.block_tokens), "--eviction-policy", policy,
           "--scheduling-policy", scheduling,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    tag = policy if scheduling == "fcfs" else f"{policy}-{scheduling}"
    server = servers.start(f"serve-{tag}", cmd, url, out / f"server-{tag}.log")
    try:
        servers.wait_ready(server, timeout=args.start_timeout)
        stats = httpx.get(f"{url}/v1/cache/stats", timeout=10).json()
        if stats["total_blocks"] != blocks:
            raise RuntimeError(f"the server's pool has {stats['total_blocks']} blocks, "
                               f"not {blocks}: fix BYTES_PER_TOKEN")
        name = f"replay-{tag}.json"
        bench = [sys.executable, "-m", "prefixcache.cli", "bench", "serve", "--base-url", url,
                 "--dataset-name", "mooncake-trace", "--dataset-path", args.trace,
                 "--trace-start-s", str(args.start_s), "--num-prompts", str(args.requests),
                 "--block-tokens", str(args.block_tokens), "--time-scale", str(args.time_scale),
                 "--max-concurrency", str(args.max_concurrency), "--ready-check-timeout-sec", "0",
                 "--extra-body", json.dumps({"max_tokens": 1, "max_completion_tokens": 1}),
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
                 "--save-result", "--result-dir", str(out), "--result-filename", name,
                 "--label", tag, "--disable-tqdm"]
        t0 = time.monotonic()
        with (out / f"bench-{tag}.log").open("w") as log:
            servers.subprocess.run(bench, check=True, stdout=log, stderr=log, cwd=servers.ROOT)
        wall = time.monotonic() - t0
        after = httpx.get(f"{url}/v1/cache/stats", timeout=10).json()
    finally:
        servers.stop(server)
    r = json.loads((out / name).read_text())
    return {"live": r["prefix_cache_hit_rate"], "completed": r["completed"],
            "evicted_blocks": after.get("evicted_blocks"), "wall_s": round(wall, 1),
            "request_throughput": round(r["request_throughput"], 3),
            "ttft_ms": {k: round(r[f"{k}_ttft_ms"], 1) for k in ("mean", "median", "p90", "p99")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--start-s", type=float, default=0.0, help="window start, trace seconds")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--block-tokens", type=int, default=8)
    ap.add_argument("--cache-fraction", type=float, default=0.2)
    ap.add_argument("--eviction-policy", default="lru,hit-density")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--scheduling-policy", default="fcfs", help="comma-separated: fcfs,lpm,sjf")
    ap.add_argument("--time-scale", type=float, default=1e9,
                    help="arrivals at trace time / this (default: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default="results/trace_replay")
    ap.add_argument("--simulate-only", action="store_true", help="no server: the simulations")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = read_trace(args.trace, args.requests, start_ms=args.start_s * 1000 or None)
    ws = working_set_blocks(reqs)
    blocks = capacity_for(args.cache_fraction, ws)
    prompts = trace_prompts(reqs, args.block_tokens)
    summary: dict = {"trace": args.trace, "start_s": args.start_s, "requests": len(reqs),
                     "block_tokens": args.block_tokens, "working_set_blocks": ws,
                     "cache_fraction": args.cache_fraction, "blocks": blocks,
                     "infinite": round(infinite_hit_rate(reqs), 4), "policies": {}}
    for policy in args.eviction_policy.split(","):
        sim = {"trace": round(simulate_trace(reqs, policy, blocks).hit_rate, 4),
               "engine": round(simulate_engine(reqs, policy, blocks, args.block_tokens,
                                               args.max_num_batched_tokens, prompts).hit_rate, 4)}
        for scheduling in args.scheduling_policy.split(","):
            row = dict(sim)
            if not args.simulate_only:
                row.update(replay(args, policy, blocks, out, scheduling))
                row["live - engine"] = round(row["live"] - row["engine"], 4)
                row["live - trace"] = round(row["live"] - row["trace"], 4)
            tag = f"{policy}/{scheduling}" if "," in args.scheduling_policy else policy
            summary["policies"][tag] = row
            print(tag, json.dumps(row), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
