"""The Compare page: backends against a baseline backend, or runs side by side by run or by an environment field."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import transforms as T
from dashboards import widgets as W


def sidebar(cells: pd.DataFrame) -> tuple[dict, dict]:
    """What the cells are side by side by (the backend, the run, an environment field that differs between the
    runs), the baseline, the budget of the best backend; for the URL, and with the runs' environments for draw."""
    runs = list(dict.fromkeys(cells["run_id"]))
    envs = T.run_envs([W.results_dir() / r for r in runs])
    choices = ["backend"] + (["run"] + T.differing(envs) if len(runs) > 1 else [])
    out = {"by": W.choice_ui("Side by side by", choices, "by", "run" if len(runs) > 1 else "backend",
                             where=st.sidebar)}
    if out["by"] == "backend":
        labels = T.options(cells, "backend_label")
        out["baseline"] = W.choice_ui("Baseline", labels, "baseline", "naive" if "naive" in labels else labels[0],
                                      where=st.sidebar)
    else:
        out["baseline"] = W.choice_ui("Baseline run", runs, "baseline", runs[0], where=st.sidebar)
    out["budget"] = W.text_ui("Budget for the best backend", "best_budget", "24GiB", where=st.sidebar)
    return out, {**out, "envs": envs}


def draw(picked: W.Picked, by: str, baseline: str, budget: str, envs: pd.DataFrame) -> None:
    """Side by side by `by` against the baseline, the best backend under the budget, by family; the runs' report."""
    cells = picked.cells
    st.header("Compare")
    sizes = T.options(cells, "size")
    if by == "backend":
        compare_backends(cells, baseline, sizes)
    else:
        compare_runs(T.with_series(cells, envs, by), by, baseline, sizes)
    best_ui(cells, budget)
    W.report_button(picked.root, picked.run_ids)


def best_ui(cells: pd.DataFrame, budget: str) -> None:
    """The fastest backend per device and size, in all and under the budget; the backends by family."""
    st.subheader("Best backend here")
    from profiler.spec import InputError, parse_bytes

    try:
        limit = parse_bytes(budget, "budget")
    except InputError as e:
        st.error(str(e))
        return
    st.caption(f"Per device and size: the fastest backend that ended ok, the memory-smallest, and the fastest whose "
               f"forward (weights + inputs + its transient) fits {T.human_bytes(limit)}.")
    W.table(T.best_backends(cells, limit), "best")
    st.subheader("By family: time beside error")
    st.caption("Reference, chunked, fused exact and fused approximate (int8 / fp8 kernels): each backend's attention "
               "time beside its error against the fp32 reference, so a fast kernel with a large error shows as such.")
    W.table(T.family_table(cells), "families")


def compare_backends(cells: pd.DataFrame, baseline: str, sizes: list[str]) -> None:
    cmp, unit = T.with_mem_unit(T.compare_table(cells, baseline), ["attention_peak_mem_bytes"])
    ok, legend = T.labelled(cmp[cmp["status"] == "ok"], T.CELL_SERIES)
    why = T.no_peaks_reason(cells[cells["status"] == "ok"])  # an empty chart would say nothing: say why
    st.subheader("Time against peak memory, per size")
    if not W.empty(why):
        W.chart(ok, C.time_against_peak(sizes, unit, legend), stretch=False)
    st.subheader(f"Ratio to {baseline} (below 1: faster or smaller)")
    left, right = st.columns(2)
    for where, y, title in ((left, "time_ratio", "time ratio"), (right, "peak_ratio", "peak memory ratio")):
        with where:
            if not W.empty(why if y == "peak_ratio" else ""):
                W.chart(ok, C.ratio_to_baseline(y, title, baseline, sizes, legend))
    st.subheader("Largest size that ran, per backend")
    W.table(T.largest_ok(cells), "largest")
    st.subheader("All cells")
    W.table(T.compare_table(cells, baseline), "compare")


def compare_runs(cells: pd.DataFrame, by: str, baseline: str, sizes: list[str]) -> None:
    """Runs side by side: each backend's time per size, a series per run (or environment value), and each other
    run judged against the baseline run cell by cell with the noise rule (profiler.report.compare)."""
    from profiler.report.compare import THRESHOLD, compare, machine_text, rule_text, summary, summary_text
    from profiler.store import Run

    ok, title = T.labelled(cells[cells["status"] == "ok"], T.CELL_SERIES[:-1])  # the runs: side by side
    st.subheader(f"Attention time per {title} and size, side by side by {by}")
    W.chart(ok, C.side_by_side(sizes, by, title), stretch=False)
    base = cells[cells["run_id"] == baseline]
    for run_id in [r for r in dict.fromkeys(cells["run_id"]) if r != baseline]:
        manifests = tuple(Run.open(W.results_dir() / r).manifest() for r in (baseline, run_id))
        result = compare(base, cells[cells["run_id"] == run_id], manifests=manifests)
        st.subheader(f"{run_id} against {baseline}")
        st.caption(f"{summary_text(summary(result))}. As attnprof diff judges: {rule_text(THRESHOLD)}. "
                   f"{machine_text(result, manifests)}.")
        W.table(T.verdicts_first(result["matched"]), f"diff-{run_id}")
        for side, name in (("only_a", baseline), ("only_b", run_id)):
            if len(result[side]):
                st.warning(f"{len(result[side])} cells only in {name}, left out of the comparison:")
                W.table(result[side], f"{side}-{run_id}")
