"""Integer kernel rates (GOP/s) on the default model's linear shapes (or, ``--shapes 1b``,
Llama-3.2-1B's), per ISA path this CPU has, at several batch sizes M: what ``IntLinear`` runs
for w4a8x16 (mixed activations: the default model's layers), w4a16, w4a8, w8a16 (a bf16
checkpoint's default) and w8a8x16 (8-bit groups with mixed activations: a GGUF Q8_0's default,
opt-in on a bf16 checkpoint), w6a16 and w6a8x16 (6-bit groups of 16 as GGUF Q6_K loads: 8-bit pairs
with an epilogue per 16 weights), next to ``torch._int_mm`` and float32 ``F.linear``. The activations are Gaussian, so mixed rows have few wide groups here
(real activations' outlier groups are wider: docs/design.md "Mixed activations").

    .venv/bin/python benchmarks/kernel_rates.py [--shapes 135m|1b|head] [--json results/kernel_rates.json]

On AVX2 a w4a16 call of ``WIDE_ROWS`` rows or more runs the 4-bit weights held as int8
(model/int_linear.py), so its figure at M >= 8 is that path's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import median_time

from prefixcache import kernels
from prefixcache.model.int_linear import IntLinear
from prefixcache.model.linear import quantize_int4, quantize_int8
from prefixcache.model.loader import Int8Groups16

# (K, N): the default model's MLP up (one half of gate_up) and down; Llama-3.2-1B's fused qkv, gate_up, down.
SHAPES = {"135m": [(576, 1536), (1536, 576)], "1b": [(2048, 3072), (2048, 16384), (8192, 2048)],
          "head": [(576, 49152)]}  # the default model's output projection (a Llama Q4_K_M file's is Q6_K)


def quantize_q6(w: torch.Tensor) -> Int8Groups16:
    """6-bit groups of 16 with one scale each, as a GGUF Q6_K tensor loads."""
    g = w.view(w.shape[0], -1, 16)
    scale = (g.abs().amax(-1) / 31).clamp_min(1e-8)
    return Int8Groups16(torch.round(g / scale.unsqueeze(-1)).clamp(-32, 31).to(torch.int8).view(w.shape), scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="results/kernel_rates.json")
    ap.add_argument("--rows", default="1,16,128,512")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="135m")
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    res: dict = {"cpu": platform.processor() or "unknown", "threads": torch.get_num_threads(), "shapes": args.shapes,
                 "gops": {}}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            res["cpu"] = line.split(":", 1)[1].strip()
            break
    for k, n in SHAPES[args.shapes]:
        w = torch.randn(n, k)
        g4, g8, g6 = quantize_int4(w), quantize_int8(w), quantize_q6(w)
        for m in rows:
            x = torch.randn(m, k)
            flops = 2 * m * k * n
            for isa in kernels.supported_isas():
                for name, g, bits, mixed in [("w4a16", g4, 16, False), ("w4a8x16", g4, 16, True),
                                             ("w4a8", g4, 8, False), ("w8a16", g8, 16, False),
                                             ("w8a8x16", g8, 16, True), ("w6a16", g6, 16, False),
                                             ("w6a8x16", g6, 16, True)]:
                    lin = IntLinear(g, None, bits, isa, mixed)
                    res["gops"][f"{name} {isa} K={k} N={n} M={m}"] = round(flops / median_time(lambda lin=lin, x=x: lin(x), 15) / 1e9, 1)
            res["gops"][f"F.linear float32 K={k} N={n} M={m}"] = round(
                flops / median_time(lambda x=x, w=w: torch.nn.functional.linear(x, w), 15) / 1e9, 1
            )
            if m >= 32:
                a = torch.randint(-127, 127, (m, k), dtype=torch.int8)
                b = torch.randint(-127, 127, (k, n), dtype=torch.int8)
                res["gops"][f"torch._int_mm K={k} N={n} M={m}"] = round(
                    flops / median_time(lambda a=a, b=b: torch._int_mm(a, b), 15) / 1e9, 1
                )
    for key, v in res["gops"].items():
        print(f"{key:45s} {v:8.1f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
