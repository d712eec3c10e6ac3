"""Long contexts, offline: cold prefill, a hit's TTFT and decode TPOT at 1k-32k tokens, per KV dtype.

For each ``--kv-cache-dtype`` (default: auto, i.e. int16 K/V with attention on the integer units
on the exact path, and float32 K/V with the float attention, the default before 2026-12-05), on
the default model or ``--model`` (a Hugging Face directory or GGUF, e.g. a long-context model
written by benchmarks/make_1b_model.py):

- cold prefill of each of ``--prefill`` lengths (tokens/s; the prompt in a fresh namespace);
- a hit: ``--new`` tokens after each of ``--hits`` cached lengths (TTFT, median of ``--reps``);
- decode: TPOT (median over the steps of one run, first token excluded) at each of ``--decode``
  context lengths, with ``--batches`` sequences of that length decoding together (distinct
  random prompts, prefilled before the timed run).

Every prompt is random token ids (the model's numbers do not change the work). Writes
``--json`` (default results/long_context.json) with the host, the load average and every figure.

Usage: .venv/bin/python benchmarks/long_context.py [--kv-cache-dtype auto,float32]
           [--prefill 1024,4096,8000] [--hits 1000,4000,8000] [--new 128]
           [--decode 4096,8000] [--batches 1,8] [--model DIR] [--memory 6GiB]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from prefixcache import LLM, SamplingParams


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def host() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def run(kv_dtype: str, args) -> dict:
    llm = LLM(model=args.model, kv_cache_memory=args.memory, kv_cache_dtype=kv_dtype, seed=0)
    rng = random.Random(0)
    vocab = min(llm.get_tokenizer().vocab_size, 40000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt(64)], one, cache_salt="warm-up")
    row: dict = {"kv_cache_dtype": llm.engine.layout.kv_format.name, "weights": llm.engine.weights_format}
    prefill = {}
    for n in args.prefill:
        p = prompt(n)
        t = time.perf_counter()
        llm.generate([p], one, cache_salt=f"cold-{n}-{os.urandom(4).hex()}")
        prefill[n] = round(n / (time.perf_counter() - t), 1)
        print(json.dumps({"kv": kv_dtype, "cold_prefill_tok_s": {n: prefill[n]}}), flush=True)
    row["cold_prefill_tok_s"] = prefill
    hits = {}
    for n in args.hits:
        salt = f"hit-{n}-{os.urandom(4).hex()}"
        prefix = prompt(n)
        llm.generate([prefix + [7]], one, cache_salt=salt)
        ttfts = []
        for _ in range(args.reps):
            out = llm.generate([prefix + prompt(args.new)], one, cache_salt=salt)[0]
            ttfts.append((out.metrics.first_token_time - out.metrics.arrival_time) * 1e3)
        hits[n] = round(statistics.median(ttfts), 1)
        print(json.dumps({"kv": kv_dtype, "hit_ttft_ms": {n: hits[n]}, "new": args.new}), flush=True)
    row["hit_ttft_ms"] = hits
    decode = {}
    gen = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    for n in args.decode:
        for b in args.batches:
            salt = f"dec-{n}-{b}-{os.urandom(4).hex()}"
            prompts = [prompt(n) for _ in range(b)]
            llm.generate(prompts, one, cache_salt=salt)  # prefilled: the timed run decodes together
            outs = llm.generate(prompts, gen, cache_salt=salt)
            first = max(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.finished_time for o in outs)
            tpot = (last - first) / (args.decode_tokens - 1) * 1e3
            decode[f"{n}x{b}"] = round(tpot, 2)
            print(json.dumps({"kv": kv_dtype, "decode_tpot_ms": {f"ctx {n} batch {b}": decode[f"{n}x{b}"]}}), flush=True)
    row["decode_tpot_ms"] = decode
    del llm
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", default="auto,float32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--memory", default="6GiB")
    ap.add_argument("--prefill", type=ints, default=ints("1024,4096,8000"))
    ap.add_argument("--hits", type=ints, default=ints("1000,4000,8000"))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", type=ints, default=ints("4096,8000"))
    ap.add_argument("--batches", type=ints, default=ints("1,8"))
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--json", default="results/long_context.json")
    args = ap.parse_args()
    result = {"host": host(), "load_average_at_start": os.getloadavg(), "args": vars(args), "rows": []}
    t0 = time.time()
    for kv in args.kv_cache_dtype.split(","):
        result["rows"].append(run(kv, args))
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    for r in result["rows"]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
