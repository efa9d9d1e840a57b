"""A profiled generation's figures per component (components_of) and print(prof): the generation told per
component and block (record/cells.py's Profile)."""
from __future__ import annotations

import pandas as pd

from ..fmt import generations_text, human_bytes, ms_text, table
from ..report.compare import ATTENTION_SPLIT
from ..report.show import COMPONENT_COLUMNS, component_rows


def components_of(kinds: pd.DataFrame, calls: pd.DataFrame, forwards: pd.DataFrame) -> pd.DataFrame:
    """Per component: its forwards and their time, its recorded attention calls and theirs (of the calls and
    forwards given: a whole block's, or one cell's generations), that time's attention core and projections
    (attention_core_ms, attention_proj_ms: its calls' attn_kernel_ms and proj_kernel_ms summed; NaN where none has
    them); NaN calls and time where its attention is not recorded (`not_recorded` names its modules), 0 where it
    has none."""
    rows = []
    for k in kinds.to_dict("records"):
        mine = forwards[forwards["component"] == k["component"]] if len(forwards) else forwards
        own = calls[calls["component"] == k["component"]] if len(calls) else calls
        recorded = bool(k.get("recorded", k.get("attention_calls") == k.get("attention_calls")))
        rows.append({"component": k["component"], "class": k["class"], "forwards": len(mine),
                     "time_ms": float(mine["time_ms"].sum()) if len(mine) else 0.0,
                     "attention_calls": len(own) if recorded else float("nan"),
                     "attention_ms": float(own["time_ms"].sum()) if recorded and len(own) else
                     0.0 if recorded else float("nan"), "attention_core_ms": _sum(own, "attn_kernel_ms"),
                     "attention_proj_ms": _sum(own, "proj_kernel_ms"), "not_recorded": k["not_recorded"]})
    return pd.DataFrame(rows, columns=["component", "class", "forwards", "time_ms", "attention_calls", "attention_ms",
                                       "attention_core_ms", "attention_proj_ms", "not_recorded"])


def _sum(rows: pd.DataFrame, column: str) -> float:
    """The rows' figure summed; NaN where no row has it."""
    return float(rows[column].sum(min_count=1)) if len(rows) and column in rows else float("nan")


def _top_blocks(calls: pd.DataFrame, wall_ms: float, top: int = 5) -> str:
    """The blocks whose calls took most (a block at each size apart): their calls, time (its core and projections:
    '-' where the calls have no split), share of the wall time, tokens and peak."""
    by = calls.groupby(["block", "tokens_q", "tokens_k"]).agg(
        calls=("time_ms", "size"), time_ms=("time_ms", "sum"), core=("attn_kernel_ms", lambda v: v.sum(min_count=1)),
        proj=("proj_kernel_ms", lambda v: v.sum(min_count=1)), peak=("peak_bytes", "max")).sort_values(
        "time_ms", ascending=False)
    rows = [{"block": b, "calls": str(r.calls), "time": f"{r.time_ms:.1f} ms", "core": ms_text(r.core),
             "projections": ms_text(r.proj), "share": f"{100 * r.time_ms / wall_ms:.1f}%", "tokens": f"{q} x {k}",
             "peak": human_bytes(r.peak)} for (b, q, k), r in by.head(top).iterrows()]
    return table(rows, [(c, c) for c in ("block", "calls", "time", "core", "projections", "share", "tokens", "peak")])


def summary(prof) -> str:
    """A Profile (session.py) in words: per component its forwards, time and share of the generation's wall time, its attention's (its core and
    projections apart); the blocks that took most; what the split is (ATTENTION_SPLIT); the notes."""
    wall_ms = prof.wall_s * 1e3 or float("nan")
    f = prof.facts
    g = prof.generations
    calls = generations_text(g["steps"].tolist(), g["wall_s"].tolist()) if len(g) > 1 else f"{f.get('steps')} steps"
    sizes = list(dict.fromkeys(f"{r['width']}x{r['height']}, batch {r['batch']}" for r in g.to_dict("records"))) \
        or [f"{f.get('width')}x{f.get('height')}, batch {f.get('batch')}"]
    head = (f"profile of {f.get('pipeline') or prof.target}: {calls}; "
            f"{' and '.join(sizes) + (' (a cell each)' if len(sizes) > 1 else '')}, {f.get('dtype')} on "
            f"{f.get('device')}; {prof.wall_s:.3f} s of wall time; processors {f.get('processors') or '-'}")
    rows = component_rows(prof.components.to_dict("records"), wall_ms)
    lines = [head, "", table(rows, [(c, c) for c in COMPONENT_COLUMNS if c != "class"])]
    if len(prof.calls):
        lines += ["", "blocks that took most (all their calls):", _top_blocks(prof.calls, wall_ms)]
    lines += [f"{ATTENTION_SPLIT}."]
    lines += [f"note: {n}" for n in prof.notes]
    if prof.run_dir:
        lines.append(f"stored as run {prof.run_dir.name} under {prof.run_dir.parent} (attnprof show {prof.run_dir})")
    return "\n".join(lines)
