"""Scheduler figures for docs/benchmarks-journal.md (issue: scheduler), offline, caching on vs off.

  - generated-shared-prefix: G groups x P questions, a 1,000-token group prefix, 64-token
    questions, 32 output tokens: total throughput ratio (on / off) and hit rate;
  - a 0%-hit workload (random prompts): throughput with caching on / off;
  - decode throughput at batch 1, 4, 16.

Usage: .venv/bin/python benchmarks/scheduler_bench.py [--groups 16 --per-group 8]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from prefixcache import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> dict:
    before = llm.cache_stats()
    preempt0 = llm.engine.scheduler.counters.num_preemptions
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, cache_salt=f"run-{time.monotonic_ns()}")
    dt = time.perf_counter() - t
    after = llm.cache_stats()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    q = after["query_tokens"] - before["query_tokens"]
    h = after["hit_tokens"] - before["hit_tokens"]
    return {
        "seconds": dt,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "total_tok_s": (n_in + n_out) / dt,
        "output_tok_s": n_out / dt,
        "hit_rate": h / q if q else 0.0,
        "preemptions": llm.engine.scheduler.counters.num_preemptions - preempt0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--random-prompts", type=int, default=32)
    ap.add_argument("--random-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip", nargs="*", default=[], choices=["gsp", "zero_hit", "decode"])
    ap.add_argument("--json", default="results/scheduler_bench.json")
    args = ap.parse_args()
    engine_args = {
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
    }
    on = LLM(**engine_args)
    off = LLM(**engine_args, enable_prefix_caching=False)
    vocab = on.engine.model_config.vocab_size
    rng = random.Random(0)

    def rand_ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    res: dict = {"command": "python benchmarks/scheduler_bench.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("json", "skip"))}  # fmt: skip
    # generated-shared-prefix (SGLang's workload shape)
    if "gsp" not in args.skip:
        gsp(args, on, off, rand_ids, rng, res)
    if "zero_hit" not in args.skip:
        zero_hit(args, on, off, rand_ids, res)
    if "decode" not in args.skip:
        decode(off, rand_ids, res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


def gsp(args, on, off, rand_ids, rng, res) -> None:
    prompts = []
    for _ in range(args.groups):
        prefix = rand_ids(args.prefix_len)
        prompts += [prefix + rand_ids(args.question_len) for _ in range(args.per_group)]
    rng.shuffle(prompts)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    r_on, r_off = run(on, prompts, sp), run(off, prompts, sp)
    res["gsp"] = {
        "requests": len(prompts),
        "on": {k: v for k, v in r_on.items() if k != "outputs"},
        "off": {k: v for k, v in r_off.items() if k != "outputs"},
        "throughput_ratio": r_on["total_tok_s"] / r_off["total_tok_s"],
        "outputs_equal": r_on["outputs"] == r_off["outputs"],
    }
    print(f"gsp: on {r_on['total_tok_s']:.0f} tok/s (hit {r_on['hit_rate']:.1%}), off "
          f"{r_off['total_tok_s']:.0f} tok/s, ratio {res['gsp']['throughput_ratio']:.2f}x, "
          f"outputs equal: {res['gsp']['outputs_equal']}, preemptions on/off "
          f"{r_on['preemptions']}/{r_off['preemptions']}")  # fmt: skip


def zero_hit(args, on, off, rand_ids, res) -> None:
    """0%-hit: random prompts, nothing shared."""
    prompts = [rand_ids(args.random_len) for _ in range(args.random_prompts)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ratios = []
    for _ in range(3):  # alternate to spread machine noise over both sides
        a, b = run(on, prompts, sp), run(off, prompts, sp)
        ratios.append(a["total_tok_s"] / b["total_tok_s"])
    ratios.sort()
    res["zero_hit"] = {
        "on_off_ratios": ratios,
        "median_ratio": ratios[1],
        "hit_rate": a["hit_rate"],
    }
    print(f"0%-hit: on/off throughput ratio median {ratios[1]:.3f} (runs {ratios})")


def decode(off, rand_ids, res) -> None:
    """Decode throughput by batch size."""
    res["decode"] = {}
    for bs in (1, 4, 16, 64):
        prompts = [rand_ids(32) for _ in range(bs)]
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        outs = off.generate(prompts, sp)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        tps = bs * 63 / (last - first)
        res["decode"][bs] = tps
        print(f"decode batch {bs}: {tps:.1f} tok/s")


if __name__ == "__main__":
    main()
