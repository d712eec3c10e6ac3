"""The exact integer path against the float32 path, side by side in one process (docs/benchmarks-journal.md
"Exact integer path"): the VM's speed drifts by tens of percent between runs, so the two engines
alternate, repetition by repetition, and each ratio is taken within a repetition.

Per engine (default model, caching off for cold figures): cold prefill of 1,000 and 4,000 tokens,
TTFT of a 50-token question over a cached 2,000-token prefix, single-sequence decode (ms per
token over 64 tokens), decode throughput at batch 16.

Usage: .venv/bin/python benchmarks/exact_bench.py [--repeats 5] [--json results/exact_bench.json]
       [--model DIR] [--prefill-only]   # another checkpoint (e.g. the 1B-shaped one); only the
                                        # cold 1,000-token prefill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch

from prefixcache import LLM, SamplingParams

MODES = ("mixed", "int16", "int8", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default="results/exact_bench.json")
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--prefill-only", action="store_true", help="only the cold 1,000-token prefill")
    args = ap.parse_args()
    modes = args.modes.split(",")
    rng = random.Random(0)
    engines = {m: LLM(model=args.model, kv_cache_memory="1GiB", activations=m) for m in modes}
    one = SamplingParams(max_tokens=1, temperature=0)

    def ttft(llm, ids, salt):
        o = llm.generate([ids], one, cache_salt=salt)[0]
        return o.metrics.first_token_time - o.metrics.arrival_time

    def decode_ms(llm, ids, salt):
        o = llm.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                         cache_salt=salt)[0]  # fmt: skip
        return (o.metrics.finished_time - o.metrics.first_token_time) / 63 * 1e3

    def batch16(llm, salt):
        prompts = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(16)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                            cache_salt=salt)  # fmt: skip
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        return 16 * 63 / (last - first)

    prefix = [rng.randrange(100, 40000) for _ in range(2000)]
    rows: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    for r in range(args.repeats + 1):  # repetition 0 warms up and is dropped
        p1k = [rng.randrange(100, 40000) for _ in range(1000)]
        p4k = [rng.randrange(100, 40000) for _ in range(4000)]
        q = [rng.randrange(100, 40000) for _ in range(50)]
        for m, llm in engines.items():
            salt = f"{m}-{r}-{os.urandom(4).hex()}"
            got = {"prefill_1000_tok_s": 1000 / ttft(llm, p1k, salt)}
            if args.prefill_only:
                if r:
                    rows[m].setdefault("prefill_1000_tok_s", []).append(got["prefill_1000_tok_s"])
                continue
            got["prefill_4000_tok_s"] = 4000 / ttft(llm, p4k, salt)
            ttft(llm, prefix + [7], f"{m}-shared")  # the prefix cached (once per engine)
            got["ttft_2000_cached_plus_50_ms"] = ttft(llm, prefix + q, f"{m}-shared") * 1e3
            got["decode_ms_per_token"] = decode_ms(llm, q, salt)
            got["decode_batch16_tok_s"] = batch16(llm, salt)
            if r:
                for k, v in got.items():
                    rows[m].setdefault(k, []).append(v)
        print(r, {m: {k: round(v[-1], 1) for k, v in rows[m].items()} for m in modes} if r else "warm-up")
    out = {
        "machine": os.popen("lscpu | grep 'Model name'").read().strip(),
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "repeats": args.repeats,
        "medians": {m: {k: statistics.median(v) for k, v in rows[m].items()} for m in modes},
        "weights": {m: e.engine.weights_format for m, e in engines.items()},
        "model": args.model or "default",
        "command": f"benchmarks/exact_bench.py --repeats {args.repeats} --modes {args.modes}"
        + (f" --model {args.model}" if args.model else "") + (" --prefill-only" if args.prefill_only else ""),
    }
    base_mode = "float32" if "float32" in modes else "int16" if "int16" in modes else None
    if base_mode is not None:
        base = rows[base_mode]
        out["ratio_vs"] = base_mode
        out["ratios"] = {
            m: {k: statistics.median(a / b for a, b in zip(rows[m][k], base[k])) for k in base}
            for m in modes if m != base_mode
        }  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
