"""KV cache dtypes side by side: size, quality, speed, and what the saved bytes buy in hits.

Per ``--kv-cache-dtype`` (auto = float32 here, bfloat16, int8, fp8_e4m3), default model:

1. bytes per token and tokens held by ``--memory`` (the engine's own layout);
2. quality against the unquantized KV on a fixed text set (quality.py's: the first human turn of
   ShareGPT conversations of 64-512 tokens): KL(auto || dtype) of the next-token distribution
   over every position, top-1 agreement, perplexity, and whether the first ``--gen`` greedy
   tokens are identical;
3. speed: cold prefill of a 1,000-token prompt, decode tokens/s at batch 1 and 16 over
   1,000-token contexts (where reading K/V is a large part of a step);
4. the payoff: ``--groups`` documents of ``--prefix-len`` tokens, asked ``--rounds`` times each
   (one batch of a question per document per round), with the same ``--memory`` for every
   dtype: hit rate and throughput. Sized so float32 cannot keep every document and int8 can.

Usage: .venv/bin/python benchmarks/kv_bench.py [--memory 512MiB] [--json results/kv_bench.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from quality import leading_agreement, logits_of, texts  # benchmarks/quality.py

from prefixcache import LLM, SamplingParams

DTYPES = ["auto", "bfloat16", "int8", "fp8_e4m3"]


def quality(llm: LLM, data, ref_logp, ref_gen, gen: int) -> dict:
    logp = [torch.log_softmax(logits_of(llm, ids), -1) for ids in data]
    kl = torch.cat([(rp.exp() * (rp - lp)).sum(-1) for lp, rp in zip(logp, ref_logp)])
    top1 = torch.cat([(lp.argmax(-1) == rp.argmax(-1)).float() for lp, rp in zip(logp, ref_logp)])
    nll = sum(float(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
              for lp, ids in zip(logp, data)) / sum(len(ids) - 1 for ids in data)  # fmt: skip
    outs = llm.generate(data, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True))
    lead = [leading_agreement(o.outputs[0].token_ids, r) for o, r in zip(outs, ref_gen)]
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float(top1.mean()), "perplexity": math.exp(nll),
            "greedy_identical": sum(n == gen for n in lead) / len(lead)}  # fmt: skip


def speed(llm: LLM, rng: random.Random) -> dict:
    def prompt(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0)
    p = prompt(1000)
    llm.generate([p], one, cache_salt="speed-warmup")
    times = []
    for i in range(3):
        t = time.perf_counter()
        llm.generate([p], one, cache_salt=f"speed-{i}")  # a new salt: a cold prefill each time
        times.append(time.perf_counter() - t)
    out = {"prefill_1000_tok_s": 1000 / statistics.median(times)}
    for bs in (1, 16):
        prompts = [prompt(1000) for _ in range(bs)]
        # Prefilled first, so that the timed run's sequences all start decoding in its first
        # steps (cold, the window from the first token to the last would hold most prefills).
        llm.generate(prompts, one)
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        out[f"decode_b{bs}_tok_s"] = bs * 31 / (last - first)
    return out


def payoff(name: str, args, rng: random.Random) -> dict:
    llm = LLM(kv_cache_dtype=name, kv_cache_memory=args.memory)
    docs = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    tokens = 0
    for r in range(args.rounds):
        prompts = [d + [rng.randrange(100, 40000) for _ in range(32)] for d in docs]
        outs = llm.generate(prompts, sp)
        tokens += sum(len(p) + 16 for p in prompts)
    dt = time.perf_counter() - t
    st = llm.cache_stats()
    return {"hit_rate": st["hit_rate"], "seconds": dt, "total_tok_s": tokens / dt,
            "capacity_tokens": st["capacity_tokens"],
            "preemptions": llm.engine.scheduler.counters.num_preemptions,
            "outputs": [o.outputs[0].token_ids for o in outs]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", default="512MiB")
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=["quality", "speed", "payoff"])
    ap.add_argument("--json", default="results/kv_bench.json")
    args = ap.parse_args()
    res: dict = {"command": "benchmarks/kv_bench.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("json", "skip"))}  # fmt: skip
    ref = LLM(kv_cache_memory="256MiB")
    data = texts(ref.get_tokenizer(), args.texts)
    ref_logp = [torch.log_softmax(logits_of(ref, ids), -1) for ids in data]
    greedy = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    ref_gen = [o.outputs[0].token_ids for o in ref.generate(data, greedy)]
    del ref
    rows = {}
    for name in DTYPES:
        llm = LLM(kv_cache_dtype=name, kv_cache_memory=args.memory)
        st = llm.cache_stats()
        row = {"kv_cache_dtype": st["kv_cache_dtype"], "bytes_per_token": st["bytes_per_token"],
               "tokens_in_memory": st["capacity_tokens"]}  # fmt: skip
        if "quality" not in args.skip:
            row.update(quality(llm, data, ref_logp, ref_gen, args.gen))
        if "speed" not in args.skip:
            row.update(speed(llm, random.Random(1)))
        del llm
        if "payoff" not in args.skip:
            row["payoff"] = payoff(name, args, random.Random(2))
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "payoff"}), flush=True)
        if "payoff" in row:
            print("  payoff", json.dumps({k: v for k, v in row["payoff"].items() if k != "outputs"}))
    if all("payoff" in r for r in rows.values()):
        base = rows["auto"]["payoff"]["outputs"]
        res["payoff_outputs_equal_to_auto"] = {n: r["payoff"]["outputs"] == base for n, r in rows.items()}
        for r in rows.values():
            r["payoff"].pop("outputs")
    res["rows"] = rows
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
