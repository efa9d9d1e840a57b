"""Formatting for people: byte sizes, counts and plain-text tables. Only for display; stored values stay raw."""
from __future__ import annotations

import sys


def human_bytes(n) -> str:
    if n is None or n != n:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ms_text(value, digits: int = 1) -> str:
    """A time in milliseconds as a person reads it in a table: '12.3 ms' (digits after the point); '-' where it is
    unknown (None, NaN)."""
    return f"{value:.{digits}f} ms" if value is not None and value == value else "-"


def human_ms(ms, small: int = 3) -> str:
    """A time in milliseconds by its size: '0.123 ms' under 1 (small digits), '12.34 ms' under 100, else '1,234 ms';
    '-' where it is unknown (None, NaN)."""
    if ms is None or ms != ms:
        return "-"
    return f"{ms:.{small}f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 100 else f"{ms:,.0f} ms"


def long_ms(ms) -> str:
    """A time that may run to seconds (a generation's parts): '1,234.5 ms' under 10 s, else '12.34 s'; '-' for None."""
    return "-" if ms is None else f"{ms:,.1f} ms" if ms < 1e4 else f"{ms / 1e3:,.2f} s"


def duration(s: float) -> str:
    """Seconds of wall time: '95 s' under two minutes, else '3 min 5 s'."""
    return f"{s:.0f} s" if s < 120 else f"{int(s // 60)} min {s % 60:.0f} s"


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


def wrapped(lines: list[str], width: int | None = None, hang: int | None = None) -> list[str]:
    """Each line wrapped at the terminal's width (terminal_width), its continuation indented past its own indent (or
    hang columns: 'name: value' lines, each continuation under its value): a footer read on one screen."""
    import textwrap

    width = width or terminal_width()
    out = []
    for line in lines:
        indent = " " * hang if hang is not None else " " * (len(line) - len(line.lstrip())) + "    "
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False) or [line]
    return out


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


def generations_text(steps: list[int], seconds: list[float]) -> str:
    """A recorded run's pipeline calls as people read them: '4 steps, 0.41 s' (one), '2 generations of 4 steps,
    0.22 s and 0.19 s' (each named up to four), '2 generations (6 and 4 steps), ...', '10 generations of 4 steps,
    median 0.20 s (0.19 to 0.22 s)'."""
    import statistics

    if len(seconds) <= 1:
        return f"{steps[0] if steps else 0} steps, {seconds[0] if seconds else 0:.2f} s"
    each = [f"{s:.2f} s" for s in seconds]
    times = (", ".join(each[:-1]) + f" and {each[-1]}" if len(seconds) <= 4 else
             f"median {statistics.median(seconds):.2f} s ({min(seconds):.2f} to {max(seconds):.2f} s)")
    how = f"of {steps[0]} steps" if len(set(steps)) == 1 else f"({min(steps)} to {max(steps)} steps)" \
        if len(steps) > 4 else f"({', '.join(map(str, steps[:-1]))} and {steps[-1]} steps)"
    return f"{len(seconds)} generations {how}, {times}"


def progress(command: str, quiet: bool):
    """A command's progress: each line on stderr after `attnprof COMMAND:`; nothing where quiet."""
    if quiet:
        return lambda line: None
    return lambda line: print(f"attnprof {command}: {line}", file=sys.stderr, flush=True)


def typed() -> str:
    """The command line as the user typed it (attnprof ARGS), stored with what it made."""
    return " ".join(["attnprof"] + sys.argv[1:])
