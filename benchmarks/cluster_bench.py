"""The cluster's figures (issue 14): prefix-affinity routing vs round robin vs power of two
choices vs one bigger replica, and prefix routing with a shared Redis tier; the time to start a
cluster and the per-request overhead of Ray Serve.

Workload (multi-tenant RAG-like): ``--prefixes`` system prompts of ``--prefix-len`` tokens, each
with ``--questions`` questions of ~``--question-len`` tokens, every (prefix, question) once, in
a shuffled order, ``--concurrency`` requests in flight, ``--max-tokens`` generated. Each replica
gets ``--kv-per-replica`` of KV: sized to hold about half of the prefixes, so a router that
spreads a prefix over both replicas evicts what it needs next.

Ideal hit rate: every prefix computed once, every later request with it hits all its full
blocks: sum over requests but the first of each prefix of (prefix full-block tokens) / prompt
tokens. Measured hit rate: sum of usage.prompt_tokens_details.cached_tokens / prompt tokens.

Usage: .venv/bin/python benchmarks/cluster_bench.py [--out results/cluster_bench.json]
       .venv/bin/python benchmarks/cluster_bench.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiers_bench import Redis

from prefixcache.server.launcher import ServerProcess, free_port

BLOCK = 16


def workload(args) -> list[dict]:
    """Prompts as token ids (exact lengths), shuffled; each tagged with its prefix."""
    rng = random.Random(args.seed)
    vocab = range(1000, 30000)
    prefixes = [[rng.choice(vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    reqs = []
    for p, prefix in enumerate(prefixes):
        for q in range(args.questions):
            question = [rng.choice(vocab) for _ in range(args.question_len + rng.randrange(8))]
            reqs.append({"prefix": p, "plen": len(prefix), "prompt": prefix + question})
    rng.shuffle(reqs)
    return reqs


def ideal_hit_rate(reqs) -> float:
    seen, hit, total = set(), 0, 0
    for r in reqs:
        total += len(r["prompt"])
        if r["prefix"] in seen:
            hit += (r["plen"] // BLOCK) * BLOCK
        seen.add(r["prefix"])
    return hit / total


def one(client, url, r, max_tokens) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": r["prompt"], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, usage = None, None
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if d.get("usage"):
                usage = d["usage"]
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "completion": usage["completion_tokens"]}  # fmt: skip


def run_workload(url, reqs, args) -> dict:
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(args.concurrency) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda r: one(client, url, r, args.max_tokens), reqs))
        wall = time.perf_counter() - t0
    prompt = sum(o["prompt"] for o in outs)
    return {
        "requests": len(outs),
        "wall_s": round(wall, 2),
        "hit_rate": round(sum(o["cached"] for o in outs) / prompt, 4),
        "output_tok_s": round(sum(o["completion"] for o in outs) / wall, 2),
        "total_tok_s": round((prompt + sum(o["completion"] for o in outs)) / wall, 2),
        "req_s": round(len(outs) / wall, 3),
        "ttft_median_ms": round(statistics.median(o["ttft"] for o in outs) * 1000, 1),
        "ttft_p90_ms": round(sorted(o["ttft"] for o in outs)[int(0.9 * len(outs))] * 1000, 1),
    }


def start(command, args_list, timeout=600):
    t0 = time.perf_counter()
    srv = ServerProcess(args_list, command=command, startup_timeout=timeout).start()
    return srv, time.perf_counter() - t0


def cached_ttft(url, n=30) -> float:
    """Median TTFT of one cached prompt (max_tokens 1), sequential."""
    prompt = list(range(1000, 1000 + 256))
    with httpx.Client(timeout=120) as c:
        r = {"prompt": prompt}
        one(c, url, r, 1)
        return statistics.median(one(c, url, r, 1)["ttft"] for _ in range(n)) * 1000


def sglang_router_run(reqs, args, common) -> dict:
    """The plain alternative: two `prefixcache serve` (1 thread each) behind sglang-router's
    cache_aware policy (a Rust binary from PyPI, in its own venv: .bench/sglang-router)."""
    import subprocess

    exe = Path(__file__).resolve().parents[1] / ".bench/sglang-router/bin/python"
    if not exe.exists():
        raise SystemExit("python3 -m venv .bench/sglang-router && .bench/sglang-router/bin/pip install sglang-router")
    servers = [ServerProcess(common + ["--kv-cache-memory", args.kv_per_replica], env={"OMP_NUM_THREADS": "1"}).start()
               for _ in range(2)]  # fmt: skip
    port = free_port()
    router = subprocess.Popen([str(exe), "-m", "sglang_router.launch_router", "--worker-urls",
                               *[s.base_url for s in servers], "--policy", "cache_aware", "--port", str(port),
                               "--prometheus-port", str(free_port())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # sglang-router accepts text prompts only: the same prompts, decoded (each prefix decodes to
    # the same text every time, so the requests sharing it still share its tokens).
    from prefixcache.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    reqs = [{**r, "prompt": tok.decode(r["prompt"])} for r in reqs]
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return run_workload(url, reqs, args)
    finally:
        router.terminate()
        router.wait(30)
        for srv in servers:
            srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-per-replica", default="128MiB", help="holds 11 of the 16 prefixes, with room for the running requests")
    ap.add_argument("--kv-one-replica", default="256MiB", help="the single 2-thread replica's KV (the cluster's total)")
    ap.add_argument("--configs", default="prefix,round_robin,pow2,single,prefix_redis,overhead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.prefixes, args.questions, args.prefix_len, args.configs = 4, 2, 64, "prefix,single"
    reqs = workload(args)
    common = ["--max-model-len", "1024", "--max-num-seqs", "16"]
    results = {"machine": os.uname().nodename, "cpus": os.cpu_count(),
               "load_avg_before": os.getloadavg(), "args": vars(args),
               "ideal_hit_rate": round(ideal_hit_rate(reqs), 4), "runs": {}}  # fmt: skip
    print(f"{len(reqs)} requests, ideal hit rate {results['ideal_hit_rate']}", flush=True)
    for name in args.configs.split(","):
        redis = None
        if name == "sglang_cache_aware":
            results["runs"][name] = sglang_router_run(reqs, args, common)
            print(name, results["runs"][name], flush=True)
            continue
        if name == "single":
            cmd, extra = "serve", ["--kv-cache-memory", args.kv_one_replica]
        elif name == "overhead":
            continue
        else:
            routing = "prefix" if name.startswith("prefix") else name
            cmd, extra = "cluster", ["--replicas", "2", "--threads-per-replica", "1", "--routing", routing,
                                     "--kv-cache-memory", args.kv_per_replica]  # fmt: skip
            if name == "prefix_redis":
                redis = Redis(Path(os.environ.get("TMPDIR", "/tmp")))
                extra += ["--remote-cache", f"redis://127.0.0.1:{redis.port}/0"]
        srv, startup = start(cmd, common + extra)
        try:
            res = run_workload(srv.base_url, reqs, args)
            res["startup_s"] = round(startup, 1)
            results["runs"][name] = res
            print(name, res, flush=True)
        finally:
            srv.stop(timeout=90)
            if redis is not None:
                redis.close()
    if "overhead" in args.configs.split(","):
        # One replica with the machine's cores vs the plain server: the cost of the ingress hop.
        srv, _ = start("serve", common + ["--kv-cache-memory", args.kv_per_replica])
        try:
            direct = cached_ttft(srv.base_url)
        finally:
            srv.stop()
        srv, startup = start("cluster", common + ["--replicas", "1", "--kv-cache-memory", args.kv_per_replica])
        try:
            via = cached_ttft(srv.base_url)
        finally:
            srv.stop(timeout=90)
        results["overhead"] = {"serve_cached_ttft_ms": round(direct, 1),
                               "cluster_cached_ttft_ms": round(via, 1),
                               "ray_overhead_ms": round(via - direct, 1), "cluster1_startup_s": round(startup, 1)}  # fmt: skip
        print("overhead", results["overhead"], flush=True)
    runs = results["runs"]
    if "prefix" in runs and "round_robin" in runs and runs["round_robin"]["hit_rate"]:
        results["prefix_vs_round_robin_hit_rate"] = round(runs["prefix"]["hit_rate"] / runs["round_robin"]["hit_rate"], 2)
    if "prefix" in runs:
        results["prefix_vs_ideal"] = round(runs["prefix"]["hit_rate"] / results["ideal_hit_rate"], 3)
    results["load_avg_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
