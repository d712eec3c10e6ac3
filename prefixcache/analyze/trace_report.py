"""``prefixcache analyze TRACE --trace-format mooncake``: hit rate vs cache size per policy.

The summary (``--json`` prints it) is::

    {"infinite": x, "working_set_blocks": n,
     "sizes": {"5%": {"blocks": n, "lru": x, "belady": x, "<policy>": x, ...}, ...}}

(exactly these keys) and, with a disk tier (``--disk-multiple N``), ``"disk"``: per size and policy the RAM and
RAM + disk hit rates and the share of the infinite ideal they reach. With ``--engine-model``,
``"engine"``: ``{"block_tokens": b, "max_num_batched_tokens": n, "sizes": {"5%": {"blocks": n,
"<policy>": x, ...}}}``, the same sizes (in blocks of ``b`` tokens) replayed through the engine's
own cache core (``engine_sim.py``; None where the longest prompt does not fit the pool).
``--report DIR`` writes summary.json, report.md (the table) and hit_rate_vs_size.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.analyze.engine_sim import simulate_engine, trace_prompts
from prefixcache.analyze.trace_sim import capacity_for, next_uses, simulate_trace, size_label
from prefixcache.bench.mooncake import infinite_hit_rate, read_trace, working_set_blocks

# Restore cost as a fraction of recomputing, from docs/benchmarks-journal.md (disk restore seen by the
# client 4,886 tok/s against a 229 tok/s prefill on the CPU machine).
DEFAULT_RESTORE_COST = 229 / 4886


def trace_summary(path: str, fractions: list[float], policies: list[str],
                  disk_multiple: float = 0.0,
                  restore_cost: float = DEFAULT_RESTORE_COST, start_ms: float | None = None,
                  end_ms: float | None = None, max_requests: int | None = None,
                  engine: dict | None = None) -> dict:
    """The summary of the trace's requests in [start_ms, end_ms) (at most ``max_requests``),
    simulated alone (the cache starts empty at the window's first request; sizes are fractions
    of the window's own working set). ``engine``: also through the engine's cache core, with
    these ``simulate_engine`` options (block_tokens, max_num_batched_tokens)."""
    requests = read_trace(path, max_requests, start_ms=start_ms, end_ms=end_ms)
    ws = working_set_blocks(requests)
    summary: dict = {"infinite": round(infinite_hit_rate(requests), 4),
                     "working_set_blocks": ws, "sizes": {}}
    nxt = next_uses(requests) if "belady" in policies else None
    disk: dict = {}
    for f in fractions:
        cap = capacity_for(f, ws)
        label = size_label(f)
        row: dict = {"blocks": cap}
        drow: dict = {}
        for p in policies:
            r = simulate_trace(requests, p, cap, nxt=nxt if p == "belady" else None)
            row[p] = round(r.hit_rate, 4)
            if disk_multiple > 0:
                d = simulate_trace(requests, p, cap, int(disk_multiple * cap),
                                   nxt=nxt if p == "belady" else None)
                inf = summary["infinite"] or 1.0
                drow[p] = {"ram": round(d.ram_hit_rate, 4), "ram_disk": round(d.hit_rate, 4),
                           "of_infinite": round(d.hit_rate / inf, 4),
                           # prefill left, as a share of recomputing everything
                           "prefill_cost": round(1 - d.ram_hit_rate - (1 - restore_cost)
                                                 * (d.hit_rate - d.ram_hit_rate), 4)}
        summary["sizes"][label] = row
        if drow:
            disk[label] = {"blocks": int(disk_multiple * cap), **drow}
    if disk:
        summary["disk"] = {"multiple": disk_multiple, "restore_cost": round(restore_cost, 4),
                           "sizes": disk}
    if engine is not None:
        summary["engine"] = engine_summary(requests, fractions, policies, ws, **engine)
    return summary


def engine_summary(requests, fractions: list[float], policies: list[str], ws: int,
                   block_tokens: int = 16, max_num_batched_tokens: int = 2048) -> dict:
    """Hit rates of the online policies through the engine's cache core, per size."""
    prompts = trace_prompts(requests, block_tokens)
    longest = max((-(-len(p) // block_tokens) for p in prompts), default=0)
    sizes: dict = {}
    for f in fractions:
        cap = capacity_for(f, ws)
        row: dict = {"blocks": cap}
        for p in policies:
            if p == "belady":
                continue
            row[p] = None if cap < longest else round(simulate_engine(
                requests, p, cap, block_tokens, max_num_batched_tokens, prompts).hit_rate, 4)
        sizes[size_label(f)] = row
    return {"block_tokens": block_tokens, "max_num_batched_tokens": max_num_batched_tokens,
            "sizes": sizes}


def text_table(summary: dict, markdown: bool = False, name: str = "") -> str:
    sizes = summary["sizes"]
    policies = [k for k in next(iter(sizes.values()), {}) if k != "blocks"]
    lines = [(f"trace: {name}  working set: {summary['working_set_blocks']} blocks  "
              f"infinite-cache hit rate: {summary['infinite']:.3f}"), ""]
    head = ["size", "blocks", *policies]
    rows = [[label, str(r["blocks"]), *(f"{r[p]:.3f}" for p in policies)]
            for label, r in sizes.items()]
    if "disk" in summary:
        d = summary["disk"]
        head += [f"{p} RAM+disk" for p in policies]
        for row, (label, dr) in zip(rows, d["sizes"].items()):
            row += [f"{dr[p]['ram_disk']:.3f} ({dr[p]['of_infinite']:.0%})" for p in policies]
    lines += _table(head, rows, markdown)
    if "engine" in summary:
        e = summary["engine"]
        lines += ["", (f"through the engine's cache core (blocks of {e['block_tokens']} tokens, "
                       "one request at a time, one output token; '-': the longest prompt does "
                       "not fit):")]
        eps = [k for k in next(iter(e["sizes"].values()), {}) if k != "blocks"]
        erows = [[label, str(r["blocks"]), *("-" if r[p] is None else f"{r[p]:.3f}" for p in eps)]
                 for label, r in e["sizes"].items()]
        lines += _table(["size", "blocks", *eps], erows, markdown)
    if "disk" in summary:
        d = summary["disk"]
        lines.append("")
        lines.append(f"disk tier: {d['multiple']:g} x RAM, write-through LRU; a restore costs "
                     f"{d['restore_cost']:.3f} of recomputing (parenthesised: share of the "
                     "infinite-cache ideal)")
    return "\n".join(lines)


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*head), *(fmt.format(*r) for r in rows)]


def write_trace_report(summary: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json", out / "report.md", out / "hit_rate_vs_size.png"]
    paths[0].write_text(json.dumps(summary, indent=2) + "\n")
    paths[1].write_text("# Prefix-cache hit rate vs cache size\n\n"
                        + text_table(summary, markdown=True) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = summary["sizes"]
    xs = [r["blocks"] for r in sizes.values()]
    policies = [k for k in next(iter(sizes.values()), {}) if k != "blocks"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for p in policies:
        ax.plot(xs, [r[p] for r in sizes.values()], marker="o", label=p)
    for p, dr in ((p, summary["disk"]["sizes"]) for p in policies if "disk" in summary):
        ax.plot(xs, [dr[lab][p]["ram_disk"] for lab in sizes], ls="--", marker=".",
                label=f"{p} + disk x{summary['disk']['multiple']:g}")
    ax.axhline(summary["infinite"], color="gray", ls=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("RAM cache size (blocks)")
    ax.set_ylabel("hit rate (input tokens)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths
