"""Segments from the disk tier after a restart (docs/benchmarks-journal.md, "Segment caching").

The RAG workload of segments_bench.py (same generator, same seed). A first engine warms every
document as a segment, which writes each through to the disk tier, and is dropped; a second
engine on the same directory (a restart) then serves the prompts, one at a time, in modes
interleaved per prompt:

  cold     full prefill of the segments-mode ids (fresh namespace)
  alone    cache_mode "segments", every document seen for the first time (fresh namespace):
           computed alone, then placed (and written through to disk)
  disk     cache_mode "segments", the warmed namespace with the segment store in RAM emptied
           first: every document restored from the disk tier
  ram      the same request again right after: every document in RAM

TTFT includes the restore (the request waits in the queue for the reader thread). The disk
files were written seconds before by the same machine, so reads come from the page cache: this
is the restart-on-the-same-host case, not a cold disk.

Usage: .venv/bin/python benchmarks/segments_tiers_bench.py [--prompts 8] [--k 16] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from segments_bench import add_workload_args, make_docs, make_prompts, warm_docs

from prefixcache import LLM, SamplingParams

MODES = ("cold", "alone", "disk", "ram")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--k", type=int, default=16, help="segment_recompute_tokens")
    ap.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="pc-seg-tiers-"))
    loadavg_start = os.getloadavg()
    conf = {"kv_cache_memory": "1GiB", "segment_cache_memory": "1GiB", "seed": 0,
            "disk_cache_dir": root}  # fmt: skip

    first = LLM(**conf)
    tok = first.get_tokenizer()
    rng = random.Random(args.seed)
    docs = make_docs(tok, args.docs, args.doc_tokens, rng)
    prompts = make_prompts(docs, args.prompts, args.docs_per_prompt, rng)
    t0 = time.perf_counter()
    warm_docs(first, docs, "seg")
    assert first.engine.connectors.flush(300)
    warm_s = time.perf_counter() - t0
    disk = first.cache_stats()["tiers"]["disk"]
    written, written_bytes = disk["segment_written"], disk["written_bytes"]
    del first

    llm = LLM(**conf)  # the restart
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.chat(prompts[0]["nodocs"], params, cache_salt="seg")  # the system prompt, as in ram
    ttft = {m: [] for m in MODES}
    reused = {m: [] for m in MODES}
    for i, p in enumerate(prompts):
        for mode in MODES:
            if mode == "cold":
                ids = tok.encode_chat_segments(p["messages"]).token_ids
                out = llm.generate([ids], params, cache_salt=f"cold-{i}")[0]
            else:
                if mode == "disk":  # RAM only: the tiers keep every record
                    llm.engine.connectors.get("segments").store.invalidate(None, all_namespaces=True)
                salt = f"alone-{i}" if mode == "alone" else "seg"
                if mode == "alone":  # its system prompt cached, as in "seg" (not timed)
                    llm.chat(p["nodocs"], params, cache_salt=salt)
                out = llm.chat(p["messages"], params, cache_salt=salt, cache_mode="segments",
                               segment_recompute_tokens=args.k)[0]  # fmt: skip
            ttft[mode].append(out.metrics.ttft)
            reused[mode].append(out.num_segment_cached_tokens)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    st = llm.cache_stats()
    d = st["tiers"]["disk"]
    results = {
        m: {"ttft_median_s": statistics.median(ttft[m]),
            "segment_cached_tokens_mean": statistics.mean(reused[m])}
        for m in MODES
    }  # fmt: skip
    meta = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "k": args.k,
        "prompts": args.prompts, "docs": args.docs, "warm_and_write_s": warm_s,
        "segments_written": written, "written_bytes": written_bytes,
        "record_bytes_mean": written_bytes / max(written, 1),
        "disk_segment_hit_tokens": d["segment_hit_tokens"], "disk_segment_read": d["segment_read"],
        "disk_restore_seconds_total": d["restore_seconds_total"],
        "disk_rejected": d["rejected_blocks"],
    }  # fmt: skip
    print(json.dumps(meta))
    cold = results["cold"]["ttft_median_s"]
    print("\n| mode | TTFT median | vs cold | segment-cached tok/prompt |\n|---|--:|--:|--:|")
    for m, r in results.items():
        print(f"| {m} | {r['ttft_median_s']:.3f} s | {cold / r['ttft_median_s']:.1f}x | "
              f"{r['segment_cached_tokens_mean']:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
