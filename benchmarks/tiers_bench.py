"""The KV tiers' figures (issue 13): restart from disk, a replica through Redis, restore vs
prefill throughput, and a workload larger than the RAM pool.

1. Restart: server A (disk + Redis) serves ``--samples`` distinct prompts of ``--prompt-len``
   tokens cold; A is stopped (SIGTERM: queued writes are flushed) and started again; the same
   prompts again: TTFT from disk / cold TTFT (target <= 0.1) and the cached tokens by tier.
2. Replica: server B (Redis only, started with A) serves A's prompts: TTFT / cold TTFT.
3. Restore throughput: tokens per second read and verified from disk and from Redis (the
   servers' own ``restore_tokens_per_second``) and as seen by the client, vs prefill tokens per
   second (prompt tokens / cold TTFT).
4. Larger than RAM (offline engine): ``--groups`` documents of ``--prefix-len`` tokens, each
   asked ``--rounds`` times round-robin, in a ``--memory`` pool that holds a fraction of them:
   hit rate and throughput with RAM only vs RAM + disk.

TTFT is measured by the client: request sent -> first streamed token (max_tokens 1). A real
redis-server is started on a free port (``make install-redis`` installs it).

Usage: .venv/bin/python benchmarks/tiers_bench.py [--out results/tiers_bench.json]
       .venv/bin/python benchmarks/tiers_bench.py --smoke      # tiny sizes: does it run?
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from prefixcache import LLM, SamplingParams
from prefixcache.server.launcher import ServerProcess

ADMIN = {"Authorization": "Bearer sk-bench"}


class Redis:
    def __init__(self, root: Path):
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is missing: run `make install-redis`")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(root),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def ttft(base_url: str, prompt: list[int]) -> tuple[float, dict]:
    """(seconds to the first streamed token, the cache_info of the first event)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_cache_info": True}  # fmt: skip
    t0 = time.perf_counter()
    first, info = None, {}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=ADMIN,
                      timeout=600) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            info = choice.get("cache_info") or info
            if first is None and choice.get("text") is not None:
                first = time.perf_counter() - t0
    return first, info


def tier_stats(base_url: str) -> dict:
    r = httpx.get(base_url + "/v1/cache/stats", headers=ADMIN, timeout=60)
    r.raise_for_status()
    return r.json()["tiers"]


def wait_written(base_url: str, tier: str, blocks: int) -> None:
    deadline = time.monotonic() + 600
    while tier_stats(base_url)[tier]["written_blocks"] < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tier}: {blocks} blocks never written")
        time.sleep(0.2)


def servers_figures(args, tmp: Path) -> dict:
    rng = random.Random(0)
    prompts = [rng.choices(range(1000, 30000), k=args.prompt_len) for _ in range(args.samples)]
    full = (args.prompt_len - 1) // 16 * 16
    redis = Redis(tmp)
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-bench": {"tenant": "bench", "admin": True}}}))
    secret = tmp / "tier-secret"  # the two servers are one deployment: they share the secret
    secret.write_bytes(os.urandom(32))
    common = ["--api-keys-file", str(keys), "--kv-cache-memory", args.server_memory,
              "--max-model-len", str(args.prompt_len + 16), "--remote-cache", redis.url,
              "--tier-secret-file", str(secret)]  # fmt: skip
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    a = ServerProcess([*common, "--disk-cache-dir", str(tmp / "disk")], env=env)
    b = ServerProcess(common, env=env)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.start, (a, b)))
        ttft(a.base_url, rng.choices(range(1000, 30000), k=64))  # warm-up (kernels, caches)
        ttft(b.base_url, rng.choices(range(1000, 30000), k=64))
        cold = [ttft(a.base_url, p)[0] for p in prompts]
        wait_written(a.base_url, "redis", len(prompts) * (args.prompt_len // 16))
        replica = [ttft(b.base_url, p) for p in prompts]
        b_tiers = tier_stats(b.base_url)
        a.stop()
        a.start()
        ttft(a.base_url, rng.choices(range(1000, 30000), k=64))
        restart = [ttft(a.base_url, p) for p in prompts]
        a_tiers = tier_stats(a.base_url)
    finally:
        a.stop()
        b.stop()
        redis.close()
    cold_m = statistics.median(cold)
    disk_m = statistics.median(t for t, _ in restart)
    repl_m = statistics.median(t for t, _ in replica)
    return {
        "prompt_tokens": args.prompt_len,
        "full_block_tokens": full,
        "cold_ttft_s": [round(x, 4) for x in cold],
        "restart_ttft_s": [round(t, 4) for t, _ in restart],
        "replica_ttft_s": [round(t, 4) for t, _ in replica],
        "restart_cached_by_tier": [i.get("cached_tokens_by_tier") for _, i in restart],
        "replica_cached_by_tier": [i.get("cached_tokens_by_tier") for _, i in replica],
        "restart_over_cold": round(disk_m / cold_m, 3),
        "replica_over_cold": round(repl_m / cold_m, 3),
        "prefill_tokens_per_s": round(args.prompt_len / cold_m),
        "disk_restore_tokens_per_s": a_tiers["disk"]["restore_tokens_per_second"],
        "redis_restore_tokens_per_s": b_tiers["redis"]["restore_tokens_per_second"],
        "disk_restore_tokens_per_s_client": round(full / disk_m),
        "redis_restore_tokens_per_s_client": round(full / repl_m),
    }


def larger_than_ram(args, tmp: Path) -> dict:
    rng = random.Random(1)
    docs = [rng.choices(range(1000, 30000), k=args.prefix_len) for _ in range(args.groups)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = {}
    for label, extra in (("ram", {}), ("ram+disk", {"disk_cache_dir": str(tmp / "big")})):
        llm = LLM(kv_cache_memory=args.memory, **extra)
        t0 = time.perf_counter()
        n_prompt = 0
        for r in range(args.rounds):
            for d in docs:  # round-robin over more documents than fit in RAM: LRU keeps none
                q = d + rng.choices(range(1000, 30000), k=16)
                llm.generate([q], params)
                n_prompt += len(q)
        wall = time.perf_counter() - t0
        st = llm.cache_stats()
        out[label] = {
            "hit_rate": round(st["hit_rate"], 3),
            "prompt_tokens_per_s": round(n_prompt / wall),
            "requests_per_s": round(args.rounds * args.groups / wall, 3),
            "pool_tokens": st["capacity_tokens"],
            "tiers": {
                k: {"hit_tokens": v["hit_tokens"], "written_blocks": v["written_blocks"]}
                for k, v in st["tiers"].items()
            },
        }
        del llm
    out["working_set_tokens"] = args.groups * args.prefix_len
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--server-memory", default="512MiB")
    ap.add_argument("--memory", default="256MiB", help="RAM pool of the larger-than-RAM run")
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check that it runs")
    ap.add_argument("--out", default="results/tiers_bench.json")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_len, args.samples, args.server_memory = 200, 2, "64MiB"
        args.memory, args.groups, args.prefix_len, args.rounds = "16MiB", 4, 160, 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        servers = servers_figures(args, Path(tmp))
        big = larger_than_ram(args, Path(tmp))
    summary = {
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "args": vars(args),
        "servers": servers,
        "larger_than_ram": big,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
