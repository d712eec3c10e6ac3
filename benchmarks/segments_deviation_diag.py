"""Does layer 1's KV deviation predict the deeper layers'? A diagnostic for segment_selection
"deviation" (docs/benchmarks-journal.md, "Recompute selection").

On the prompts of segments_bench.py (same generator and seed), for each document: the per-token
deviation ||V_l(cold) - V_l(placed)||^2 at every layer l, where V(cold) is a cold prefill of the
whole prompt and V(placed) the document's KV computed alone (what segments mode places; V has no
position, so no re-rotation is needed). Reports the Spearman rank correlation of layer 1's
deviation (what the probe measures) with the mean normalised deviation of layers 2..L-1 and
with single layers, and how the 16 most deviating tokens of the deep layers overlap layer 1's
top 16 and the document's first 16 tokens (what "first" recomputes).

Usage: nice -n 19 .venv/bin/python benchmarks/segments_deviation_diag.py [--prompts 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from segments_bench import make_docs, make_prompts

from prefixcache import LLM
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()


def _computed(runner, ids: list[int], bs: int) -> KVCache:
    """A private cache of the pool's format holding ``ids`` computed from position 0."""
    n = len(ids)
    nb = -(-n // bs)
    lay = runner.kv.layout
    cache = KVCache(runner.config, KVLayout(nb, bs, lay.bytes_per_token, lay.kv_format), runner.device)
    meta = build_metadata([list(range(nb))], [0], [n], bs, runner.device, native=runner.model.native,
                          exact=runner.model.exact)  # fmt: skip
    pos = torch.arange(n, device=runner.device)
    runner.model(torch.tensor(ids, device=runner.device), pos, cache, meta, pos[-1:])
    return cache


def _alone_v(runner, ids: list[int], m: int, bs: int) -> list[torch.Tensor]:
    """Every layer's V of ``ids[m:]`` computed alone after ``ids[:m]`` (positions 0..): what
    the segment store keeps ([kv_heads, n, D] each)."""
    cache = _computed(runner, ids, bs)
    slots = torch.arange(m, len(ids), device=runner.device)
    return [cache.layer(i).gather(slots, torch.float32)[1].cpu() for i in range(runner.config.num_layers)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="256MiB", seed=0)
    tok, eng = llm.get_tokenizer(), llm.engine
    rng = random.Random(args.seed)
    prompts = make_prompts(make_docs(tok, 20, 300, rng), 8, 4, rng)  # segments_bench's defaults
    runner, bs, top = eng.runner, eng.config.block_size, args.top
    layers = runner.config.num_layers
    rows = {"spearman_l1_deep": [], "top_l1": [], "top_first": [], "first2_in_l1_top4": []}
    per_layer: dict[int, list[float]] = {}
    for p in prompts[: args.prompts]:
        seg = tok.encode_chat_segments(p["messages"])
        ids = seg.token_ids
        cold = _computed(runner, ids, bs)
        for a, b in seg.spans:
            alone_v = _alone_v(runner, ids[:1] + ids[a:b], 1, bs)  # after the sink, as stored
            slots = torch.arange(a, b, device=runner.device)
            dev = torch.stack([
                (cold.layer(i).gather(slots, torch.float32)[1].cpu() - alone_v[i]).square().sum((0, 2))
                for i in range(layers)
            ])  # [layers, n]  # fmt: skip
            deep = (dev[2:] / dev[2:].mean(1, keepdim=True)).mean(0)
            top_deep = set(deep.argsort(descending=True)[:top].tolist())
            rows["spearman_l1_deep"].append(spearman(dev[1], deep))
            rows["top_l1"].append(len(set(dev[1].argsort(descending=True)[:top].tolist()) & top_deep) / top)
            rows["top_first"].append(len(set(range(top)) & top_deep) / top)
            rows["first2_in_l1_top4"].append({0, 1} <= set(dev[1].argsort(descending=True)[:4].tolist()))
            for i in (2, 5, 10, 20, layers - 1):
                per_layer.setdefault(i, []).append(spearman(dev[1], dev[i]))
    docs = len(rows["top_l1"])
    print(f"{docs} documents of {args.prompts} prompts, top {top}")
    print(f"Spearman(layer-1 deviation, mean of layers 2..{layers - 1}): "
          f"{statistics.mean(rows['spearman_l1_deep']):.2f}")  # fmt: skip
    print("Spearman(layer 1, layer l):",
          {i: round(statistics.mean(v), 2) for i, v in sorted(per_layer.items())})  # fmt: skip
    print(f"deep top {top} within layer 1's top {top}: {statistics.mean(rows['top_l1']):.2f}; "
          f"within the first {top} tokens: {statistics.mean(rows['top_first']):.2f}")  # fmt: skip
    print(f"documents whose first 2 tokens are in layer 1's top 4: "
          f"{sum(rows['first2_in_l1_top4'])}/{docs}")  # fmt: skip


if __name__ == "__main__":
    main()
