"""Data transforms behind the Generation page and the report's recorded generations: a recorded generation (attnprof
record, profiler.profile) per component, step and call. Plain pandas over profiler.store, no Streamlit, tested by
pytest."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from profiler.store import Run


def recorded(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells that hold a recorded generation (kind record) and ended ok."""
    if not len(cells) or "kind" not in cells:
        return cells.iloc[0:0]
    return cells[(cells["kind"] == "record") & (cells["status"] == "ok")]


def generation_label(cell: dict) -> str:
    """What names one recorded generation's cell on the page: 'loaded 64x64 (20261205-083539-984b)'."""
    return f"{cell['backend_label']} {cell['size']} ({cell['run_id']})"


def load_calls(path: Path, cell_id: str) -> pd.DataFrame:
    """Every attention call of a recorded cell with its component, generation and step (calls-<cell_id>.parquet;
    empty where the run holds none)."""
    return Run.open(Path(path)).read_frame(f"calls-{cell_id}")


def generation_line(cell: dict) -> str:
    """One line of what the generation was: 'StableDiffusionPipeline, loaded (AttnProcessor2_0 x34): 3 steps at 64x64,
    batch 2, DDIMScheduler, guidance 7.5; 0.62 s of wall time'; its pipeline calls as fmt.generations_text says
    them where it holds several ('2 generations (3 and 2 steps), 0.22 s and 0.19 s at 64x64, ...')."""
    from profiler.fmt import generations_text
    from profiler.report.findings import listed

    times, steps = listed(cell.get("generation_times_s")), listed(cell.get("generation_steps"))
    calls = generations_text(steps, times) if len(times) > 1 else f"{cell['steps']} steps"
    return (f"{cell['pipeline']}, {cell['backend_label']} ({cell['processors']}): {calls} at {cell['size']}, batch "
            f"{cell['batch']}, {cell['scheduler']}, guidance {cell['guidance']}; {cell['generation_s']:.2f} s of wall "
            "time")


def component_table(cell: dict) -> pd.DataFrame:
    """Per component of a recorded generation: its forwards and their time with its share of the wall time, its
    attention calls, their time (its core and projections apart: _split), and attention's share of the component's
    time and of the generation's. Where a component's attention was not recorded (compiled, or a kind of module with
    no hook) its calls say 'not recorded (...)' and its attention figures are NaN, never 0."""
    import json

    wall_ms = cell["generation_s"] * 1e3
    rows = []
    for r in json.loads(cell["components"]):
        recorded = r["attention_calls"] is not None and r["attention_calls"] == r["attention_calls"]  # not NaN
        missing = r.get("not_recorded") or ""
        attention = r["attention_ms"] if recorded else float("nan")
        rows.append({"cell": generation_label(cell), "component": r["component"], "class": r["class"],
                     "forwards": r["forwards"], "time_ms": r["time_ms"], "time_share_pct": 100 * r["time_ms"] / wall_ms,
                     "attention_calls": int(r["attention_calls"]) if recorded else
                     f"not recorded ({missing})" if missing else "not recorded",
                     "attention_ms": attention, **_split(r, recorded),
                     "rest_ms": r["time_ms"] - attention if recorded else float("nan"),
                     "attention_of_component_pct": 100 * attention / r["time_ms"] if r["time_ms"] else float("nan"),
                     "attention_share_pct": 100 * attention / wall_ms})
    return pd.DataFrame(rows)


def _split(component: dict, recorded: bool) -> dict:
    """A component's attention time split (report.compare.ATTENTION_SPLIT): attention_core_ms and
    attention_projections_ms; NaN where its attention is not recorded or its run stored no split."""
    nan = float("nan")
    return {"attention_core_ms": component.get("attention_core_ms", nan) if recorded else nan,
            "attention_projections_ms": component.get("attention_proj_ms", nan) if recorded else nan}


def _split_sums(calls: pd.DataFrame) -> dict:
    """Aggregations (groupby.agg) of calls' time split: core_ms, projections_ms (NaN where no call has it)."""
    some = lambda v: v.sum(min_count=1)  # noqa: E731
    return {name: (column, some) if column in calls else ("time_ms", lambda v: float("nan"))
            for name, column in (("core_ms", "attn_kernel_ms"), ("projections_ms", "proj_kernel_ms"))}


def step_table(calls: pd.DataFrame, label: str) -> pd.DataFrame:
    """Per generation, step and component of the denoising loop: its attention calls and their time summed (the
    calls outside the loop, a text encoder's and the VAE's, have no step)."""
    loop = calls[calls["step"].notna()] if len(calls) else calls
    if not len(loop):
        return pd.DataFrame(columns=["cell", "generation", "step", "component", "calls", "attention_ms"])
    out = loop.groupby(["generation", "step", "component"], as_index=False).agg(
        calls=("time_ms", "size"), attention_ms=("time_ms", "sum"))
    return out.assign(cell=label, generation=out["generation"].astype(int), step=out["step"].astype(int))


def generations_table(calls: pd.DataFrame, cell: dict) -> pd.DataFrame:
    """Per pipeline call (generation) of a recorded cell: its steps, its attention calls and their time, per
    component and in all; its wall time where the run recorded one per generation."""
    if not len(calls):  # none recorded (a compiled component): no row, the columns a reader asks for
        return pd.DataFrame(columns=["generation", "steps", "calls", "attention_ms", "core_ms", "projections_ms",
                                     "cell"])
    per = calls.groupby(["generation", "component"])["time_ms"].sum().unstack("component").add_suffix("_attention_ms")
    out = calls.groupby("generation").agg(steps=("step", "nunique"), calls=("time_ms", "size"),
                                          attention_ms=("time_ms", "sum"), **_split_sums(calls)).join(per).reset_index()
    times = cell.get("generation_times_s")
    if hasattr(times, "__len__") and len(times) == len(out):
        out.insert(2, "wall_s", list(times))
    return out.assign(cell=generation_label(cell))


def costliest_blocks(calls: pd.DataFrame, label: str, top: int = 10, among=None) -> pd.DataFrame:
    """The blocks whose calls took the most, all their calls in every generation summed: component, block, kind,
    shape, calls, the total (its core and projections apart: core_ms, projections_ms) and the median call, and the
    share of all the generation's attention time. among: those blocks only, however many (a second generation's
    figures for the first one's costliest)."""
    if not len(calls):
        return pd.DataFrame(columns=["component", "block", "kind", "heads", "head_dim", "calls", "total_ms",
                                     "core_ms", "projections_ms", "median_ms", "share_of_attention_pct", "cell",
                                     "tokens"])
    total = calls["time_ms"].sum()
    if among is not None:
        calls, top = calls[calls["block"].isin(among)], len(among)
    out = calls.groupby(["component", "block"], as_index=False, sort=False).agg(
        kind=("kind", "first"), heads=("heads", "first"), head_dim=("head_dim", "first"),
        tokens_q=("tokens_q", "first"), tokens_k=("tokens_k", "first"), calls=("time_ms", "size"),
        total_ms=("time_ms", "sum"), **_split_sums(calls), median_ms=("time_ms", "median"))
    out = out.assign(share_of_attention_pct=100 * out["total_ms"] / total, cell=label,
                     tokens=out["tokens_q"].astype(str) + " x " + out["tokens_k"].astype(str)).drop(
        columns=["tokens_q", "tokens_k"])
    return out.sort_values("total_ms", ascending=False, kind="stable").head(top).reset_index(drop=True)


def components_side_by_side(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two recorded generations' component tables (component_table) joined on the component: each one's time and
    attention time, and the second's over the first's."""
    keep = {"component": "component", "time_ms": "time_{}_ms", "attention_ms": "attention_{}_ms",
            "attention_share_pct": "attention_share_{}_pct"}
    side = lambda t, x: t[list(keep)].rename(columns={k: v.format(x) for k, v in keep.items()})  # noqa: E731
    out = side(a, "a").merge(side(b, "b"), on="component", how="outer")
    out = out.set_index("component").loc[list(dict.fromkeys([*a["component"], *b["component"]]))].reset_index()
    return out.assign(time_ratio=out["time_b_ms"] / out["time_a_ms"],
                      attention_ratio=out["attention_b_ms"] / out["attention_a_ms"])
