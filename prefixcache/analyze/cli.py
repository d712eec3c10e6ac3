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
