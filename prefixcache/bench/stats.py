"""Client-side metrics of a run, defined as ``vllm bench serve`` defines them.

- TTFT: time to the first generated text; TPOT: (latency - TTFT) / (output tokens - 1), over
  requests with more than one output token; ITL: every gap between text chunks; E2EL: latency.
- Throughputs divide by the wall time of the run; goodput counts requests within every SLO given.
- Peak output tok/s counts text chunks in one-second buckets from the first send (as vLLM);
  peak concurrent requests is the most requests in flight at one instant (vLLM counts per
  one-second bucket, which can exceed --max-concurrency).
Times are kept in seconds here and reported in ms.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from prefixcache.bench.client import RequestFuncOutput

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
METRIC_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO {pair!r} is not KEY:MS")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput metric {name!r} is not one of ttft, tpot, e2el")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput SLO {pair!r} is negative")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: list[RequestFuncOutput],
    duration_s: float,
    count_tokens: Callable[[str], int],
    percentiles: list[float],
    goodput_slos: dict[str, float],
) -> tuple[dict, list[int]]:
    """vLLM-named result fields (``completed``, ``mean_ttft_ms``, ``p99_ttft_ms``, ...) and the
    output length of every request (0 for a failed one)."""
    output_lens: list[int] = []
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    total_input = 0
    completed = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        n = out.output_tokens if out.output_tokens is not None else (
            count_tokens(out.generated_text) if out.generated_text else 0)
        output_lens.append(n)
        total_input += out.prompt_len
        tpot = (out.latency - out.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1

    good = 0
    if goodput_slos:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            if all(per_metric[k][i] <= ms / 1000.0 for k, ms in goodput_slos.items()):
                good += 1

    total_output = sum(output_lens)
    peak_tps, peak_conc = _peaks(outputs)
    result: dict = {
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput_slos else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tps,
        "max_concurrent_requests": peak_conc,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(values or [0.0], dtype=np.float64) * 1000.0
        result[f"mean_{name}_ms"] = float(np.mean(arr))
        result[f"median_{name}_ms"] = float(np.median(arr))
        result[f"std_{name}_ms"] = float(np.std(arr))
        for p in percentiles:
            result[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return result, output_lens


def _peaks(outputs: list[RequestFuncOutput]) -> tuple[float, int]:
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t1 = max(o.start_time + o.latency for o in ok)
    buckets = int(np.ceil(t1 - t0)) + 1
    tokens = np.zeros(buckets)
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < buckets:
                tokens[b] += 1
    # Requests in flight at once: a sweep over start (+1) and end (-1) events, ends first on ties.
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return float(tokens.max()), peak
