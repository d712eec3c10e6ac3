"""PNGs of one or more runs: a summary (output tok/s, P99 TTFT, P99 TPOT, hit rate per run) and
the TTFT distribution as a CDF (for runs saved with ``--save-detailed``)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

PANELS = (
    ("output_throughput", "Output throughput (tok/s)", 1.0),
    ("p99_ttft_ms", "P99 TTFT (ms)", 1.0),
    ("p99_tpot_ms", "P99 TPOT (ms)", 1.0),
    ("prefix_cache_hit_rate", "Server prefix-cache hit rate (%)", 100.0),
)


def plot_runs(runs: list[tuple[str, dict]], out_dir: Path, title: str | None = None,
              prefix: str = "") -> list[Path]:
    """Write ``{prefix}summary.png`` and, when per-request TTFTs exist, ``{prefix}ttft_cdf.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_summary(runs, out_dir / f"{prefix}summary.png", title)]
    if any(r.get("ttfts") for _, r in runs):
        written.append(_ttft_cdf(runs, out_dir / f"{prefix}ttft_cdf.png", title))
    return written


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _colors(n: int) -> list:
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


def _summary(runs, path: Path, title: str | None) -> Path:
    labels = [label for label, _ in runs]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8 + 0.12 * max(
        len(s) for s in labels)))
    colors = _colors(len(runs))
    x = np.arange(len(runs))
    for ax, (key, name, scale) in zip(axes, PANELS):
        values = [r.get(key) for _, r in runs]
        heights = [0.0 if v is None else v * scale for v in values]
        bars = ax.bar(x, heights, color=colors)
        for bar, v in zip(bars, values):
            text = "n/a" if v is None else _fmt(v * scale)
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(name)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        if scale == 100.0:
            ax.set_ylim(0, 105)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttft_cdf(runs, path: Path, title: str | None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, r), color in zip(runs, _colors(len(runs))):
        ok = [t * 1000.0 for t, e in zip(r.get("ttfts") or [], r.get("errors") or [])
              if not e] if r.get("errors") else [t * 1000.0 for t in r.get("ttfts") or []]
        if not ok:
            continue
        xs = np.sort(np.asarray(ok))
        ys = np.arange(1, len(xs) + 1) / len(xs) * 100.0
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})", color=color)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("Requests with TTFT at most x (%)")
    ax.set_xscale("log")
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or "TTFT distribution (CDF)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
