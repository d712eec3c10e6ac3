"""Segment caching on a RAG workload: speed and quality (docs/benchmarks-journal.md, "Segment caching").

Workload (generated, deterministic from --seed): --docs documents of ~--doc-tokens tokens of
filler prose, each holding one planted fact "The access code of <name> is <number>."; prompts
are a system prompt + --docs-per-prompt documents in random order + a question about the fact
of one of them. Offline, through ``LLM``; one request at a time, so TTFT is a prefill's time.

Modes, on the same prompts:
  cold       every request in a fresh namespace: full prefill of the segments-mode ids (the
             quality reference, "full recomputation")
  prefix     cache_mode "prefix" (the default): exact prefix hits only (the system prompt)
  seg-k      cache_mode "segments", the first k tokens of each document recomputed; the store
             is warmed with every document first (steady state: each document seen before)
  dev-k      the same budget (k tokens per document), segment_selection "deviation": the k
             tokens whose KV deviates most (CacheBlend-style); both-k: "both" (first ceil(k/2)
             + most deviating of the rest). With --selection; k = 0 and "all" recompute nothing /
             everything in every selection, so they run for "first" only (seg-0, seg-all)
  seg-rX     (and dev-rX, both-rX) --ratios: the budget is the share X of each document
  nodocs     system prompt + question only (what the model knows without the documents)

Figures: median TTFT (sequential pass, modes interleaved per prompt) and its ratio to cold;
throughput of the first --batch-prompts prompts in one batch (prompt tokens / s of wall time,
generation included); greedy agreement of the first
--agree-tokens tokens with cold; KL(cold || mode) of the first-token distribution (full
vocabulary, recorded from the engine's logits); planted-fact accuracy (the code appears in the
answer).

Usage: nice -n 19 .venv/bin/python benchmarks/segments_bench.py [--prompts 8] [--ks 0,4,16,32,all]
       [--ratios 0.15] [--selection first,deviation,both] [--no-batch]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

from prefixcache import LLM, SamplingParams
from prefixcache.api.segments import SegmentRequest

FILLER = [
    "The archive keeps letters, ledgers and maps from the old harbour office.",
    "Every spring the river floods the lower fields and the farmers move their sheep uphill.",
    "The committee met twice a month to discuss the budget for roads and bridges.",
    "A narrow staircase leads from the courtyard to the library on the third floor.",
    "Most visitors arrive by train and walk through the market to the cathedral square.",
    "The workshop repairs clocks, radios and the occasional bicycle for the neighbours.",
    "In winter the lake freezes and the school organises skating races on Sundays.",
    "The bakery on the corner sells rye bread, almond cakes and strong black coffee.",
    "Records from that decade were copied by hand because the printing press had burned.",
    "The museum's east wing shows tools used by miners in the nineteenth century.",
    "Several families share the garden behind the building and grow beans and tomatoes.",
    "The old tram line was closed in the sixties and replaced by a bus route.",
]
NAMES = [
    "Alice", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Jonas",
    "Kira", "Luca", "Mira", "Nadia", "Omar", "Petra", "Quinn", "Rosa", "Sven", "Tomas",
]  # fmt: skip
SYSTEM = (
    "You are a precise assistant. Use only the documents below to answer. Reply with the "
    "number only."
)


def make_docs(tok, n: int, doc_tokens: int, rng: random.Random) -> list[dict]:
    docs = []
    for name in NAMES[:n]:
        code = rng.randint(1000, 9999)
        fact = f"The access code of {name} is {code}."
        sents: list[str] = []
        while len(tok.encode(" ".join(sents))) < doc_tokens:
            sents.append(rng.choice(FILLER))
        sents.insert(rng.randrange(len(sents) + 1), fact)
        docs.append({"name": name, "code": str(code), "title": f"Records of {name}",
                     "content": " ".join(sents)})  # fmt: skip
    return docs


def make_prompts(docs, n: int, per_prompt: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        chosen = rng.sample(docs, per_prompt)
        target = rng.choice(chosen)
        q = f"What is the access code of {target['name']}?"
        msgs = [{"role": "system", "content": SYSTEM}]
        msgs += [{"role": "document", "title": d["title"], "content": d["content"]} for d in chosen]
        msgs.append({"role": "user", "content": q})
        nodocs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        out.append({"messages": msgs, "nodocs": nodocs, "answer": target["code"]})
    return out


def warm_docs(llm: LLM, docs, namespace: str) -> None:
    """Every document into the segment store of ``namespace`` (and the tiers, if any): one
    store-only segments request per document, as /v1/cache/warm sends it."""
    tok = llm.get_tokenizer()
    for d in docs:
        m = [{"role": "system", "content": SYSTEM},
             {"role": "document", "title": d["title"], "content": d["content"]},
             {"role": "user", "content": "?"}]  # fmt: skip
        sp = tok.encode_chat_segments(m)
        warm = SegmentRequest(tuple(sp.spans), store_only=True)
        llm.generate([sp.token_ids], SamplingParams(max_tokens=1, temperature=0),
                     cache_salt=namespace, segments=[warm])  # fmt: skip


class FirstLogits:
    """Records the logits of the first sampled token of a single running request (the bench
    runs one request at a time): wraps the runner's execute, instrumentation only."""

    def __init__(self, llm: LLM):
        self.runner = llm.engine.runner
        self._execute = self.runner.execute
        self.first: torch.Tensor | None = None
        self.runner.execute = self._wrapped

    def _wrapped(self, pieces):
        out = self._execute(pieces)
        if self.first is None and out.logits.shape[0] == 1:
            self.first = out.logits[0].clone()
        return out

    def reset(self):
        self.first = None


def run_one(llm, rec, prompt, mode, opts, salt, params):
    rec.reset()
    if mode == "cold" or mode == "nodocs":
        msgs = prompt["nodocs"] if mode == "nodocs" else prompt["messages"]
        ids = (llm.get_tokenizer().encode_chat(msgs) if mode == "nodocs"
               else llm.get_tokenizer().encode_chat_segments(msgs).token_ids)  # fmt: skip
        out = llm.generate([ids], params, cache_salt=salt)[0]
    elif mode == "prefix":
        out = llm.chat(prompt["messages"], params, cache_salt=salt)[0]
    else:
        out = llm.chat(prompt["messages"], params, cache_salt=salt, cache_mode="segments", **opts)[0]
    return out, rec.first


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The RAG workload's flags (shared with segments_tiers_bench.py)."""
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=300)
    ap.add_argument("--docs-per-prompt", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--ks", default="0,4,16,32,all")
    ap.add_argument("--ratios", default="", help="budgets as a share of each document, e.g. 0.15")
    ap.add_argument("--selection", default="first", help="first,deviation,both: which tokens")
    ap.add_argument("--no-batch", action="store_true", help="skip the throughput batches")
    ap.add_argument("--agree-tokens", type=int, default=16)
    ap.add_argument("--batch-prompts", type=int, default=4, help="prompts in the throughput batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    loadavg_start = os.getloadavg()
    llm = LLM(kv_cache_memory="1GiB", segment_cache_memory="1GiB", seed=0)
    tok = llm.get_tokenizer()
    rng = random.Random(args.seed)
    docs = make_docs(tok, args.docs, args.doc_tokens, rng)
    prompts = make_prompts(docs, args.prompts, args.docs_per_prompt, rng)
    rec = FirstLogits(llm)
    params = SamplingParams(max_tokens=args.agree_tokens, temperature=0, ignore_eos=True)
    ks = [10**6 if k == "all" else int(k) for k in args.ks.split(",")]
    seg_tokens = [tok.encode_chat_segments(p["messages"]) for p in prompts]
    prompt_lens = [len(s.token_ids) for s in seg_tokens]
    doc_lens = [b - a for s in seg_tokens for a, b in s.spans]

    # Warm: every document in the store of namespace "seg" (steady state), and the system
    # prompt in the prefix cache of "prefix" and "seg".
    t0 = time.perf_counter()
    warm_docs(llm, docs, "seg")
    warm_s = time.perf_counter() - t0
    # prefix-batch is a second namespace: the batch must not hit the whole prompts the
    # sequential pass just cached (segments never cache documents in the prefix index).
    for salt in ("prefix", "prefix-batch", "seg"):
        llm.chat(prompts[0]["nodocs"], SamplingParams(max_tokens=1), cache_salt=salt)

    # (mode, segments options): every selection at every budget, except that budgets of 0 and
    # "all" select nothing (nothing / everything recomputed) and run once, as "first"
    tag = {"first": "seg", "deviation": "dev", "both": "both"}
    seg_modes = []
    for sel in args.selection.split(","):
        for k in ks:
            if sel == "first" or 0 < k < 10**6:
                label = f"{tag[sel]}-{'all' if k >= 10**6 else k}"
                seg_modes.append((label, {"segment_recompute_tokens": k, "segment_selection": sel}))
        for r in filter(None, args.ratios.split(",")):
            seg_modes.append((f"{tag[sel]}-r{r}", {"segment_recompute_tokens": 0,
                              "segment_recompute_ratio": float(r), "segment_selection": sel}))  # fmt: skip
    modes = [("cold", None), ("prefix", None)] + [("seg", o) for _, o in seg_modes] + [("nodocs", None)]
    labels = ["cold", "prefix"] + [lb for lb, _ in seg_modes] + ["nodocs"]
    acc = {lb: {"ttft": [], "agree": [], "exact": [], "kl": [], "correct": 0, "seg": []}
           for lb in labels}  # fmt: skip
    # Sequential pass, interleaved: prompt i in every mode before prompt i+1, so the load of
    # this shared machine drifts over all modes alike. TTFT and quality come from here.
    for i, p in enumerate(prompts):
        ref = None
        for (mode, opts), label in zip(modes, labels):
            salt = f"cold-{i}" if mode == "cold" else (f"nodocs-{i}" if mode == "nodocs" else mode)
            out, first = run_one(llm, rec, p, mode, opts, salt, params)
            toks = out.outputs[0].token_ids
            a = acc[label]
            a["ttft"].append(out.metrics.ttft)
            a["correct"] += p["answer"] in out.outputs[0].text
            a["seg"].append(out.num_segment_cached_tokens)
            if mode == "cold":
                ref = (toks, first)
            elif mode == "seg":  # prefix mode is exact for its own ids (cold == warm), which
                # differ from the segments ids by the boundary convention: not compared here
                rt, rl = ref
                same = 0
                for x, y in zip(rt, toks):
                    if x != y:
                        break
                    same += 1
                a["agree"].append(same / len(rt))
                a["exact"].append(rt == toks)
                a["kl"].append(F.kl_div(F.log_softmax(first, -1), F.log_softmax(rl, -1),
                                        log_target=True, reduction="sum").item())  # fmt: skip
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    results = {}
    batch = prompts[: args.batch_prompts]
    batch_tokens = sum(prompt_lens[: args.batch_prompts])
    for (mode, opts), label in zip(modes, labels):
        # throughput: the first --batch-prompts prompts in one batch (cold in a fresh namespace)
        t0 = time.perf_counter()
        if args.no_batch:
            pass
        elif mode == "cold":
            llm.generate([s.token_ids for s in seg_tokens[: args.batch_prompts]], params,
                         cache_salt=f"cold-batch-{time.time()}")  # fmt: skip
        elif mode == "prefix":
            llm.chat([p["messages"] for p in batch], params, cache_salt="prefix-batch")
        elif mode == "seg":
            llm.chat([p["messages"] for p in batch], params, cache_salt="seg",
                     cache_mode="segments", **opts)  # fmt: skip
        else:
            llm.chat([p["nodocs"] for p in batch], params, cache_salt=f"nodocs-batch-{time.time()}")
        wall = None if args.no_batch else time.perf_counter() - t0
        a = acc[label]
        results[label] = {
            "ttft_median_s": statistics.median(a["ttft"]),
            "batch_wall_s": wall,
            "batch_prompt_tok_per_s": batch_tokens / wall if wall and mode != "nodocs" else None,
            "agree_prefix_share": statistics.mean(a["agree"]) if a["agree"] else None,
            "agree_exact": sum(a["exact"]) / len(a["exact"]) if a["exact"] else None,
            "kl_first_token": statistics.mean(a["kl"]) if a["kl"] else None,
            "accuracy": a["correct"] / len(prompts),
            "segment_cached_tokens_mean": statistics.mean(a["seg"]),
        }
        print(label, json.dumps(results[label]), flush=True)
    cold = results["cold"]["ttft_median_s"]
    meta = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(), "prompts": args.prompts, "docs": args.docs,
        "prompt_tokens_mean": statistics.mean(prompt_lens),
        "doc_tokens_mean": statistics.mean(doc_lens), "warm_store_s": warm_s,
        "agree_tokens": args.agree_tokens, "batch_prompts": args.batch_prompts,
        "loadavg_start": loadavg_start, "ks": args.ks, "ratios": args.ratios,
        "selection": args.selection, "batch": not args.no_batch,
    }  # fmt: skip
    print(json.dumps(meta))
    print("\n| mode | TTFT median | vs cold | batch tok/s | greedy agree (prefix share / all 16) "
          "| KL first token | accuracy | segment-cached tok/prompt |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for label, r in results.items():
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        print(f"| {label} | {r['ttft_median_s']:.3f} s | {cold / r['ttft_median_s']:.1f}x | "
              f"{f(r['batch_prompt_tok_per_s'], '.0f')} | {f(r['agree_prefix_share'], '.2f')} / "
              f"{f(r['agree_exact'], '.2f')} | {f(r['kl_first_token'], '.3f')} | "
              f"{r['accuracy']:.2f} | {r['segment_cached_tokens_mean']:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
