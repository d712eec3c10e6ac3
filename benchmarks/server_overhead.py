"""HTTP overhead of `prefixcache serve`: time to first token through the server minus the offline
``LLM`` API, for the same prompt served from the prefix cache.

Both run side by side on the same model and config, alternating request by request (only one is
busy at a time), after one warm-up request each caches the prompt:

  server   streaming POST /v1/completions (max_tokens=1) over a kept-alive connection; time from
           sending the request to the first SSE event that carries text
  offline  LLM.generate(prompt, max_tokens=1) in this process; wall time of the call

The server path adds HTTP parsing, JSON, tokenization in the request handler, the hop to the
engine thread and back, and SSE framing. Reported: medians, p90s and the median of the paired
differences, in milliseconds.

    .venv/bin/python benchmarks/server_overhead.py --runs 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx
import torch

from prefixcache import LLM, SamplingParams
from prefixcache.server.launcher import ServerProcess

PROMPT = (
    "You are a careful assistant for a library. Answer in one short sentence, name the shelf "
    "where a book stands, and never invent titles that the catalogue does not list. The "
    "catalogue: Dune stands on shelf 4, Emma on shelf 9, Ulysses is lent out until Friday. "
    "Question: where does Dune stand?"
)


def server_ttft(client: httpx.Client, body: dict) -> float:
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to [DONE], so the connection is reused
            is_event = first is None and line.startswith("data: {")
            if is_event and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first


def offline_ttft(llm: LLM, params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate(PROMPT, params)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (OMP_NUM_THREADS for the server)",
    )
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args(argv)

    config = ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", "4"]
    # Both sides compute with the same number of threads, or the difference measures the thread
    # count rather than HTTP (on a busy 2-core machine, 2 OpenMP threads can be 5x slower than 1).
    torch.set_num_threads(args.threads)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    llm = LLM(kv_cache_memory=args.kv_cache_memory, max_num_seqs=4)
    params = SamplingParams(max_tokens=1, temperature=0)
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    server_s, offline_s, cached = [], [], []
    with (
        ServerProcess(config, env=env) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as client,
    ):
        server_ttft(client, body)  # warm-up: caches the prompt, opens the connection
        offline_ttft(llm, params)
        for i in range(args.runs):
            # Alternate which goes first, so drift in machine load hits both alike.
            if i % 2:
                offline, n = offline_ttft(llm, params)
                served = server_ttft(client, body)
            else:
                served = server_ttft(client, body)
                offline, n = offline_ttft(llm, params)
            server_s.append(served)
            offline_s.append(offline)
            cached.append(n)
        stats = httpx.get(srv.base_url + "/v1/cache/stats").json()

    diff = [a - b for a, b in zip(server_s, offline_s, strict=True)]
    ms = 1000.0
    result = {
        "runs": args.runs,
        "threads": args.threads,
        "prompt_tokens": len(llm.get_tokenizer().encode(PROMPT)),
        "offline_cached_tokens_median": statistics.median(cached),
        "server_hit_rate": stats["hit_rate"],
        "server_ttft_ms": {"median": statistics.median(server_s) * ms, "p90": pct(server_s, 0.9) * ms},
        "offline_ttft_ms": {"median": statistics.median(offline_s) * ms, "p90": pct(offline_s, 0.9) * ms},
        "overhead_ms": {"median": statistics.median(diff) * ms, "p90": pct(diff, 0.9) * ms},
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
