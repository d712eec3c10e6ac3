"""`prefixcache generate`: one prompt through the offline API; prints text, cached tokens, TTFT."""

from __future__ import annotations

import argparse
import sys
import time

from prefixcache.config import COMPONENTS, add_cli_arguments

# The engine options an offline run takes (each defined once, in config.py)
_ENGINE_FLAGS = ("model", "kv_cache_memory", "dtype", "quantization", "activations",
                 "kv_cache_dtype", "device", "enable_prefix_caching")  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt with the offline engine")
    p.add_argument("--prompt", required=True, help="prompt text (use --chat to apply the template)")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1, help="run the prompt N times (shows the cache hit on runs 2..N)")
    engine = p.add_argument_group("engine (the same flags as prefixcache serve's)")
    for component in COMPONENTS:
        add_cli_arguments(engine, component, only=_ENGINE_FLAGS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefixcache import LLM, SamplingParams
    from prefixcache.model.loader import UnsupportedModelError
    from prefixcache.model.paths import ModelNotFoundError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed,
        )  # fmt: skip
        llm = LLM(**{name: getattr(args, name) for name in _ENGINE_FLAGS})
    except (ValueError, ModelNotFoundError, UnsupportedModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        try:
            if args.chat:
                msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": args.prompt}
                ]
                out = llm.chat(msgs, params)[0]
            else:
                out = llm.generate(args.prompt, params)[0]
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        m = out.metrics
        ttft = (m.first_token_time - m.arrival_time) if m and m.first_token_time else float("nan")
        total = time.perf_counter() - t0
        print(out.outputs[0].text)
        print(
            f"--- run {i + 1}: prompt {len(out.prompt_token_ids)} tokens, cached "
            f"{out.num_cached_tokens}, generated {len(out.outputs[0].token_ids)} "
            f"({out.outputs[0].finish_reason}), ttft {ttft * 1000:.1f} ms, total {total:.2f} s",
            file=sys.stderr,
        )
    return 0
