"""Tenant isolation figure: a victim tenant's time to first token while another tenant floods the
server, as a ratio to its time to first token alone.

One `prefixcache serve` with two tenants (keys ``sk-victim``, ``sk-flood``) and default limits.

  alone    the victim sends a small streaming completion (a fresh 40-token prompt, 4 tokens) every
           ``--pause`` seconds, ``--samples`` times, on an idle server
  flood    the flooder keeps ``--flood-clients`` requests in flight without pause, each 16 prompts
           x n=8 (128 sequences, its whole share of the queue) of ``--flood-tokens`` tokens; once
           it holds the batch, the victim sends the same requests as alone

TTFT is measured by the client: from sending the request to the first SSE event with text.
Reported: medians (and p90) of each phase, the ratio of the medians, and the flooder's answers
(200 / 429). ``--checkout DIR`` runs the server from another checkout (e.g. a worktree of the
commit before tenant fairness) with the same venv, for the before/after comparison.

    .venv/bin/python benchmarks/tenant_isolation.py
    .venv/bin/python benchmarks/tenant_isolation.py --checkout /tmp/before --out before.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from prefixcache.server.launcher import ServerProcess

KEYS = {"keys": {"sk-victim": "victim", "sk-flood": "flooder"}}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(1000, 30000), k=n)


async def victim_ttft(client: httpx.AsyncClient, rng: random.Random) -> float:
    body = {"prompt": prompt_ids(rng, 40), "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": "Bearer sk-victim"}) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"victim got {r.status_code}: {await r.aread()!r}")
        ttft = None
        async for line in r.aiter_lines():  # read to the end: the request finishes normally
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the victim's stream ended without text")
    return ttft


async def victim_phase(client, rng, samples: int, pause: float) -> list[float]:
    out = []
    for _ in range(samples):
        out.append(await victim_ttft(client, rng))
        await asyncio.sleep(pause)
    return out


async def flood(client: httpx.AsyncClient, rng: random.Random, tokens: int, stop: asyncio.Event,
                codes: list[int]) -> None:  # fmt: skip
    while not stop.is_set():
        body = {"prompt": [prompt_ids(rng, 64) for _ in range(16)], "n": 8, "max_tokens": tokens,
                "ignore_eos": True}  # fmt: skip
        r = await client.post("/v1/completions", json=body,
                              headers={"Authorization": "Bearer sk-flood"})  # fmt: skip
        codes.append(r.status_code)
        if r.status_code == 429:
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))


async def wait_busy(client: httpx.AsyncClient, minimum: int, timeout: float = 600) -> None:
    """Until the flooder holds at least ``minimum`` running sequences (read from /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            running = line.startswith("prefixcache:num_requests_running{")
            if running and float(line.rpartition(" ")[2]) >= minimum:
                return
        await asyncio.sleep(0.5)
    raise RuntimeError("the flood never filled the batch")


async def measure(base_url: str, args) -> dict:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=args.flood_clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        await victim_ttft(client, rng)  # warm-up
        alone = await victim_phase(client, rng, args.samples, args.pause)
        stop, codes = asyncio.Event(), []
        flooders = [asyncio.create_task(flood(client, random.Random(i + 1), args.flood_tokens,
                                              stop, codes)) for i in range(args.flood_clients)]  # fmt: skip
        await wait_busy(client, minimum=64)
        during = await victim_phase(client, rng, args.samples, args.pause)
        stop.set()
        for t in flooders:
            t.cancel()
    return {"alone": alone, "flood": during, "flood_codes": codes}


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--flood-clients", type=int, default=2)
    ap.add_argument("--flood-tokens", type=int, default=32)
    ap.add_argument("--checkout", default=None, help="run the server from this checkout")
    ap.add_argument("--out", default="results/tenant_isolation.json")
    args = ap.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        env = {"OMP_WAIT_POLICY": "PASSIVE"}
        if args.checkout:
            env["PYTHONPATH"] = str(Path(args.checkout).resolve())
        server_args = ["--api-keys-file", str(keys), "--kv-cache-memory", "1GiB"]
        with ServerProcess(server_args, env=env, cwd=args.checkout) as srv:
            result = asyncio.run(measure(srv.base_url, args))
    load_after = os.getloadavg()

    alone, during = statistics.median(result["alone"]), statistics.median(result["flood"])
    codes = result["flood_codes"]
    summary = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "checkout": args.checkout or "this one",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "victim_ttft_alone_median_s": round(alone, 4),
        "victim_ttft_alone_p90_s": round(p90(result["alone"]), 4),
        "victim_ttft_flood_median_s": round(during, 4),
        "victim_ttft_flood_p90_s": round(p90(result["flood"]), 4),
        "ratio_of_medians": round(during / alone, 2),
        "flooder_200": codes.count(200),
        "flooder_429": codes.count(429),
        "flooder_other": len(codes) - codes.count(200) - codes.count(429),
        "args": vars(args),
        "samples": result,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
