"""What the cold == warm contract is on CUDA, measured: for each dtype, the default model's K/V
and logits compared bit for bit (and by their largest difference) alone vs in a batch, chunked vs
whole, cold vs warm around block boundaries, decoded vs prefilled; greedy tokens compared over
many prompts; and cold-prefill / decode speed. The CPU's exact path is proved by
tests/model/test_exact.py; this script is for a machine with a GPU (docs/engine.md "On CUDA").

Usage: python benchmarks/cuda_contract.py [--dtypes bfloat16,float32] [--json results/cuda_contract.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _exact import Recorder, cold_and_warm, compare, run
from _helpers import PROSE, token_budget

from prefixcache import LLM, SamplingParams

B = 16


def _salt() -> str:
    return os.urandom(8).hex()


def _tokens(llm, prompts, n=16, salt=None) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, cache_salt=salt)]


def bits(llm, ids) -> dict:
    """The four comparisons of tests/model/test_exact.py, reported instead of asserted."""
    rng = random.Random(0)
    target = ids[:70]
    out = {}
    alone = run(llm, [target], salt=_salt())
    others = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 33, 120, 64)]
    out["alone_vs_batched"] = compare(alone, run(llm, others[:2] + [target] + others[2:], salt=_salt()))
    with token_budget(llm, 23):
        out["whole_vs_chunked_23"] = compare(alone, run(llm, [target], salt=_salt()))
    for shared in (B - 1, B, B + 1, 3 * B - 1, 3 * B, 3 * B + 1):
        cold, warm, _ = cold_and_warm(llm, ids, shared, (_salt(), _salt()))
        out[f"cold_vs_warm_{shared}"] = compare(cold, warm)
    prompt = ids[10:60]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    with Recorder(llm.engine) as decoded:
        gen = llm.generate([prompt], params, cache_salt=_salt())[0].outputs[0].token_ids
    out["decoded_vs_prefilled"] = compare(decoded, run(llm, [prompt + gen[:8]], max_tokens=1, salt=_salt()))
    return out


def greedy(llm, ids, n_prompts=24) -> dict:
    """Greedy continuations (16 tokens) of prompts whose prefix is cold, then warm; alone vs
    batched; whole vs chunked: how many of the prompts' continuations are identical."""
    rng = random.Random(1)
    prompts = []
    for _ in range(n_prompts):
        start = rng.randrange(0, 400)
        shared = rng.choice([B - 1, B, B + 1, 2 * B, 5 * B + 1, 8 * B - 1])
        prompts.append((ids[start : start + shared], ids[start + 400 : start + 420]))
    cold = [_tokens(llm, [p + s], salt=_salt())[0] for p, s in prompts]
    warm = []
    for p, s in prompts:
        salt = _salt()
        _tokens(llm, [p + [11, 12]], n=1, salt=salt)
        warm.append(_tokens(llm, [p + s], salt=salt)[0])
    batched = _tokens(llm, [p + s for p, s in prompts], salt=_salt())
    with token_budget(llm, 29):
        chunked = _tokens(llm, [p + s for p, s in prompts], salt=_salt())

    def same(xs):
        return sum(a == b for a, b in zip(cold, xs))

    return {"prompts": n_prompts, "warm_identical": same(warm), "batched_identical": same(batched),
            "chunked_identical": same(chunked)}  # fmt: skip


def speed(llm, ids, repeats=3) -> dict:
    rng = random.Random(2)
    one = SamplingParams(max_tokens=1, temperature=0)
    prefill = []
    for _ in range(repeats + 1):
        prompt = [rng.randrange(100, 40000) for _ in range(1000)]
        t = time.perf_counter()
        llm.generate([prompt], one, cache_salt=_salt())
        prefill.append(time.perf_counter() - t)
    decode = []
    params = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
    for _ in range(repeats):
        out = llm.generate([ids[:64]], params, cache_salt=_salt())[0]
        m = out.metrics
        decode.append((m.finished_time - m.first_token_time) / 64)
    return {
        "cold_prefill_1000_tok_s": 1000 / statistics.median(prefill[1:]),
        "batch1_decode_ms_per_token": statistics.median(decode) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default="results/cuda_contract.json")
    args = ap.parse_args()
    result = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(args.device)
    for dtype in args.dtypes.split(","):
        llm = LLM(device=args.device, dtype=dtype, kv_cache_memory="1GiB", seed=0)
        ids = llm.get_tokenizer().encode(PROSE * 20)
        row = {"weights_format": llm.engine.weights_format}
        row["bits"] = bits(llm, ids)
        row["greedy"] = greedy(llm, ids)
        row["speed"] = speed(llm, ids)
        llm.check_integrity()
        result[dtype] = row
        print(json.dumps({dtype: row}, indent=1), flush=True)
        del llm
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
