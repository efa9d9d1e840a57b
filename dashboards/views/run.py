"""The Run page: one cell's attention calls on the U-Net map and per call, the roofline, a tune run's processor
map and the cells table."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import transforms as T
from dashboards import widgets as W

COLOUR_BY = {"time": ("time_ms", "time (ms)"), "peak memory": ("peak_mem_bytes", "peak memory")}


def sidebar(cells: pd.DataFrame) -> tuple[dict, dict]:
    """The cell to draw (one that ended ok) and what colours its map; for the URL and for draw alike."""
    ok = cells[cells["status"] == "ok"]
    keys = ok["run_id"] + "/" + ok["cell_id"]  # a cell id names a spec: two runs of one grid share it
    labels = dict(zip(keys, ok["size"] + " " + ok["backend_label"] + " " + ok["dtype"] + " b" +
                      ok["batch"].astype(str) + " (" + ok["model"] + ", " + ok["run_id"] + ")"))
    out = {}
    if labels:
        out["cell"] = W.choice_ui("Cell to draw", list(labels), "cell", next(iter(labels)), where=st.sidebar,
                                  fmt=labels.get)
    out["color"] = W.choice_ui("Colour by", list(COLOUR_BY), "color", "time", where=st.sidebar, horizontal=True)
    return out, out


def draw(picked: W.Picked, color: str, cell: str | None = None) -> None:
    """The chosen cell's calls, the roofline, the processor maps and the cells, then the runs' report."""
    cells, blocks, root = picked.cells, picked.blocks, picked.root
    st.header("Run")
    W.findings_ui(T.run_findings(cells, blocks))
    if cell is not None:
        run_id, cell_id = cell.split("/")
        mine = blocks[(blocks["run_id"] == run_id) & (blocks["cell_id"] == cell_id)]
        why = T.no_peaks_reason(cells[(cells["run_id"] == run_id) & (cells["cell_id"] == cell_id)])
        unit = component_maps(mine, color, why)
        layout = T.with_mem_unit(T.unet_layout(mine), ["peak_mem_bytes", "predicted_peak_bytes"])[0]
        left, right = st.columns(2)
        with left:
            W.chart(layout, C.call_bars("time_ms", "time per call (ms)", unit, len(layout)))
        with right:
            if not W.empty(why):  # a chart with no bars would say nothing: say why
                W.chart(layout, C.call_bars(f"peak_mem_{unit}", f"peak memory per call ({unit})", unit, len(layout)))
        shown = [c for c in ("call_index", "block", "stage", "level", "kind", "heads", "head_dim", "tokens_q",
                             "tokens_k", "score_elements", "score_bytes", "flops", "time_ms", "attn_kernel_ms",
                             "proj_kernel_ms", "iqr_ms", "noisy", "peak_mem_bytes", "predicted_peak_bytes",
                             "bytes_moved", "arithmetic_intensity", "achieved_flops_per_s", "pct_of_peak",
                             "roofline_bound", "kernel") if c in layout]
        W.table(layout[shown].rename(columns=T.SPLIT_NAMES), "blocks")
        traces_ui(cells, run_id, cell_id, root)
    else:
        W.empty("No cell of the chosen runs and filters ended ok: nothing to draw. The cells and their errors:")
    roofline_ui(cells, blocks)
    tuned_ui(cells, blocks)
    st.subheader("Cells")
    st.caption("forward peak total: measured, counted as the planner counts it (weights + inputs + the forward's "
               "transient); predicted forward peak: the planner's, from fake tensors; ratio: measured / predicted.")
    W.table(T.cells_table(cells), "cells")
    W.report_button(root, picked.run_ids)


def component_maps(blocks: pd.DataFrame, colour: str, why: str) -> str:
    """One cell's calls drawn per component, each in a chart of its own (transforms.by_component: a recorded
    generation's U-Net on the U, its VAE's mid block on a U of its own, its text encoder's layers as bars), coloured
    by time or peak memory (why: why no call has a peak). The memory unit of the cell's peaks."""
    field, title = COLOUR_BY[colour]
    unit = T.with_mem_unit(blocks, ["peak_mem_bytes", "predicted_peak_bytes"])[1]
    if field == "peak_mem_bytes":
        field, title = f"peak_mem_{unit}", f"peak memory ({unit})"
        W.empty(why)
    for component, rows in T.by_component(blocks):
        layout = T.with_mem_unit(T.unet_layout(rows), ["peak_mem_bytes", "predicted_peak_bytes"], unit)[0]
        st.subheader(T.component_title(component, layout))
        if T.mapped(layout):
            W.chart(layout, C.unet_map(field, title, unit))
        else:
            W.chart(layout, C.call_bars(field, title, unit, len(layout)))
    return unit


def tuned_ui(cells: pd.DataFrame, blocks: pd.DataFrame) -> None:
    """A tune run's processor map (attnprof tune): per block the backend chosen, its time, the runner-up's, why."""
    rows, lines = T.tuned_maps(cells, blocks)
    if not len(rows):
        return
    st.subheader("Processor map: the fastest backend per block")
    for line in lines:
        st.caption(line)
    W.table(rows, "tuned-map")


def roofline_ui(cells: pd.DataFrame, blocks: pd.DataFrame) -> None:
    points = T.roofline_points(blocks)
    lines = T.roofline_lines(cells, points)
    st.subheader("Roofline: each call against the device's measured limits")
    if not len(lines):
        W.empty("No call of the chosen cells has a place on the roofline (runs recorded before the device's limits "
                "were measured have none).")
        return
    st.caption("Each point one attention call of the chosen cells: its FLOPs (QK^T and PV) over its median time, "
               "against its FLOPs per byte moved in its backend's model. Dashed: the device's memory bandwidth and "
               "compute peak as the run measured them; a call below the lines leaves the device idle part of the time "
               "(the call's time includes its projections).")
    points, legend = T.labelled(points)
    W.chart(points, C.roofline(lines, legend))


def traces_ui(cells: pd.DataFrame, run_id: str, cell_id: str, root: Path) -> None:
    """The drawn cell's trace files (attnprof run --trace) as downloads: a Chrome / Perfetto trace of its probe
    forward, and on CUDA the allocator's memory snapshot."""
    row = cells[(cells["run_id"] == run_id) & (cells["cell_id"] == cell_id)]
    files = row["trace_files"].iloc[0] if len(row) and "trace_files" in row else None
    if not hasattr(files, "__len__") or not len(files):  # none, or a cell recorded without --trace (NaN)
        return
    st.caption("Traces of this cell's probe forward: open the .json in ui.perfetto.dev or chrome://tracing (each "
               "attention call a range named by its block); the .pickle in pytorch.org/memory_viz.")
    for i, name in enumerate(files):
        path = root / run_id / name
        if path.is_file():
            st.download_button(f"Download {Path(name).name}", path.read_bytes(), file_name=Path(name).name,
                               key=f"trace-{i}", on_click="ignore")
