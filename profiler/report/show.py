"""Plain-text summaries of a stored run (attnprof show)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from ..backends import label
from ..fmt import human_bytes, table
from ..store import BLOCKS, CELLS, DONE_STATUSES, Run, list_runs
from ..workload import label as settings_label

UNREADABLE = (OSError, ValueError, KeyError, TypeError)  # JSON, Arrow (ValueError) and missing-key errors


def runs_index(root: Path) -> pd.DataFrame:
    """One row per run folder under root, newest last; a run that cannot be read gets a row with `warning` set."""
    rows = [_index_row(path) for path in list_runs(root)]
    columns = ["run_id", "created", "models", "device", "backends", "cells", *DONE_STATUSES, "pending", "warning",
               "versions", "git", "readable"]
    return pd.DataFrame(rows, columns=columns)


def _index_row(path: Path) -> dict:
    row = {"run_id": path.name, "readable": False, "warning": ""}
    try:
        run = Run.open(path)
        m = run.manifest()
        env, sweep = m.get("environment") or {}, m.get("sweep") or {}
        row.update(created=str(m.get("created_at", ""))[:16].replace("T", " "),
                   models=", ".join(sweep.get("models", [])),
                   device=f"{env.get('device')} ({env.get('device_name')})",
                   backends=", ".join(label(*b) for b in sweep.get("backends", [])), cells=len(m.get("cells", [])),
                   versions=f"torch {env.get('torch')}, diffusers {env.get('diffusers')}, python {env.get('python')}",
                   git=str(env.get("git_revision") or "")[:12])
        for name in (CELLS, BLOCKS):  # the footer is enough to tell a truncated file
            if (path / name).is_file():
                pq.read_metadata(path / name)
        cells = run.cells()
        counts = cells["status"].value_counts() if len(cells) else pd.Series(dtype=int)
    except UNREADABLE as e:
        row["warning"] = f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    row.update({s: int(counts.get(s, 0)) for s in DONE_STATUSES}, readable=True)
    row["pending"] = max(0, row["cells"] - int(counts.sum()))
    if row["pending"] and not m.get("ended_at"):
        row["warning"] = f"unfinished: {int(counts.sum())} of {row['cells']} cells recorded (running, or stopped)"
    elif row["pending"]:
        row["warning"] = f"incomplete: {row['pending']} of {row['cells']} cells never recorded"
    return row


def format_runs(root: Path) -> str:
    index = runs_index(root)
    if not len(index):
        return f"no runs under {root}: make one with make profile, attnprof run or attnprof sweep"
    rows = []
    for r in index.to_dict("records"):
        counts = ", ".join(f"{r[s]} {s}" for s in DONE_STATUSES if r.get(s)) if r["readable"] else ""
        rows.append({"run": r["run_id"], "created": r.get("created") or "", "models": r.get("models") or "",
                     "device": r.get("device") or "", "cells": f"{r.get('cells') or 0}: {counts or '-'}",
                     "note": r["warning"]})
    return table(rows, [(c, c) for c in ("run", "created", "models", "device", "cells", "note")])


def status_table(run: Run) -> str:
    """Statuses per backend (rows) and size (columns): the closing table of a run or sweep. Where a run holds more
    than one model or setting, each row names them too."""
    cells = run.cells()
    if not len(cells):
        return "no cells recorded"
    settings = cells["settings"] if "settings" in cells else [None] * len(cells)
    what = [f"{m}{' (' + settings_label(s) + ')' if settings_label(s) else ''}" for m, s in zip(cells["model"],
                                                                                             settings)]
    cells = cells.assign(size=cells["width"].astype(str) + "x" + cells["height"].astype(str),
                         backend=[label(b, o) for b, o in zip(cells["backend"], cells["backend_options"])],
                         what=what)
    if cells["what"].nunique() > 1:
        cells["backend"] = cells["what"] + " " + cells["backend"]
    sizes = list(dict.fromkeys(cells["size"]))
    rows = []
    for backend, group in cells.groupby("backend", sort=False):
        row = {"backend": backend}
        for size in sizes:
            counts = group[group["size"] == size]["status"].value_counts()
            row[size] = ", ".join(s if n == 1 else f"{s} x{n}" for s, n in counts.items()) or "-"
        rows.append(row)
    return table(rows, [("backend", "backend")] + [(s, s) for s in sizes])


def _ratio(measured, predicted) -> str:
    """measured / predicted, where both are there."""
    if measured is None or predicted is None or measured != measured or predicted != predicted or not predicted:
        return ""
    return f"{measured / predicted:.3f}"


def format_run(run: Run) -> str:
    m = run.manifest()
    env = m.get("environment", {})
    cells, blocks = run.read()
    lines = [f"run {run.id}  ({run.path})",
             f"created {m.get('created_at')}  ended {m.get('ended_at') or 'not yet (running or stopped)'}",
             f"device {env.get('device')} ({env.get('device_name')}), torch {env.get('torch')}, "
             f"diffusers {env.get('diffusers')}, git {str(env.get('git_revision'))[:12]}",
             f"command: {m.get('command')}", ""]
    if not len(cells):
        return "\n".join(lines + [f"no cells recorded yet ({len(m.get('cells', []))} planned)"])
    rows = []
    for c in cells.to_dict("records"):
        ok = c["status"] == "ok"
        rows.append({
            "model": c["model"], "settings": settings_label(c.get("settings")) or "-",
            "size": f"{c['width']}x{c['height']}", "batch": c["batch"], "dtype": c["dtype"],
            "backend": label(c["backend"], c["backend_options"]), "status": c["status"],
            "forward": f"{c['forward_time_ms']:.1f} ms" if ok else "-",
            "attention": f"{c['attention_time_ms']:.1f} ms" if ok else "-",
            "attn peak": human_bytes(c["attention_peak_mem_bytes"]) if ok else "-",
            "predicted": human_bytes(c.get("predicted_peak_bytes")),
            "fwd peak": human_bytes(c.get("forward_peak_total_bytes")) if ok else "-",
            "fwd predicted": human_bytes(c.get("predicted_forward_peak_bytes")),
            "ratio": _ratio(c.get("forward_peak_total_bytes"), c.get("predicted_forward_peak_bytes")) if ok else "",
            "rel err": f"{c['max_rel_err']:.1e}{'' if c['error_ok'] else ' (!)'}" if ok else "-",
            "noisy": "noisy" if ok and c["noisy"] else "",
            "note": "" if ok else str(c["error"])[:90],
        })
    cols = ["model"] + (["settings"] if any(r["settings"] != "-" for r in rows) else []) + [
            "size", "batch", "dtype", "backend", "status", "forward", "attention", "attn peak",
            "predicted", "fwd peak", "fwd predicted", "ratio", "rel err", "noisy", "note"]
    lines.append(table(rows, [(c, c) for c in cols]))
    lines += ["", "attn peak: the largest call's measured transient; predicted: its memory model. fwd peak: the "
              "forward's peak counted as the planner counts it (weights + inputs + the forward's transient), beside "
              "the planner's prediction from fake tensors (attnprof plan), and their ratio."]
    if len(blocks):
        ok = blocks[blocks["status"] == "ok"]
        top = ok.sort_values("peak_mem_bytes", ascending=False).head(5)
        lines += ["", "largest measured per-call peaks:"]
        lines.append(table([{
            "backend": label(b["backend"], b["backend_options"]), "size": f"{b['width']}x{b['height']}",
            "block": b["block"],
            "tokens": f"{b['tokens_q']}x{b['tokens_k']}", "time": f"{b['time_ms']:.2f} ms",
            "peak": human_bytes(b["peak_mem_bytes"]), "predicted": human_bytes(b["predicted_peak_bytes"]),
            "kernel": b["kernel"]} for b in top.to_dict("records")],
            [(c, c) for c in ("backend", "size", "block", "tokens", "time", "peak", "predicted", "kernel")]))
    return "\n".join(lines)
