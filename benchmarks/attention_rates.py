"""The exact attention kernel's rate over int16 K/V (kernels/int_attention.h), per ISA path this
CPU has: a cold prefill's attention for one layer of the default model's shapes (9 query heads,
3 KV heads, head_dim 64), T queries over their own T keys, read from an int16 pool in place as
the engine reads it. Reported as nanoseconds and (with ``--ghz``) core cycles per query-key
pair, all threads' time counted: ``threads * seconds * GHz / pairs``, pairs = H T (T + 1) / 2.

    .venv/bin/python benchmarks/attention_rates.py [--tokens 1024,4096] [--ghz 2.6] [--json F]

The keys are random (K scaled as real ones, V unit Gaussian); the integer products' cost does
not depend on the values, the softmax's only through how often a block's maximum moves.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import median_time

from prefixcache import kernels
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import LayerKV
from prefixcache.model.attention import PagedBatch

KVH, G, D = 3, 3, 64  # SmolLM2-135M


def setup(tokens: int):
    fmt = kv_format("int16", torch.float32, exact=True)
    gen = torch.Generator().manual_seed(tokens)
    kv = LayerKV(torch.zeros(KVH, tokens, D, dtype=torch.int16), torch.zeros(KVH, tokens, D, dtype=torch.int16),
                 torch.zeros(KVH, tokens), torch.zeros(KVH, tokens), fmt, True)  # fmt: skip
    kv.store(torch.arange(tokens), torch.randn(tokens, KVH, D, generator=gen) * 2,
             torch.randn(tokens, KVH, D, generator=gen))  # fmt: skip
    batch = PagedBatch(torch.tensor([0]), torch.tensor([tokens]), torch.tensor([tokens]), torch.tensor([0, tokens]),
                       torch.arange(tokens))  # fmt: skip
    q = torch.randn(tokens, KVH * G, D, generator=gen)
    return q, kv, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--ghz", type=float, default=None, help="the cores' clock, for cycles per pair")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not kernels.available():
        sys.exit(f"kernels unavailable: {kernels.unavailable_reason()}")
    threads = torch.get_num_threads()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        q, kv, batch = setup(tokens)
        pairs = KVH * G * tokens * (tokens + 1) / 2
        for isa in kernels.supported_isas():
            sec = median_time(
                lambda a=(q, kv, batch, D**-0.5, isa): kernels.paged_attention(*a), args.repeats
            )
            row = {
                "tokens": tokens,
                "isa": isa,
                "ms": sec * 1e3,
                "ns_per_pair": threads * sec * 1e9 / pairs,
            }
            if args.ghz:
                row["cycles_per_pair"] = row["ns_per_pair"] * args.ghz
            rows.append(row)
            extra = f"  {row['cycles_per_pair']:.2f} cycles/pair" if args.ghz else ""
            print(f"T={tokens:6d} {isa:12s} {row['ms']:9.1f} ms  {row['ns_per_pair']:.3f} ns/pair "
                  f"({threads} threads){extra}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"host": platform.processor() or platform.machine(),
                                               "threads": threads, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
