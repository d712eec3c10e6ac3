"""Gemma 3 270M Q4_K_M on the exact path (issue #38): start time, memory at ready, a cold
prefill, a hit's TTFT over a cached prefix, decode time per token at batch 1, and a decode
step's time at ``--batch`` sequences (each of ``--batch-context`` cached tokens).

    make gemma && .venv/bin/python benchmarks/gemma_bench.py [--prefix 1024] [--repeats 3]

Prints one JSON object; medians over ``--repeats``. The prompts are tokens of real prose
(the repository's README), so the model sees text, not random ids.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import psutil

from prefixcache import LLM, SamplingParams
from prefixcache.model.paths import resolve_model_path


def rss_mib() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is held, not what malloc kept
    return psutil.Process().memory_info().rss / 2**20


def rss_kinds_mib() -> dict[str, float]:
    """Resident memory by kind: anonymous (the process's own) and file-backed (pages of mapped
    files, e.g. a weights-cache entry, which the kernel can drop and read again)."""
    status = Path("/proc/self/status").read_text().splitlines()
    kinds = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in status if line.startswith("Rss")}
    return {"anon_mib": round(kinds["RssAnon"], 1), "file_mib": round(kinds["RssFile"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-context", type=int, default=200)
    a = ap.parse_args()
    path = resolve_model_path("gemma-3-270m")
    base = rss_mib()
    base_kinds = rss_kinds_mib()
    t = time.perf_counter()
    llm = LLM(model="gemma-3-270m", kv_cache_memory=a.kv_cache_memory)
    start_s = time.perf_counter() - t
    ready = rss_mib()
    kinds = rss_kinds_mib()
    tok = llm.get_tokenizer()
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 8
    ids = [2] + tok.encode(text)
    need = a.prefix + a.suffix * (a.repeats + 1)
    assert len(ids) >= need, f"{len(ids)} tokens of text < {need}"
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cold, warm, tpot = [], [], []
    for r in range(a.repeats):
        salt = f"bench-{r}-{time.time()}"
        prefix = ids[: a.prefix]
        t = time.perf_counter()
        llm.generate([prefix], one, cache_salt=salt)
        cold.append(time.perf_counter() - t)
        tail = ids[a.prefix + r * a.suffix : a.prefix + (r + 1) * a.suffix]
        t = time.perf_counter()
        out = llm.generate([prefix + tail], one, cache_salt=salt)[0]
        warm.append(time.perf_counter() - t)
        assert out.num_cached_tokens >= a.prefix // 16 * 16 - 16
        t = time.perf_counter()
        llm.generate([prefix + tail], SamplingParams(max_tokens=a.decode + 1, temperature=0, ignore_eos=True),
                     cache_salt=salt)  # fmt: skip
        full = time.perf_counter() - t
        tpot.append((full - warm[-1]) / a.decode)
    # A decode step of --batch sequences: their prompts cached first, then (hit + decode steps)
    # minus the hit alone, per step.
    steps = []
    for r in range(a.repeats):
        salt = f"batch-{r}-{time.time()}"
        prompts = [ids[i * 50 : i * 50 + a.batch_context] for i in range(a.batch)]
        llm.generate(prompts, one, cache_salt=salt)
        t = time.perf_counter()
        llm.generate(prompts, one, cache_salt=salt)
        hit = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=a.decode + 1, temperature=0, ignore_eos=True),
                     cache_salt=salt)  # fmt: skip
        steps.append((time.perf_counter() - t - hit) / a.decode)
    m = llm.engine.runner.model
    print(json.dumps({
        "model": path.name, "file_mib": round(path.stat().st_size / 2**20, 1),
        "cpu": Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(": \t"),
        "threads": os.cpu_count(), "load_average": os.getloadavg()[0],
        "exact": m.exact, "arithmetic": m.arithmetic, "kv_cache_memory": a.kv_cache_memory,
        "start_s": round(start_s, 2), "rss_ready_mib": round(ready, 1),
        "rss_ready_minus_python_torch_mib": round(ready - base, 1), "rss_ready_by_kind": kinds,
        "rss_python_torch_by_kind": base_kinds,
        f"cold_prefill_{a.prefix}_tok_s": round(a.prefix / statistics.median(cold), 1),
        f"hit_ttft_{a.prefix}+{a.suffix}_ms": round(1000 * statistics.median(warm), 1),
        "cold_ttft_ms": round(1000 * statistics.median(cold), 1),
        "tpot_ms": round(1000 * statistics.median(tpot), 2),
        f"decode_step_ms_batch{a.batch}": round(1000 * statistics.median(steps), 2),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
