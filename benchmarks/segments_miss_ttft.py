"""Segments requests end to end, offline, one at a time: the time to the first token of a miss
(every document computed alone first, then placed and recomputed) and of a hit (every document
from the store), and the tokens they answer with (docs/benchmarks-journal.md, "Segments as a
prefill plan").

The workload is segments_bench's (generated from --seed: --docs-per-prompt documents of about
--doc-tokens tokens, a system prompt and a question). Each prompt runs in its own namespace (a
miss: the store holds none of its documents there), then again in the same one (a hit). Run it
once per build, alternated, to compare builds on this VM (whose speed drifts by minutes):

    .venv/bin/python benchmarks/segments_miss_ttft.py [--prompts 8] [--selection first]
    PYTHONPATH=/tmp/other_checkout .venv/bin/python benchmarks/segments_miss_ttft.py

Then --batch hits of the first prompts in one batch (16 tokens each, every document in the store
already), five times. Prints one JSON line: median TTFT of misses and hits (ms), a digest of
every output's token ids (equal digests: the same tokens), the batch's median wall time and
the scheduler steps it took.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time

from segments_bench import add_workload_args, make_docs, make_prompts

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--k", type=int, default=16, help="segment_recompute_tokens")
    ap.add_argument("--selection", default="first")
    ap.add_argument("--tag", default="")
    ap.add_argument("--batch", type=int, default=4, help="hits in one batch (0: none)")
    a = ap.parse_args()
    llm = LLM(seed=0)
    tok = llm.get_tokenizer()
    rng = random.Random(a.seed)
    docs = make_docs(tok, a.docs, a.doc_tokens, rng)
    prompts = make_prompts(docs, a.prompts, a.docs_per_prompt, rng)
    opts = {"cache_mode": "segments", "segment_recompute_tokens": a.k, "segment_selection": a.selection}
    first = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.chat(prompts[0]["messages"], first, cache_salt="warmup", **opts)  # kernels, allocator
    miss, hit, digest = [], [], hashlib.sha256()
    for i, p in enumerate(prompts):
        salt = f"miss-{a.tag}-{i}-{time.time_ns()}"
        for times in (miss, hit):
            t = time.perf_counter()
            llm.chat(p["messages"], first, cache_salt=salt, **opts)
            times.append((time.perf_counter() - t) * 1e3)
        out = llm.chat(p["messages"], answer, cache_salt=salt, **opts)[0].outputs[0].token_ids
        digest.update(json.dumps(out).encode())
    batch_s, steps, reused = None, None, None
    if a.batch:
        batch = [p["messages"] for p in prompts[: a.batch]]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        salt = f"batch-{a.tag}-{time.time_ns()}"
        for m in batch:  # every document into the store
            llm.chat(m, params, cache_salt=salt, **opts)
        counters, walls = llm.engine.scheduler.counters, []
        for _ in range(5):
            s0, t = counters.num_steps, time.perf_counter()
            outs = llm.chat(batch, params, cache_salt=salt, **opts)
            walls.append(time.perf_counter() - t)
            steps = counters.num_steps - s0
        batch_s = round(statistics.median(walls), 3)
        reused = sum(o.cache.num_segment_cached_tokens or 0 for o in outs)
    print(json.dumps({
        "tag": a.tag, "prompts": a.prompts, "docs_per_prompt": a.docs_per_prompt,
        "doc_tokens": a.doc_tokens, "k": a.k, "selection": a.selection,
        "miss_ttft_ms": round(statistics.median(miss), 1), "hit_ttft_ms": round(statistics.median(hit), 1),
        "outputs_sha256": digest.hexdigest()[:16], "batch_wall_s": batch_s, "batch_steps": steps,
        "batch_segment_tokens": reused,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
