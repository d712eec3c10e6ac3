"""The console report and the result JSON of ``bench serve``, in ``vllm bench serve``'s format,
with a prefix-cache section added (cached tokens from usage, the server's hit rate)."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from prefixcache.bench.stats import METRIC_HEADERS, METRIC_NAMES, percentile_key

# Per-request lists: kept only with --save-detailed, as in vLLM (plus our cached_tokens).
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                   "cached_tokens", "start_times", "latencies")


def _line(label: str, value, fmt: str = "") -> str:
    if value is None:
        return "{:<40} {:<10}".format(label, "n/a")
    return ("{:<40} {:<10" + fmt + "}").format(label, value)


def print_report(result: dict, selected_metrics: list[str], percentiles: list[float]) -> None:
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(_line("Successful requests:", result["completed"]))
    print(_line("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        print(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        print(_line("Request rate configured (RPS):", result["request_rate"], ".2f"))
    print(_line("Benchmark duration (s):", result["duration"], ".2f"))
    print(_line("Total input tokens:", result["total_input_tokens"]))
    print(_line("Total generated tokens:", result["total_output_tokens"]))
    print(_line("Request throughput (req/s):", result["request_throughput"], ".2f"))
    if result.get("request_goodput") is not None:
        print(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
    print(_line("Output token throughput (tok/s):", result["output_throughput"], ".2f"))
    print(_line("Peak output token throughput (tok/s):",
                result["max_output_tokens_per_s"], ".2f"))
    print(_line("Peak concurrent requests:", result["max_concurrent_requests"], ".2f"))
    print(_line("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f"))
    for name in METRIC_NAMES:
        if name not in selected_metrics:
            continue
        label = METRIC_NAMES[name]
        print("{s:{c}^{n}}".format(s=METRIC_HEADERS[name], n=50, c="-"))
        print(_line(f"Mean {label} (ms):", result[f"mean_{name}_ms"], ".2f"))
        print(_line(f"Median {label} (ms):", result[f"median_{name}_ms"], ".2f"))
        for p in percentiles:
            key = percentile_key(p)
            print(_line(f"P{key} {label} (ms):", result[f"p{key}_{name}_ms"], ".2f"))
    print("{s:{c}^{n}}".format(s="Prefix Cache", n=50, c="-"))
    print(_line("Cached prompt tokens (usage):", result.get("total_cached_tokens")))
    rate = result.get("cached_token_rate")
    print(_line("Cached token rate (usage):", None if rate is None else f"{rate:.2%}"))
    hr = result.get("prefix_cache_hit_rate")
    src = result.get("prefix_cache_metrics_source")
    print(_line(f"Server hit rate ({src or 'no metrics'}):",
                None if hr is None else f"{hr:.2%}"))
    print("=" * 50)


def cache_fields(outputs) -> dict:
    """Totals of ``cached_tokens`` over successful requests that reported it."""
    reported = [o for o in outputs if o.success and o.cached_tokens is not None]
    if not reported:
        return {"total_cached_tokens": None, "cached_token_rate": None}
    cached = sum(o.cached_tokens for o in reported)
    prompt = sum(o.prompt_tokens if o.prompt_tokens is not None else o.prompt_len
                 for o in reported)
    return {"total_cached_tokens": cached,
            "cached_token_rate": cached / prompt if prompt else 0.0}


def detailed_fields(outputs, output_lens: list[int]) -> dict:
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "start_times": [o.start_time - min(x.start_time for x in outputs) for o in outputs],
        "latencies": [o.latency for o in outputs],
    }


def default_filename(label: str, request_rate, max_concurrency, model_id: str, date: str) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base = model_id.rstrip("/").split("/")[-1]
    return f"{label}-{request_rate}qps{conc}-{base}-{date}.json"


def save_result(result: dict, result_dir: str | None, filename: str | None) -> Path:
    name = filename or default_filename(
        result["label"] or result["backend"], result["request_rate"], result["max_concurrency"],
        result["model_id"], result["date"])
    path = Path(result_dir) / name if result_dir else Path(name)
    if path.parent != Path(""):
        os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def now_stamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")
