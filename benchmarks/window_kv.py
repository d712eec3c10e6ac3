"""KV bytes a long sequence holds with window parts (issue #38): Gemma 3's sliding-window layers
keep their K/V a window back (cache/window.py), its global layers for every token.

    make gemma && .venv/bin/python benchmarks/window_kv.py [--contexts 2048,8192,16384,32000]

For each context length: one prompt of that many tokens of real prose (the README, repeated) is
prefilled and decodes 4 tokens; at every step the bytes its sequence holds are read from the
engine: its blocks (the global layers' K/V) plus the window parts it holds (the sliding-window
layers'). Reported, per token of context and as a share of keeping every layer's K/V for every
token (``bytes_per_token``, what the engine kept before window parts): what it holds while
decoding (the context's cost), and the most it held in a prefill step (that step's own new
tokens need every layer's K/V while they attend: up to ``max_num_batched_tokens`` of them, one
step's working set whatever the context); the cold prefill's rate; and what the pool's budget
holds in tokens, against every layer for every token.
Prints one JSON object (and writes ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--contexts", default="2048,8192,16384,32000")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--json", default="results/window_kv.json")
    a = ap.parse_args()
    llm = LLM(model=a.model, kv_cache_memory=a.kv_cache_memory)
    eng = llm.engine
    lay, window = eng.layout, eng.kv.window
    assert window is not None, "this model has no sliding-window layers beside global ones"
    bs = lay.block_size
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 60
    ids = llm.get_tokenizer().encode(text)
    held: list[int] = []
    step = eng.runner.execute

    def watch(pieces):
        out = step(pieces)
        for p in pieces:
            seq = next(q for q in eng.seqs.values() if q.kv.block_table is p.block_table)
            parts = len(seq.kv.block_table) - seq.kv.window_from
            held.append(len(seq.kv.block_table) * bs * lay.block_bytes_per_token + parts * bs * lay.window_bytes_per_token)
        return out

    eng.runner.execute = watch
    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        assert len(ids) >= n, f"{len(ids)} tokens of text < {n}"
        held.clear()
        t = time.perf_counter()
        llm.generate([ids[:n]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), cache_salt=f"w{n}")
        prefill_s = time.perf_counter() - t
        most = max(held)
        # then a hit on it (one new token) and 4 decode steps: what the context costs while decoding
        llm.generate([ids[: n + 1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), cache_salt=f"w{n}")
        decoding = held[-1]
        full = n * lay.bytes_per_token
        rows.append({
            "context": n, "every_layer_bytes_per_token": lay.bytes_per_token,
            "decode_held_bytes_per_token": round(decoding / n, 1),
            "decode_share_of_every_layer": round(decoding / full, 4),
            "prefill_peak_bytes_per_token": round(most / n, 1),
            "prefill_peak_share_of_every_layer": round(most / full, 4),
            "prefill_tok_s": round(n / prefill_s, 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    budget = lay.capacity_bytes
    out = {
        "model": a.model, "host": _host(), "loadavg": os.getloadavg(),
        "kv_cache_dtype": lay.kv_format.name, "block_size": bs,
        "sliding_window": eng.runner.config.sliding_window,
        "bytes_per_token_every_layer": lay.bytes_per_token,
        "block_bytes_per_token": lay.block_bytes_per_token,
        "window_bytes_per_token": lay.window_bytes_per_token,
        "window_parts": lay.window_parts - 1,
        "budget_bytes": budget,
        "capacity_tokens": lay.capacity_tokens,
        "capacity_tokens_every_layer": budget // lay.bytes_per_token,
        "contexts": rows,
    }  # fmt: skip
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "contexts"}))


def _host() -> str:
    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return f"{name}, {os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
