"""Per-request TTFT of a closed-loop client over the engine, offline: like vLLM's bench client
with ``--max-concurrency C`` on its prefix_repetition dataset (P random prefixes of L tokens,
each prompt a prefix + S random tokens, N prompts shuffled, 32 tokens out), but driving
``LLMEngine`` step by step in this process, so a scheduling change is measured without a
server. A new request enters when one finishes. Prints each request's prefix, start, TTFT and
latency (seconds), the median TTFT, the hits' median and p90 TTFT (requests under 2 s: their
prefix was cached) and the median TPOT. With PYTHONPATH pointing at another checkout it
measures that build (alternate runs to compare).

    .venv/bin/python benchmarks/closed_loop_ttft.py [--prefixes 4 --prefix-len 4096 --suffix-len 128
        --prompts 16 --concurrency 4] [--model DIR] [--busy-step-ms MS] [--step-log FILE]

``--step-log FILE`` writes every forward's start, wall time and pieces (``[start, n]``: n = 1 is
counted as a decode row, though a prompt's one-token remainder looks the same) as JSON and
prints the time in steps with and without prefill.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--busy-step-ms", type=float, default=None, help="the engine's busy_step_ms (default: its own)")
    ap.add_argument("--step-log", default=None, help="write every forward's wall time and pieces here (JSON)")
    a = ap.parse_args()
    extra = {} if a.busy_step_ms is None else {"busy_step_ms": a.busy_step_ms}
    engine = LLM(model=a.model, kv_cache_memory="4GiB", **extra).engine
    forwards: list = []
    if a.step_log:
        execute = engine.runner.execute

        def logged(pieces):
            t = time.perf_counter()
            out = execute(pieces)
            forwards.append([t, time.perf_counter() - t, [[p.start, p.n] for p in pieces]])
            return out

        engine.runner.execute = logged
    rng = random.Random(7)
    prefixes = [[rng.randrange(100, 40000) for _ in range(a.prefix_len)] for _ in range(a.prefixes)]
    reqs = [(i, prefixes[i] + [rng.randrange(100, 40000) for _ in range(a.suffix_len)])
            for i in range(a.prefixes) for _ in range(a.prompts // a.prefixes)]  # fmt: skip
    rng.shuffle(reqs)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    live: dict[str, list] = {}
    done = []

    def submit(k: int) -> None:
        pid, ids = reqs[k]
        seq = engine.add_request(f"r{k}", ids, params)
        live[f"r{k}"] = [k, pid, time.perf_counter() - t0, seq, None]

    sent = min(a.concurrency, len(reqs))
    for k in range(sent):
        submit(k)
    while live:
        engine.step()
        now = time.perf_counter() - t0
        for rid, entry in list(live.items()):
            k, pid, start, seq, first = entry
            if first is None and seq.out.output_token_ids:
                entry[4] = first = now
            if seq.finished:
                done.append((k, pid, start, first - start, now - start))
                del live[rid]
                if sent < len(reqs):
                    submit(sent)
                    sent += 1
    for k, pid, start, ttft, lat in sorted(done):
        print(f"request {k:3d} prefix {pid} start {start:7.1f} TTFT {ttft:6.2f} latency {lat:6.2f}")
    ttfts = [d[3] for d in done]
    # hits: requests whose prefix was cached when they came (TTFT under 2 s on these hosts)
    hits = sorted(d[3] for d in done if d[3] < 2.0) or [float("nan")]
    tpot = statistics.median((d[4] - d[3]) / 31 for d in done)  # 32 tokens out: 31 after the first
    print(f"median TTFT {statistics.median(ttfts):.2f} s, mean {statistics.mean(ttfts):.2f} s, "
          f"run {time.perf_counter() - t0:.1f} s; hits (TTFT < 2 s): {len(hits)}, median "
          f"{1000 * statistics.median(hits):.0f} ms, p90 {1000 * hits[int(0.9 * len(hits))]:.0f} ms; "
          f"median TPOT {1000 * tpot:.1f} ms")
    if a.step_log:
        Path(a.step_log).write_text(json.dumps(forwards))
        for kind, pick in (("with prefill", True), ("decode only", False)):
            sel = [f for f in forwards if any(n > 1 for _, n in f[2]) == pick]
            rows = sum(1 for f in sel for _, n in f[2] if n == 1)
            tokens = sum(n for f in sel for _, n in f[2] if n > 1)
            print(f"steps {kind}: {len(sel)}, {sum(f[1] for f in sel):.1f} s, {tokens} prompt tokens, "
                  f"{rows} decode rows")


if __name__ == "__main__":
    main()
