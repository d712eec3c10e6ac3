"""``report.html``: the analysis as one self-contained page (the same figures, tables and plots
as ``report.md``, the PNGs embedded as base64), to open or mail without the directory.

Every string from the log (prompt excerpts, the source path) is escaped: a log is data, and an
excerpt may hold any text, markup included.
"""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from prefixcache.analyze.units import human_bytes, pct

_STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 64em; margin: 2em auto; padding: 0 1em;
       color: #1d2430; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .6em 0; }
th, td { padding: .25em .7em; border-bottom: 1px solid #e3e6ea; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: .9em; background: #f3f4f6; padding: 0 .2em; }
img { max-width: 100%; }
.muted { color: #5b6575; }
"""


def _img(directory: Path, name: str, alt: str, plots: list[str]) -> str:
    if name not in plots:
        return ""
    data = base64.b64encode((directory / name).read_bytes()).decode("ascii")
    return f'<p><img alt="{escape(alt)}" src="data:image/png;base64,{data}"></p>'


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(
            f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)
        ) + "</tr>"
        for r in rows
    )  # fmt: skip
    return f"<table><tr>{th}</tr>{body}</table>"


def _code(text) -> str:
    text = " ".join(str(text or "").split())
    return f"<code>{escape(text[:80] + ('…' if len(text) > 80 else ''))}</code>"


def html(s: dict, directory: str | Path, plots: list[str]) -> str:
    """The page for summary ``s``; ``plots`` are PNG names written in ``directory``."""
    d = Path(directory)
    bpt = (s.get("kv") or {}).get("bytes_per_token")
    ns = s["namespaces"]
    facts = [
        f"Requests: <b>{s['requests']:,}</b>; {s['malformed']['count']:,} malformed lines skipped",
        (
            f"Prompt tokens: <b>{s['prompt_tokens']:,}</b> (block size {s['block_size']}, {ns} "
            f"namespace{'s' if ns != 1 else ''}, {s['distinct_blocks']:,} distinct blocks)"
        ),
        (
            "Ideal hit rate (unbounded cache, block granularity): "
            f"<b>{pct(s['ideal_hit_rate'])}</b>, {s['ideal_saved_tokens']:,} prefill tokens saved"
        ),
        f"LRU reaches 90% of the ideal at <b>{s['lru_90pct_tokens']:,} tokens</b> of cache"
        + (f" ({human_bytes(s['lru_90pct_tokens'] * bpt)} at {bpt:,} B/token)" if bpt else ""),
        f"LRU reaches the ideal at {s['lru_full_tokens']:,} tokens",
    ]
    if s.get("ttft"):
        t = s["ttft"]
        facts.append(
            f"Estimated mean time to first token ({escape(str(t['device']))}, measured prefill): "
            f"{t['mean_cold_s'] * 1000:.1f} ms without a cache, {t['mean_ideal_s'] * 1000:.1f} ms "
            "with the ideal cache"
        )
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Prefix-cache analysis of {escape(str(s.get('source', '')))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Prefix-cache analysis of <code>{escape(str(s.get('source', '')))}</code></h1>",
        "<ul>" + "".join(f"<li>{f}</li>" for f in facts) + "</ul>",
        "<h2>Hit rate vs cache size</h2>",
        _img(d, "curve.png", "hit rate vs cache size", plots),
        _table(
            ["cache tokens", "bytes", "LRU", "LFU", "Belady"],
            [
                [
                    f"{p['cache_tokens']:,}",
                    human_bytes(p.get("cache_bytes")),
                    pct(p["lru"]),
                    pct(p["lfu"]),
                    pct(p["belady"]),
                ]
                for p in s["curve"]
            ],
            {0, 1, 2, 3, 4},
        ),
        "<h2>Where the tokens are</h2>",
        _img(d, "roles.png", "tokens by role", plots),
        _table(
            ["role", "share of prompt tokens", "cacheable (ideal)"],
            [
                [escape(r), pct(v), pct(s["cached_share_by_role"].get(r))]
                for r, v in s["share_by_role"].items()
            ],
            {1, 2},
        ),
        _table(
            ["token positions", "share", "cacheable (ideal)"],
            [
                [f"{b['start']:,}–{b['end']:,}", pct(b["share"]), pct(b["ideal_hit_rate"])]
                for b in s["share_by_position"]
            ],
            {1, 2},
        ),
        _img(d, "positions.png", "tokens by position", plots),
        "<h2>Top shared prefixes</h2>",
        _table(
            ["tokens", "requests", "saved tokens", "first line", "starts with", "ends with"],
            [
                [
                    f"{p['tokens']:,}",
                    f"{p['requests']:,} ({pct(p['request_share'])})",
                    f"{p['saved_tokens']:,} ({pct(p['saved_share'])})",
                    str(p["first_line"]),
                    _code(p.get("head")),
                    _code(p.get("tail")),
                ]
                for p in s["top_prefixes"]
            ],
            {0, 1, 2, 3},
        ),
        "<h2>Cache killers</h2>",
    ]
    if not s["cache_killers"]:
        out.append("<p class='muted'>None found: no request shares most of its content with an "
                   "earlier one while diverging early.</p>")  # fmt: skip
    items = []
    for k in s["cache_killers"]:
        text = (f"<b>{k['requests']:,} requests lose {k['lost_tokens']:,} tokens</b> "
                f"({pct(k['lost_share'])} of all prompt tokens). Example: line "
                f"{k['example_lines'][0]} vs line {k['example_lines'][1]}")  # fmt: skip
        if "divergence_token" in k:
            text += f", first difference at token {k['divergence_token']}"
        if "excerpt" in k:
            text += (f"<br>this: {_code(k['excerpt'])}<br>other: {_code(k['other_excerpt'])}"
                     f"<br>{escape(str(k.get('suggestion', '')))}")  # fmt: skip
        items.append(f"<li>{text}</li>")
    if items:
        out.append("<ul>" + "".join(items) + "</ul>")
    out.append("</body></html>")
    return "\n".join(x for x in out if x) + "\n"


def write_html(s: dict, directory: str | Path, plots: list[str]) -> Path:
    path = Path(directory) / "report.html"
    path.write_text(html(s, directory, plots), encoding="utf-8")
    return path
