"""Formatting for people: byte sizes, counts and plain-text tables. Only for display; stored values stay raw."""
from __future__ import annotations


def human_bytes(n) -> str:
    if n is None or n != n:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n) -> str:
    if n is None or n != n:
        return "-"
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """columns: (header, key); values are shown as given (format them first)."""
    cells = [[str(r.get(key, "")) for _, key in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.rjust(w) if v[:1].isdigit() else v.ljust(w) for v, w in zip(c, widths)))
    return "\n".join(lines)
