"""Linear kernels on the default model's shapes: every candidate for the fast path, side by side.

The 30 decoder layers' linears of SmolLM2-135M (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576; random weights, 30 distinct copies so they stream from memory as in a real
step) and the 576->49152 output projection, at M rows, for:

- ``mkl fp32``: ``F.linear`` on float32 weights (MKL sgemm);
- ``onednn fp32``: float32 weights reordered once (``mkldnn._reorder_linear_weight`` /
  ``_linear_pointwise``), what the dense layers use;
- ``onednn bf16``: the same in bf16 (needs AVX-512; skipped where oneDNN refuses);
- ``aten int4 (bf16 act)``: ``_weight_int4pack_mm_for_cpu``, group 32; ``aten int8 (bf16 act)``:
  ``_weight_int8pack_mm``, one scale per row (both round activations to bf16);
- ``ours q4`` / ``ours q8``: prefixcache's group kernel (float32 activations); the head in q8.

Reports median ms per pass over all layers, the GFLOP/s it implies and the weight bytes read
per second. Usage: .venv/bin/python benchmarks/kernels_bench.py [--rows 1,4,8,16,32,64,256,1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prefixcache import kernels
from prefixcache.model.linear import GroupLinear, onednn_packs, quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def candidates(weights: list[torch.Tensor]):
    """name -> (list of callables x -> y, activation dtype, bytes of weights read)."""
    out = {}
    fp32 = [lambda x, w=w: F.linear(x, w) for w in weights]
    out["mkl fp32"] = (fp32, torch.float32, sum(w.numel() * 4 for w in weights))
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    out["onednn fp32"] = (
        [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")
         for p in packed],
        torch.float32, sum(w.numel() * 4 for w in weights),
    )  # fmt: skip
    if onednn_packs(torch.bfloat16):
        pb = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in weights]
        out["onednn bf16"] = (
            [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")
             for p in pb],
            torch.bfloat16, sum(w.numel() * 2 for w in weights),
        )  # fmt: skip
    i4 = []
    for w in weights:
        g = quantize_int4(w)
        scale = g.scale.bfloat16()
        zero = (g.offset + 8 * g.scale).bfloat16()
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q.int(), 1)
        i4.append(lambda x, p=packed4, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz))
    out["aten int4 (bf16 act)"] = (i4, torch.bfloat16, sum(w.numel() // 2 for w in weights))
    i8 = []
    for w in weights:
        s = (w.abs().amax(1) / 127).bfloat16()
        q = torch.round(w / s.float()[:, None]).clamp(-127, 127).to(torch.int8)
        i8.append(lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s))
    out["aten int8 (bf16 act)"] = (i8, torch.bfloat16, sum(w.numel() for w in weights))
    if kernels.available():
        for name, quant in (("ours q4", quantize_int4), ("ours q8", quantize_int8)):
            layers = [GroupLinear(quant(w), large_m=1 << 30) for w in weights]
            out[name] = (layers, torch.float32, sum(lin.nbytes for lin in layers))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,1000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="results/kernels_bench.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    layer_w = [torch.randn(o, i, generator=gen) * 0.05 for _ in range(LAYERS) for o, i in SHAPES]
    head_w = [torch.randn(*HEAD, generator=gen) * 0.05]
    results = []
    for part, weights in (("layers", layer_w), ("head", head_w)):
        flops_per_row = 2 * sum(w.numel() for w in weights)
        for name, (fns, dtype, nbytes) in candidates(weights).items():
            for m in (int(r) for r in args.rows.split(",")):
                if name.startswith("aten") and m > 256:
                    continue  # minutes per pass: these kernels are for small M
                xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in (576, 1536)}

                def run(fns=fns, weights=weights, xs=xs):
                    for f, w in zip(fns, weights):
                        f(xs[w.shape[1]])

                ms = median_ms(run, args.repeats if m <= 64 else 2)
                row = {"part": part, "kernel": name, "rows": m, "ms": round(ms, 2),
                       "gflops": round(flops_per_row * m / ms / 1e6, 1),
                       "weight_gbps": round(nbytes / ms / 1e6, 1)}  # fmt: skip
                results.append(row)
                print(json.dumps(row), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": results}, indent=2))


if __name__ == "__main__":
    main()
