"""``bench compare``: result JSON files side by side, each with its ratio to the first."""

from __future__ import annotations

import json
from pathlib import Path

# (JSON field, row name, format); rows missing from every run are left out.
ROWS = (
    ("completed", "Successful requests", "{:.0f}"),
    ("failed", "Failed requests", "{:.0f}"),
    ("duration", "Benchmark duration (s)", "{:.2f}"),
    ("total_input_tokens", "Total input tokens", "{:.0f}"),
    ("total_output_tokens", "Total generated tokens", "{:.0f}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("request_goodput", "Request goodput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("total_token_throughput", "Total token throughput (tok/s)", "{:.2f}"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "{:.2f}"),
    ("median_ttft_ms", "Median TTFT (ms)", "{:.2f}"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.2f}"),
    ("mean_tpot_ms", "Mean TPOT (ms)", "{:.2f}"),
    ("median_tpot_ms", "Median TPOT (ms)", "{:.2f}"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "{:.2f}"),
    ("mean_itl_ms", "Mean ITL (ms)", "{:.2f}"),
    ("p99_itl_ms", "P99 ITL (ms)", "{:.2f}"),
    ("mean_e2el_ms", "Mean E2EL (ms)", "{:.2f}"),
    ("p99_e2el_ms", "P99 E2EL (ms)", "{:.2f}"),
    ("cached_token_rate", "Cached token rate (usage)", "{:.2%}"),
    ("prefix_cache_hit_rate", "Server prefix cache hit rate", "{:.2%}"),
)


def load_results(paths: list[str], labels: list[str] | None = None) -> list[tuple[str, dict]]:
    """(label, result) per file; the label is --labels', else the run's label, else the stem."""
    if labels and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} result files")
    runs = []
    for i, path in enumerate(paths):
        text = Path(path).read_text()
        try:
            result = json.loads(text)
        except json.JSONDecodeError:
            # vLLM's --append-result writes one JSON object per line: take the last.
            lines = [ln for ln in text.splitlines() if ln.strip()]
            try:
                result = json.loads(lines[-1]) if lines else None
            except json.JSONDecodeError:
                result = None
        if not isinstance(result, dict) or "completed" not in result:
            raise ValueError(f"{path}: not a bench serve result JSON")
        label = labels[i] if labels else (result.get("label") or Path(path).stem)
        runs.append((label, result))
    return runs


def _ratio(value, base) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base:
        return ""
    return f"{value / base:.2f}x"


def compare_table(runs: list[tuple[str, dict]], markdown: bool = False) -> str:
    """Rows of metrics, a column per run, and for every run after the first its ratio to it."""
    header = ["Metric"]
    for i, (label, _) in enumerate(runs):
        header.append(label)
        if i > 0:
            header.append(f"{label} / {runs[0][0]}")
    rows = [header]
    base = runs[0][1]
    for key, name, fmt in ROWS:
        values = [r.get(key) for _, r in runs]
        if all(v is None for v in values):
            continue
        row = [name]
        for i, v in enumerate(values):
            row.append("n/a" if v is None else fmt.format(v))
            if i > 0:
                row.append(_ratio(v, base.get(key)))
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |",
                 "|" + "|".join("---" if i == 0 else "--:" for i in range(len(rows[0]))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(cell.ljust(widths[c]) if c == 0 else cell.rjust(widths[c])
                             for c, cell in enumerate(r)))
        if j == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)
