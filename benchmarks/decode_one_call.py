"""A decode step in one native call (kernels.exact_decode) against the same step layer by layer,
on the exact path, in one process: the two alternate every repetition (which goes first swaps),
so both see the same machine speed (a shared VM drifts 15-40% within minutes, more than the
difference measured). Each figure: B sequences of ``--context`` cached tokens, then 16 decode
steps, minus the hit alone, per step; the ratio is taken within each repetition.

    .venv/bin/python benchmarks/decode_one_call.py [--model gemma-3-270m] [--batches 1,8] [--pairs 12]

The two give the same bits (tests/model/test_exact.py, tests/model/test_gemma3.py); this measures
only time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=12)
    a = ap.parse_args()
    llm = LLM(model=a.model, kv_cache_memory="512MiB")
    model = llm.engine.runner.model
    fused = model.exact_layers
    if fused is None:
        raise SystemExit(f"{a.model}: no one-call exact decode step here (not the exact path?)")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 4
    ids = llm.get_tokenizer().encode(text)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    steps = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    out = {"model": a.model, "cpu": Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(": \t"),
           "load_average": os.getloadavg()[0], "context": a.context}  # fmt: skip
    try:
        for b in (int(x) for x in a.batches.split(",")):
            prompts = [ids[i * 50 : i * 50 + a.context] for i in range(b)]
            ms: dict[str, list[float]] = {"layers": [], "one_call": []}
            ratios = []
            for rep in range(a.pairs):
                got = {}
                for mode in ("layers", "one_call") if rep % 2 else ("one_call", "layers"):
                    model.exact_layers = fused if mode == "one_call" else None
                    salt = f"{b}-{rep}-{mode}-{time.time()}"
                    llm.generate(prompts, one, cache_salt=salt)  # cache the prompts
                    t = time.perf_counter()
                    llm.generate(prompts, one, cache_salt=salt)
                    hit = time.perf_counter() - t
                    t = time.perf_counter()
                    llm.generate(prompts, steps, cache_salt=salt)
                    got[mode] = (time.perf_counter() - t - hit) / 16 * 1000
                    ms[mode].append(got[mode])
                ratios.append(got["one_call"] / got["layers"])
            out[f"batch{b}"] = {
                "layer_by_layer_ms": round(statistics.median(ms["layers"]), 2),
                "one_call_ms": round(statistics.median(ms["one_call"]), 2),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            }
    finally:
        model.exact_layers = fused
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
