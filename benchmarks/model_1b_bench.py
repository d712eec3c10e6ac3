"""Offline speed and memory on the 1B-shaped benchmark model (benchmarks/make_1b_model.py) per
weight/arithmetic mode: load time, RSS after load, cold prefill of 1,000 tokens, single-sequence
decode (ms per token over 32 tokens). One engine per process, in the order given (its text is
noise: speed and memory only).

Usage: .venv/bin/python benchmarks/model_1b_bench.py MODE [MODE ...]
  MODE: default (a bf16 checkpoint: exact w8a16, 8-bit groups made at load) | dense
        (--quantization none: float32, the default before 2026-12-03) | int4 (exact w4a16) |
        int4-a8 | int4-f32
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from prefixcache import LLM, SamplingParams

MODES = {
    "default": {},
    "dense": {"quantization": "none"},
    "int4": {"quantization": "int4"},
    "int4-a8": {"quantization": "int4", "activations": "int8"},
    "int4-f32": {"quantization": "int4", "activations": "float32"},
}


def main() -> None:
    model = ".bench/models/llama-1b-shaped"
    mode = sys.argv[1]
    t = time.perf_counter()
    llm = LLM(model, kv_cache_memory="1GiB", enable_prefix_caching=False, **MODES[mode])
    load_s = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    status = Path("/proc/self/status").read_text().splitlines()
    ready = next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024  # at ready
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    ttfts = []
    for _ in range(3):
        ids = [rng.randrange(100, 40000) for _ in range(1000)]
        o = llm.generate([ids], one)[0]
        ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
    o = llm.generate([[rng.randrange(100, 40000) for _ in range(32)]],
                     SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]  # fmt: skip
    tpot = (o.metrics.finished_time - o.metrics.first_token_time) / 31
    print(json.dumps({
        "mode": mode, "weights": llm.engine.weights_format, "load_s": round(load_s, 1),
        "peak_rss_mib": round(rss), "rss_ready_mib": round(ready),
        "prefill_1000_tok_s": round(1000 / statistics.median(ttfts), 1),
        "decode_ms_per_token": round(tpot * 1e3, 1), "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
