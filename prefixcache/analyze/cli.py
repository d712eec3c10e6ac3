"""``prefixcache analyze LOG.jsonl``: how much prefill a prefix cache saves on your traffic."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.analyze.model_info import DTYPE_BYTES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="estimate prefix-cache savings from a request log",
        description=(
            "Read a request log (OpenAI request bodies, prompt_token_ids, or the server's "
            "--log-requests file) and report the ideal prefix-cache hit rate, hit rate vs "
            "cache size for LRU/LFU/Belady, top shared prefixes and cache killers."
        ),
    )
    p.add_argument("log", nargs="?", help="JSONL request log (omit with --dataset)")
    p.add_argument("--model", default=None,
                   help="model (GGUF file or HF directory) whose tokenizer and KV size to use; "
                        "default: the default model")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for text prompts if not the model's (GGUF or HF directory)")
    p.add_argument("--block-size", type=int, default=16, help="cache block size in tokens")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="write summary.json, report.md, report.html (self-contained) and PNG plots to DIR")
    p.add_argument("--measure", action="store_true",
                   help="time the engine's prefill here to estimate the TTFT saving")
    p.add_argument("--device", default="cpu", help="device for --measure")
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="float16",
                   help="KV cache dtype, for sizes in bytes")
    p.add_argument("--jobs", type=int, default=0,
                   help="worker processes (default: one per core for logs over 16 MiB)")
    p.add_argument("--curve-points", type=int, default=8,
                   help="cache sizes simulated for LFU and Belady (LRU is exact at every size)")
    p.add_argument("--top", type=int, default=10, help="top prefixes and cache killers to list")
    p.add_argument("--no-killers", action="store_true", help="skip the cache-killer search")
    p.add_argument("--json", action="store_true", help="print summary.json to stdout")
    t = p.add_argument_group("traces (--trace-format mooncake: docs/analyze.md)")
    t.add_argument("--trace-format", choices=("log", "mooncake"), default="log",
                   help="log: a request log (default); mooncake: a Mooncake trace of hash ids")
    t.add_argument("--cache-fraction", default="0.01,0.02,0.05,0.1,0.2,0.5",
                   help="RAM cache sizes as fractions of the working set (distinct hash ids), "
                        "comma-separated")
    t.add_argument("--eviction-policy", default="all",
                   help="all, or comma-separated of lru, lru-demote, hit-density, adaptive, belady")
    t.add_argument("--start-ms", type=float, default=None,
                   help="simulate only requests at or after this trace timestamp (ms)")
    t.add_argument("--end-ms", type=float, default=None,
                   help="simulate only requests before this trace timestamp (ms)")
    t.add_argument("--max-requests", type=int, default=0,
                   help="simulate at most this many requests of the window (0: all)")
    t.add_argument("--engine-model", action="store_true",
                   help="also replay the trace through the engine's own cache core (partial "
                        "tails never shared, hits at most len - 1 tokens, a request's blocks "
                        "held while it runs): what a live `bench serve --dataset-name "
                        "mooncake-trace --max-concurrency 1` with one output token measures")
    t.add_argument("--block-tokens", type=int, default=16,
                   help="--engine-model: tokens (and engine block size) per 512-token hash block, "
                        "as bench serve's --block-tokens")
    t.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="--engine-model: the server's prefill chunk")
    t.add_argument("--disk-multiple", type=float, default=0.0,
                   help="also simulate a disk tier of N x the RAM capacity behind it")
    t.add_argument("--restore-cost", type=float, default=None,
                   help="a disk restore's cost as a fraction of recomputing (default: the "
                        "measured ratio in docs/benchmarks-journal.md)")
    g = p.add_argument_group("bench datasets (instead of a log)")
    g.add_argument("--dataset", default=None,
                   help="analyse a `prefixcache bench` dataset by name (e.g. rag, multi-turn)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dataset-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a dataset option, as in prefixcache bench (rag_doc_len=512); repeatable")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefixcache.analyze.analyzer import AnalyzeOptions, analyze_file, analyze_prompts
    from prefixcache.analyze.report import text_summary, write_report

    if args.trace_format == "mooncake":
        return run_trace(args)
    if (args.log is None) == (args.dataset is None):
        print("prefixcache analyze: give a LOG file or --dataset NAME (one of them)",
              file=sys.stderr)
        return 2
    try:
        options = AnalyzeOptions(
            block_size=args.block_size,
            tokenizer=args.tokenizer or args.model,
            model=args.model,
            kv_dtype_bytes=DTYPE_BYTES[args.kv_dtype],
            jobs=args.jobs,
            curve_points=args.curve_points,
            top_k=args.top,
            killers=not args.no_killers,
            measure=args.measure,
            device=args.device,
        )
    except ValueError as e:
        print(f"prefixcache analyze: {e}", file=sys.stderr)
        return 2
    if args.log is not None:
        if not Path(args.log).is_file():
            print(f"prefixcache analyze: no such file: {args.log}", file=sys.stderr)
            return 2
        summary = analyze_file(args.log, options)
    else:
        try:
            prompts = dataset_prompts(args)
        except (ValueError, TypeError, ImportError, OSError) as e:
            print(f"prefixcache analyze: dataset {args.dataset!r}: {e}", file=sys.stderr)
            return 2
        summary = analyze_prompts(prompts, options, name=f"dataset:{args.dataset}")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(text_summary(summary))
    if args.report:
        written = write_report(summary, args.report)
        if not args.json:
            print(f"\nreport: {', '.join(str(p) for p in written)}")
    if summary["requests"] == 0:
        print("prefixcache analyze: no usable request in the input", file=sys.stderr)
        return 1
    return 0


def run_trace(args: argparse.Namespace) -> int:
    from prefixcache.analyze.trace_report import (
        DEFAULT_RESTORE_COST,
        text_table,
        trace_summary,
        write_trace_report,
    )
    from prefixcache.bench.mooncake import TraceFormatError
    from prefixcache.cache.eviction import parse_policies

    def fail(msg: str) -> int:
        print(f"prefixcache analyze: {msg}", file=sys.stderr)
        return 2

    if args.log is None or args.dataset is not None:
        return fail("--trace-format mooncake takes a TRACE file (and no --dataset)")
    if not Path(args.log).is_file():
        return fail(f"no such file: {args.log}")
    try:
        fractions = [float(x) for x in args.cache_fraction.split(",") if x.strip()]
        policies = parse_policies(args.eviction_policy)
    except ValueError as e:
        return fail(str(e))
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        return fail("--cache-fraction takes fractions in (0, 1]")
    if args.disk_multiple < 0:
        return fail("--disk-multiple must be >= 0")
    if args.max_requests < 0 or args.block_tokens < 1 or args.max_num_batched_tokens < 1:
        return fail("--max-requests must be >= 0, --block-tokens and --max-num-batched-tokens "
                    ">= 1")
    engine = None
    if args.engine_model:
        engine = {"block_tokens": args.block_tokens,
                  "max_num_batched_tokens": args.max_num_batched_tokens}
    restore = DEFAULT_RESTORE_COST if args.restore_cost is None else args.restore_cost
    if not 0 <= restore <= 1:
        return fail("--restore-cost must be in [0, 1]")
    try:
        summary = trace_summary(args.log, fractions, policies, args.disk_multiple, restore,
                                start_ms=args.start_ms, end_ms=args.end_ms,
                                max_requests=args.max_requests or None, engine=engine)
    except TraceFormatError as e:
        return fail(str(e))
    if summary["working_set_blocks"] == 0:
        return fail(f"{args.log}: no request in the trace")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(text_table(summary, name=args.log))
    if args.report:
        written = write_trace_report(summary, args.report)
        if not args.json:
            print(f"\nreport: {', '.join(str(p) for p in written)}")
    return 0


def dataset_prompts(args: argparse.Namespace) -> list:
    """A bench dataset as prompts, each with its full conversation as the server would see it."""
    from prefixcache.analyze.prompts import load_tokenizer
    from prefixcache.analyze.reader import Prompt
    from prefixcache.bench import datasets

    options = {}
    for item in args.dataset_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--dataset-option {item!r} is not KEY=VALUE")
        options[key.strip().replace("-", "_")] = _literal(value.strip())
    tok = load_tokenizer(args.tokenizer or args.model)
    requests = datasets.sample_requests(args.dataset, tok, args.num_prompts, args.seed, **options)
    histories = datasets.conversation_histories(requests, tok, seed=args.seed)
    prompts = []
    for i, (r, history) in enumerate(zip(requests, histories)):
        if r.messages is not None or r.conversation_id is not None:
            prompts.append(Prompt(time=float(i), messages=history))
        elif isinstance(r.prompt, list):
            prompts.append(Prompt(time=float(i), token_ids=list(r.prompt)))
        else:
            prompts.append(Prompt(time=float(i), text=r.prompt))
    return prompts


def _literal(value: str) -> object:
    if value.lower() in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value
