"""The segment caching trade-off curve from a segments_bench.py result (docs/benchmarks-journal.md):
TTFT against first-token KL and planted-fact accuracy, one line per selection, a point per
budget, cold / seg-all and no-documents as references.

Usage: .venv/bin/python benchmarks/segments_plot.py results/segments_blend_idle.json \
           docs/img/segments_tradeoff.png
"""

from __future__ import annotations

import json
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LINES = (("seg", "first k (EPIC, default)"), ("dev", "deviation (CacheBlend-style)"),
         ("both", "both"))  # fmt: skip


def main(src: str, dst: str) -> None:
    with open(src) as fh:
        res = json.load(fh)["results"]
    cold = res["cold"]["ttft_median_s"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "kl_first_token", "KL(cold || mode), first token"),
                              (axes[1], "accuracy", "planted-fact accuracy")):  # fmt: skip
        for prefix, name in LINES:
            budgets = ["0", "4", "16", "32", "r0.15"]
            pts = [(res[f"{prefix}-{b}"] if f"{prefix}-{b}" in res else res[f"seg-{b}"], b)
                   for b in budgets]  # k = 0 is the same computation in every selection
            xs = [r["ttft_median_s"] for r, _ in pts]
            ys = [r[metric] for r, _ in pts]
            ax.plot(xs, ys, marker="o", label=name)
            if prefix == "seg":
                for x, y, (_, b) in zip(xs, ys, pts):
                    ax.annotate("15%" if b == "r0.15" else f"k={b}", (x, y), fontsize=8,
                                textcoords="offset points", xytext=(4, 4))  # fmt: skip
        ax.scatter([cold], [res["cold"][metric] if metric == "accuracy" else 0.0], marker="s",
                   color="black", label=f"full prefill / seg-all ({cold:.1f} s)", zorder=3)
        if metric == "accuracy":
            ax.axhline(res["nodocs"]["accuracy"], color="grey", ls=":", label="no documents")
        ax.set_xscale("log")
        ax.set_xticks([0.25, 0.5, 1, 2, 4], ["0.25", "0.5", "1", "2", "4"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("TTFT median, s (log)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8, loc="center right")
    fig.suptitle("Segment caching on SmolLM2-135M: TTFT vs quality by recompute budget")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
