"""Probe: the default model's linear layers (all layers' four projections, as the engine holds
them) timed at each row count given: whether a step's time per row has steps at the kernels' row
tiles (64-row work items, int_linear.cpp) or a fixed cost per call. Medians of 9 passes, random
activations (the integer kernels' time does not depend on the values).

    .venv/bin/python benchmarks/probes/linear_rows.py 1 8 64 128 129 131 192 256
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from prefixcache import LLM


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [1, 8, 64, 128, 129, 192, 256]
    model = LLM(kv_cache_memory="256MiB").engine.runner.model
    layers = [p for layer in model.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    for m in rows:
        xs = {p.in_features: torch.randn(m, p.in_features) for p in layers}
        times = []
        for _ in range(9):
            t = time.perf_counter()
            for p in layers:
                p(xs[p.in_features])
            times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times)
        print(f"rows {m:4d}: {ms:7.2f} ms, {ms / m:6.3f} ms a row", flush=True)


if __name__ == "__main__":
    main()
