"""Render an analysis summary: terminal text, ``report.md``, ``summary.json`` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.analyze.html_report import write_html
from prefixcache.analyze.units import human_bytes, pct


def _malformed_line(s: dict) -> str:
    m = s["malformed"]
    if not m["count"]:
        return "no malformed lines"
    parts = []
    for reason, n in m["by_reason"].items():
        first = m["first_lines"].get(reason) or []
        where = f" (first at line {first[0]})" if first else ""
        parts.append(f"{reason} ×{n}{where}")
    lines = "line" if m["count"] == 1 else "lines"
    return f"{m['count']} malformed {lines} skipped: " + "; ".join(parts)


def text_summary(s: dict) -> str:
    bpt = (s.get("kv") or {}).get("bytes_per_token")
    out = [f"prefixcache analyze: {s.get('source', '')}"]
    out.append(f"  requests        {s['requests']:,}   ({_malformed_line(s)})")
    out.append(
        f"  prompt tokens   {s['prompt_tokens']:,}   (block size {s['block_size']}, "
        f"{s['namespaces']} namespace{'s' if s['namespaces'] != 1 else ''}, "
        f"{s['distinct_blocks']:,} distinct blocks)"
    )
    out.append(
        f"  ideal hit rate  {pct(s['ideal_hit_rate'])}   = {s['ideal_saved_tokens']:,} prefill "
        "tokens saved with an unbounded cache"
    )
    lru90 = s["lru_90pct_tokens"]
    size = f"{lru90:,} tokens" + (f" = {human_bytes(lru90 * bpt)}" if bpt else "")
    out.append(f"  LRU gets 90% of the ideal with a cache of {size}")
    if bpt:
        out.append(f"  (KV: {bpt:,} bytes/token, {s['kv'].get('model') or 'given'})")
    out.append("")
    out.append(f"  {'cache tokens':>12} {'bytes':>10} {'LRU':>7} {'LFU':>7} {'Belady':>7}")
    for p in s["curve"]:
        out.append(
            f"  {p['cache_tokens']:>12,} {human_bytes(p.get('cache_bytes')):>10} "
            f"{pct(p['lru']):>7} {pct(p['lfu']):>7} {pct(p['belady']):>7}"
        )
    out.append("")
    roles = ", ".join(
        f"{role} {pct(v)} ({pct(s['cached_share_by_role'].get(role))} cacheable)"
        for role, v in s["share_by_role"].items()
    )
    out.append(f"  tokens by role: {roles}")
    if s["top_prefixes"]:
        out.append("  top shared prefixes (tokens × requests → saved):")
        for p in s["top_prefixes"][:5]:
            out.append(
                f"    {p['tokens']:>7,} × {p['requests']:>7,} → {p['saved_tokens']:>12,} "
                f"({pct(p['saved_share'])})  {_short(p.get('head', ''))}"
            )
    if s["cache_killers"]:
        out.append("  cache killers:")
        for k in s["cache_killers"][:5]:
            out.append(
                f"    {k['requests']:,} request{'s' if k['requests'] != 1 else ''} lose "
                f"{k['lost_tokens']:,} tokens "
                f"({pct(k['lost_share'])}); e.g. line {k['example_lines'][0]} vs "
                f"{k['example_lines'][1]}: {k.get('suggestion', '')}"
            )
    if s.get("ttft"):
        t = s["ttft"]
        out.append(
            f"  estimated mean TTFT: {t['mean_cold_s'] * 1000:.1f} ms cold → "
            f"{t['mean_ideal_s'] * 1000:.1f} ms with the ideal cache ({t['device']})"
        )
    return "\n".join(out)


def _short(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _md_escape(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("`", "'")


def markdown(s: dict, plots: list[str]) -> str:
    bpt = (s.get("kv") or {}).get("bytes_per_token")
    lines = [
        f"# Prefix-cache analysis of `{s.get('source', '')}`",
        "",
        f"- Requests: **{s['requests']:,}**; {_malformed_line(s)}",
        (
            f"- Prompt tokens: **{s['prompt_tokens']:,}** (block size {s['block_size']}, "
            f"{s['namespaces']} namespace{'s' if s['namespaces'] != 1 else ''}, "
            f"{s['distinct_blocks']:,} distinct blocks)"
        ),
        (
            f"- Ideal hit rate (unbounded cache, block granularity): "
            f"**{pct(s['ideal_hit_rate'])}**, {s['ideal_saved_tokens']:,} prefill tokens saved"
        ),
        f"- LRU reaches 90% of the ideal at **{s['lru_90pct_tokens']:,} tokens** of cache"
        + (f" ({human_bytes(s['lru_90pct_tokens'] * bpt)} at {bpt:,} B/token)" if bpt else ""),
        f"- LRU reaches the ideal at {s['lru_full_tokens']:,} tokens",
        "",
    ]
    if s.get("ttft"):
        t = s["ttft"]
        lines += [
            (
                f"- Estimated mean time to first token ({t['device']}, measured prefill): "
                f"{t['mean_cold_s'] * 1000:.1f} ms without a cache, "
                f"{t['mean_ideal_s'] * 1000:.1f} ms with the ideal cache"
            ),
            "",
        ]
    lines += ["## Hit rate vs cache size", ""]
    if "curve.png" in plots:
        lines += ["![hit rate vs cache size](curve.png)", ""]
    lines += ["| cache tokens | bytes | LRU | LFU | Belady |", "|---:|---:|---:|---:|---:|"]
    for p in s["curve"]:
        lines.append(
            f"| {p['cache_tokens']:,} | {human_bytes(p.get('cache_bytes'))} | {pct(p['lru'])} "
            f"| {pct(p['lfu'])} | {pct(p['belady'])} |"
        )
    lines += ["", "## Where the tokens are", ""]
    if "roles.png" in plots:
        lines += ["![tokens by role](roles.png)", ""]
    lines += ["| role | share of prompt tokens | cacheable (ideal) |", "|---|---:|---:|"]
    for role, v in s["share_by_role"].items():
        lines.append(f"| {role} | {pct(v)} | {pct(s['cached_share_by_role'].get(role))} |")
    lines += ["", "| token positions | share | cacheable (ideal) |", "|---|---:|---:|"]
    for b in s["share_by_position"]:
        lines.append(
            f"| {b['start']:,}–{b['end']:,} | {pct(b['share'])} | {pct(b['ideal_hit_rate'])} |"
        )
    if "positions.png" in plots:
        lines += ["", "![tokens by position](positions.png)"]
    lines += ["", "## Top shared prefixes", ""]
    lines += ["| tokens | requests | saved tokens | first line | starts with | ends with |",
              "|---:|---:|---:|---:|---|---|"]
    for p in s["top_prefixes"]:
        lines.append(
            f"| {p['tokens']:,} | {p['requests']:,} ({pct(p['request_share'])}) | "
            f"{p['saved_tokens']:,} ({pct(p['saved_share'])}) | {p['first_line']} | "
            f"`{_md_escape(_short(p.get('head', ''), 48))}` | "
            f"`{_md_escape(_short(p.get('tail', ''), 48))}` |"
        )
    lines += ["", "## Cache killers", ""]
    if not s["cache_killers"]:
        lines.append("None found: no request shares most of its content with an earlier one "
                     "while diverging early.")
    for k in s["cache_killers"]:
        lines.append(
            f"- **{k['requests']:,} requests lose {k['lost_tokens']:,} tokens** "
            f"({pct(k['lost_share'])} of all prompt tokens). Example: line "
            f"{k['example_lines'][0]} vs line {k['example_lines'][1]}"
            + (f", first difference at token {k['divergence_token']}"
               if "divergence_token" in k else "")
            + (f", {k['volatile_tokens']} volatile tokens" if k.get("volatile_tokens") else "")
            + "."
        )
        if "excerpt" in k:
            lines.append(f"  - this: `{_md_escape(k['excerpt'])}`")
            lines.append(f"  - other: `{_md_escape(k['other_excerpt'])}`")
            lines.append(f"  - {k['suggestion']}")
    t = s.get("timing_s") or {}
    if t:
        lines += ["", f"_Analysed in {t.get('total', 0):.1f} s ({t.get('jobs', 1)} processes)._"]
    return "\n".join(lines) + "\n"


def plot(s: dict, out: Path) -> list[str]:
    """Write the PNG plots; returns their file names (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    bpt = (s.get("kv") or {}).get("bytes_per_token")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [max(p["cache_tokens"], 1) for p in s["curve"]]
    for key, style in (("belady", "k--"), ("lfu", "s-"), ("lru", "o-")):
        ax.plot(xs, [100 * p[key] for p in s["curve"]], style, label=key.upper()
                if key != "belady" else "Belady (optimal)", markersize=4)
    ax.axhline(100 * s["ideal_hit_rate"], color="grey", lw=0.8, ls=":", label="ideal (unbounded)")
    ax.set_xscale("log")
    ax.set_xlabel("cache size (tokens)")
    ax.set_ylabel("prefill tokens saved (%)")
    ax.set_title("Prefix-cache hit rate vs cache size")
    if bpt:
        sec = ax.secondary_xaxis("top", functions=(lambda t: t * bpt / 2**30,
                                                   lambda g: g * 2**30 / bpt))
        sec.set_xlabel("cache size (GiB of KV)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=110)
    plt.close(fig)
    written.append("curve.png")

    if s["share_by_role"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        roles = list(s["share_by_role"])
        share = [100 * s["share_by_role"][r] for r in roles]
        cached = [100 * s["share_by_role"][r] * s["cached_share_by_role"].get(r, 0) for r in roles]
        ax.bar(roles, share, color="#bbbbbb", label="share of prompt tokens")
        ax.bar(roles, cached, color="#3a7dc9", label="of which cacheable (ideal)")
        ax.set_ylabel("% of prompt tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "roles.png", dpi=110)
        plt.close(fig)
        written.append("roles.png")

    if s["share_by_position"]:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        b = s["share_by_position"]
        labels = [f"{x['start']}–{x['end']}" for x in b]
        ax.bar(labels, [100 * x["share"] for x in b], color="#bbbbbb", label="share of tokens")
        ax.bar(labels, [100 * x["share"] * x["ideal_hit_rate"] for x in b], color="#3a7dc9",
               label="of which cacheable (ideal)")
        ax.set_xlabel("token position in prompt")
        ax.set_ylabel("% of prompt tokens")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "positions.png", dpi=110)
        plt.close(fig)
        written.append("positions.png")
    return written


def write_report(s: dict, directory: str | Path) -> list[Path]:
    """``summary.json``, ``report.md``, ``report.html`` (one self-contained file) and the plots
    in ``directory`` (created if needed)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(s, out)
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "report.md").write_text(markdown(s, plots))
    page = write_html(s, out, plots)
    return [out / "summary.json", out / "report.md", page, *(out / p for p in plots)]
