"""How the reports write figures: shares as percentages, sizes in binary units."""

from __future__ import annotations


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
