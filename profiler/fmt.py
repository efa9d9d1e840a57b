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
    if abs(n) >= 1e15:
        return f"{n:.3g}"  # 1.78e+20: past tera a unit letter says less than the exponent
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


def terminal_width(default: int = 120) -> int:
    """$COLUMNS where set, else the width of the terminal that standard output is, else default (output into a file
    or a pipe): what `show` fits its tables to."""
    import os
    import sys

    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else default
    except (OSError, ValueError, AttributeError):  # a stream with no file behind it (captured output)
        return default


def fitted_table(rows: list[dict], columns: list[tuple[str, str]], width: int, drop: list[str]) -> tuple[str, list]:
    """table() within width characters: the columns of `drop` left out in that order until it fits (the others
    always kept). (the table, the headers left out)."""
    columns, dropped = list(columns), []
    for name in drop:
        if max(map(len, table(rows, columns).splitlines())) <= width:
            break
        if any(h == name for h, _ in columns):
            columns = [(h, k) for h, k in columns if h != name]
            dropped.append(name)
    return table(rows, columns), dropped
