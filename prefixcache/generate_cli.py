"""`prefixcache generate`: one prompt through the offline API; prints text, cached tokens, TTFT."""

from __future__ import annotations

import argparse
import sys
import time

from prefixcache.config import KV_CACHE_DTYPES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt with the offline engine")
    p.add_argument("--prompt", required=True, help="prompt text (use --chat to apply the template)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repeat", type=int, default=1, help="run the prompt N times (shows the cache hit on runs 2..N)")
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"))
    p.add_argument("--activations", default="auto", choices=("auto", "int16", "int8", "float32"))
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-enable-prefix-caching", action="store_true")
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
        llm = LLM(
            args.model,
            kv_cache_memory=args.kv_cache_memory,
            dtype=args.dtype,
            quantization=args.quantization,
            activations=args.activations,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            enable_prefix_caching=not args.no_enable_prefix_caching,
        )
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
