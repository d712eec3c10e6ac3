"""``bench serve``: probe the server, build the workload, run it, report, save, plot."""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

import httpx
import numpy as np

from prefixcache.bench.client import probe, resolve_endpoint
from prefixcache.bench.datasets import (
    DATASET_OPTIONS,
    IGNORE_EOS_DATASETS,
    sample_requests,
    trace_ideal_hit_rate,
)
from prefixcache.bench.report import (
    DETAILED_FIELDS,
    cache_fields,
    detailed_fields,
    now_stamp,
    print_report,
    save_result,
)
from prefixcache.bench.runner import InitialRequestFailed, RunConfig, run_benchmark
from prefixcache.bench.stats import calculate_metrics, parse_goodput


class ServeError(Exception):
    """A failure to report in one line and exit with ``status``: 1 (unreachable server, bad
    arguments), 2 for bad input (a dataset that cannot be read: a malformed trace line)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ServeError(f"{what} {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def load_bench_tokenizer(args: argparse.Namespace):
    from prefixcache.tokenizer.tokenizer import load_tokenizer

    source = args.tokenizer
    if source is None and args.model and Path(args.model).exists():
        source = args.model
    try:
        return load_tokenizer(source), source
    except (OSError, ValueError) as e:
        raise ServeError(f"cannot load tokenizer {source or '(default model)'}: {e}") from e


def run_serve(args: argparse.Namespace) -> dict:
    random.seed(args.seed)
    np.random.seed(args.seed)
    base_url, api_url = resolve_endpoint(args)
    headers = _pairs(args.header, "--header")
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    metadata = _pairs(args.metadata, "--metadata")
    try:
        slos = parse_goodput(args.goodput)
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError as e:
        raise ServeError(str(e)) from e
    selected = (args.percentile_metrics or "ttft,tpot,itl").split(",")

    # The dataset first: a file that cannot be read is the input's fault (exit 2), whether or
    # not a server answers.
    tokenizer, tokenizer_id = load_bench_tokenizer(args)
    options = {k: getattr(args, k) for k in DATASET_OPTIONS[args.dataset_name]}
    try:
        requests = sample_requests(args.dataset_name, tokenizer, args.num_prompts, args.seed,
                                   **options)
    except (OSError, ValueError) as e:
        raise ServeError(f"dataset {args.dataset_name}: {e}", status=2) from e
    if len(requests) != args.num_prompts:
        print(f"{args.dataset_name}: {len(requests)} requests")

    try:
        models = asyncio.run(probe(base_url, headers))
    except httpx.HTTPStatusError as e:
        raise ServeError(f"{base_url}/v1/models answered HTTP {e.response.status_code}") from e
    except (httpx.HTTPError, OSError, ValueError) as e:
        raise ServeError(f"cannot reach the server at {base_url}: {type(e).__name__}: {e}") from e
    model = args.model or (models[0] if models else None)
    if model is None:
        raise ServeError(f"{base_url}/v1/models lists no model; pass --model")

    ignore_eos = args.ignore_eos or args.dataset_name in IGNORE_EOS_DATASETS
    sampling = {"temperature": 0.0 if args.temperature is None else args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    cfg = RunConfig(
        backend=args.backend, api_url=api_url, base_url=base_url, model=model,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
        ignore_eos=ignore_eos, extra_body={**sampling, **(args.extra_body or {})},
        headers=headers, disable_tqdm=args.disable_tqdm,
        ready_check=args.ready_check_timeout_sec > 0)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    try:
        run = asyncio.run(run_benchmark(cfg, requests, count_tokens, seed=args.seed))
    except InitialRequestFailed as e:
        raise ServeError(str(e)) from e
    except httpx.ConnectError as e:
        raise ServeError(f"lost the server at {base_url}: {e}") from e

    metrics, output_lens = calculate_metrics(run.outputs, run.duration_s, count_tokens,
                                             percentiles, slos)
    failed = [o for o in run.outputs if not o.success]
    if failed:
        print(f"===== failed outputs[0] = {failed[0].error} =====")
    result = {
        "date": now_stamp(),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id or "default",
        "num_prompts": len(requests),
        **metadata,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "dataset_name": args.dataset_name,
        "base_url": base_url,
        "duration": run.duration_s,
        **metrics,
        **cache_fields(run.outputs),
        **run.cache,
    }
    ideal = trace_ideal_hit_rate(requests)
    if ideal is not None:
        result["trace_ideal_hit_rate"] = round(ideal, 4)
    # Only the selected metrics are in vLLM's JSON.
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name not in selected:
            for key in [k for k in result if k.endswith(f"_{name}_ms")]:
                del result[key]
    print_report(result, selected, percentiles)
    if ideal is not None:
        measured = result.get("prefix_cache_hit_rate")
        shown = "n/a" if measured is None else f"{measured:.3f}"
        print(f"Trace ideal hit rate (infinite cache): {ideal:.3f}   measured: {shown}")
    detailed = detailed_fields(run.outputs, output_lens)
    if args.save_detailed:
        result.update(detailed)
    if args.save_result or args.save_detailed or args.result_filename:
        path = save_result(result, args.result_dir, args.result_filename)
        print(f"Saved result to {path}")
    if args.plot:
        from prefixcache.bench.plot import plot_runs

        run_view = {**result, **{k: detailed[k] for k in DETAILED_FIELDS}}
        for p in plot_runs([(args.label or args.backend, run_view)], Path(args.plot)):
            print(f"Wrote {p}")
    return result
