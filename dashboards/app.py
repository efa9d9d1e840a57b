"""attnprof dashboard: a thin Streamlit view over the runs under a results folder (profiler.store) and the pure
transforms in dashboards/transforms.py.

    attnprof dashboard [--results DIR]          (or: streamlit run dashboards/app.py -- --results DIR)

The results folder comes from --results, else $ATTNPROF_RESULTS, else ./results. Filters live in the URL."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # streamlit puts only this file's folder on the path
    sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from dashboards import charts as C  # noqa: E402
from dashboards import transforms as T  # noqa: E402
from profiler.report.compare import ATTENTION_SPLIT  # noqa: E402
from profiler.store import list_runs  # noqa: E402

PAGES = ("Runs", "Run", "Generation", "Compare", "Scaling", "Planner", "Queue")
COLOUR_BY = {"time": ("time_ms", "time (ms)"), "peak memory": ("peak_mem_bytes", "peak memory")}


def results_dir() -> Path:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--results")
    args, _ = parser.parse_known_args(sys.argv[1:])
    return Path(args.results or os.environ.get("ATTNPROF_RESULTS") or "results")


# ---- cached loaders, keyed on the files' modification times and sizes

def _stamp(run: Path) -> tuple:
    return tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(run.iterdir())
                 if not f.name.startswith("."))


@st.cache_data(show_spinner=False, max_entries=8)
def load_index(root: str, stamps: tuple) -> pd.DataFrame:
    return T.load_index(Path(root))


@st.cache_data(show_spinner=False, max_entries=64)
def load_run(path: str, stamp: tuple) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    try:
        return (*T.load_run(Path(path)), "")
    except T.UNREADABLE as e:
        return pd.DataFrame(), pd.DataFrame(), f"{Path(path).name} is skipped, unreadable: {type(e).__name__}: {e}"


@st.cache_data(show_spinner=False, max_entries=16)
def load_calls(path: str, cell_id: str, stamp: tuple) -> pd.DataFrame:
    return T.load_calls(Path(path), cell_id)


@st.cache_data(show_spinner="Writing the report...", max_entries=4)
def report_html(paths: tuple[str, ...], stamps: tuple) -> str:
    from dashboards.report import render

    return render([Path(p) for p in paths])


def report_button(root: Path, run_ids: list[str]) -> None:
    """The same self-contained HTML file as attnprof report, for the chosen runs."""
    if run_ids:
        paths = tuple(str(root / r) for r in run_ids)
        st.download_button("Download report.html (self-contained, opens with no network)",
                           report_html(paths, tuple(_stamp(Path(p)) for p in paths)), file_name="report.html",
                           mime="text/html", key="report-html", on_click="ignore")


TIME_SIZES = (512, 768, 1024, 1280, 1536)  # square sizes of the Planner page's time chart
GENERATION_BACKENDS = ("sdpa", "xformers", "sliced", "naive")  # the Planner page's generation times


@st.cache_data(show_spinner="Tracing the forward on fake tensors...", max_entries=16)
def load_trace(model: str, width: int, height: int, batch: int, dtype: str) -> dict:
    from profiler.planner.forward import trace

    return trace(model, width, height, batch, dtype, "cuda")


@st.cache_data(show_spinner="Screening every 64-pixel step for each GPU size...", max_entries=8)
def load_largest(model: str, batch: int, dtype: str) -> list[dict]:
    from profiler.planner.fit import fit_many

    return fit_many(model, [g * T.GiB for g in T.GPU_SIZES_GIB], None, dtype, batch, verify=False)


@st.cache_data(show_spinner="Screening each phase of a generation for each GPU size...", max_entries=8)
def load_pipeline(pipeline: str, batch: int, dtype: str) -> list[dict]:
    from profiler.planner.pipeline import pipeline_by_budget

    return pipeline_by_budget(pipeline, [g * T.GiB for g in T.GPU_SIZES_GIB], dtype=dtype, batch=batch)


@st.cache_data(show_spinner="Counting each forward's ops on fake tensors...", max_entries=8)
def load_times(model: str, batch: int, dtype: str, gpu: str) -> pd.DataFrame:
    from profiler.attention import backends
    from profiler.planner.calibration import by_size

    names = [n for n in backends.names() if not backends.dispatched(n)]
    return pd.DataFrame(by_size(model, [(s, s) for s in TIME_SIZES], names, dtype, batch, gpu))


@st.cache_data(show_spinner="Counting each model's ops on fake tensors...", max_entries=8)
def load_generation_times(pipeline: str, width: int, height: int, steps: int, dtype: str) -> pd.DataFrame:
    from profiler.planner.generation import by_gpu

    return pd.DataFrame(by_gpu(pipeline, width, height, steps, list(GENERATION_BACKENDS), dtype))


def load_selected(root: Path, run_ids: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    tables = [load_run(str(root / r), _stamp(root / r)) for r in run_ids]
    cells = [c for c, _, _ in tables if len(c)]
    blocks = [b for _, b, _ in tables if len(b)]
    join = lambda parts: pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()  # noqa: E731
    return join(cells), join(blocks), [w for _, _, w in tables if w]


# ---- widgets: each returns plain values and starts from the URL's query parameter on a session's first run

NOT_HERE = "_not_here"  # what the link named that is not here, by widget key (link_warnings says it once)


def _seed(key: str, valid, default, multi: bool = False) -> None:
    if key not in st.session_state:
        asked = st.query_params.get_all(key)
        url = [v for v in asked if valid(v)]
        if len(url) < len(asked):
            st.session_state.setdefault(NOT_HERE, {})[key] = [v for v in asked if not valid(v)]
        st.session_state[key] = (url or list(default)) if multi else (url[0] if url else default)
    elif multi:
        st.session_state[key] = [v for v in st.session_state[key] if valid(v)]
    elif not valid(st.session_state[key]):
        st.session_state[key] = default


def multi_ui(label: str, options: list, key: str, default=(), fmt=str, **kw) -> list:
    _seed(key, options.__contains__, default, multi=True)
    return st.sidebar.multiselect(label, options, key=key, format_func=fmt, placeholder="all", **kw)


def choice_ui(label: str, options: list, key: str, default, where=None, horizontal=False):
    _seed(key, options.__contains__, default)
    if horizontal:
        return (where or st).radio(label, options, key=key, horizontal=True)
    return (where or st).selectbox(label, options, key=key)


def text_ui(label: str, key: str, default: str, where=None) -> str:
    _seed(key, lambda v: bool(str(v).strip()), default)
    return (where or st).text_input(label, key=key)


def link_warnings(root: Path) -> None:
    """Say what a shared link named that is not here (a run not in the results folder, a size not in the chosen
    runs, ...) and what is shown instead, rather than switch silently."""
    for key, missing in st.session_state.pop(NOT_HERE, {}).items():
        shown = st.session_state.get(key)
        shown = ", ".join(map(str, shown)) if isinstance(shown, list) else shown
        where = (f"in the results folder {root}" if key == "run" else "among the chosen runs' values"
                 if key in (*T.FILTERS, "cell", "baseline") else "one of the choices")
        st.warning(f"The link names {key} {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                   f"{where}: showing {shown or 'all'} instead.")


RUNS_PICKED = "_runs_picked"  # the runs came from a link or from the user: no page's default replaces them


def runs_ui(index: pd.DataFrame, page: str) -> list[str]:
    """The runs to show. Until a link or the user picks them, each page's default: on Scaling every run with cells
    (so that sizes run apart draw one line), on Generation the latest recorded generation, elsewhere the latest."""
    readable = index[index["readable"].astype(bool)]  # a bool mask also when empty (else: a column selection)
    recorded = readable[readable[list(T.DONE_STATUSES)].sum(axis=1) > 0]
    generations = recorded[recorded["kind"] == "record"]
    pool = list((generations if page == "Generation" and len(generations) else recorded if len(recorded)
                 else readable)["run_id"])
    default = pool if page == "Scaling" else pool[-1:]
    if "run" not in st.session_state and st.query_params.get_all("run"):
        st.session_state[RUNS_PICKED] = True
    if not st.session_state.get(RUNS_PICKED):
        st.session_state["run"] = default  # before the widget is drawn, as Streamlit allows

    def picked() -> None:
        st.session_state[RUNS_PICKED] = True

    label = dict(zip(index["run_id"], index["run_id"] + "  " + index["models"].fillna("")))
    return multi_ui("Runs", list(readable["run_id"]), "run", default, fmt=label.get, on_change=picked)


def filters_ui(cells: pd.DataFrame) -> dict[str, list]:
    names = {"settings_label": "Settings (ControlNet, IP-Adapter, ToMe, compiled; a VAE's part, tiling)"}
    return {c: multi_ui(names.get(c, c.capitalize()), T.options(cells, c), c) for c in T.FILTERS}


# ---- pieces of layout

def table(df: pd.DataFrame, name: str) -> None:
    """A table shown in human units, downloadable as CSV with raw numbers and units in the column names."""
    st.dataframe(T.display(df), hide_index=True, width="stretch")
    st.download_button(f"Download {name}.csv", df.to_csv(index=False), file_name=f"{name}.csv", mime="text/csv",
                       key=f"csv-{name}", on_click="ignore")


def chart(data: pd.DataFrame, spec: dict, stretch: bool = True) -> None:
    if "concat" in spec:  # small multiples: Streamlit names no data set for a concat's views, so the data goes inline
        return st.vega_lite_chart(C.with_data(spec, data), width="content")
    spec = C.coloured(spec, data)
    if stretch:  # fit the width only: a legend below the plot adds to the height instead of taking the plot's;
        # padding on the left, where a y title would otherwise stand a pixel or two outside the chart (clipped)
        spec = {"autosize": {"type": "fit-x", "contains": "padding"}, "padding": {"left": 8, "top": 5, "right": 5,
                                                                                  "bottom": 5}, **spec}
    st.vega_lite_chart(data, spec, width="stretch" if stretch else "content")


def empty_page(root: Path) -> None:
    st.info(f"No runs under `{root}` yet. Make one, then reload this page:\n\n"
            "```\nmake profile\n```\nor a small one on the CPU:\n\n"
            f"```\nattnprof run --model tiny-sd15 --size 256x256 --backend naive --backend sdpa --device cpu "
            f"--dtype float32 --out {root}\n```\nThe Planner page needs no run.")


def findings_ui(found: dict[str, list[str]]) -> None:
    """The chosen runs' headline findings (profiler.report.findings: what attnprof show says first)."""
    for run_id, sentences in found.items():
        if sentences:
            st.markdown(f"**Findings, {run_id}**\n\n" + "\n".join(f"- {s}" for s in sentences))


def runs_page(index: pd.DataFrame, found: dict[str, list[str]]) -> None:
    st.header("Runs")
    findings_ui(found)
    for row in index[index["warning"] != ""].itertuples():
        st.warning(f"{row.run_id}: {row.warning}")
    st.caption("One row per run; cells by status. Pick runs in the sidebar.")
    table(index, "runs")


def run_page(cells: pd.DataFrame, blocks: pd.DataFrame, cell: str | None, colour: str, root: Path) -> None:
    st.header("Run")
    findings_ui(T.run_findings(cells, blocks))
    if cell is not None:
        run_id, cell_id = cell.split("/")
        mine = blocks[(blocks["run_id"] == run_id) & (blocks["cell_id"] == cell_id)]
        empty = T.no_peaks_reason(cells[(cells["run_id"] == run_id) & (cells["cell_id"] == cell_id)])
        unit = component_maps(mine, colour, empty)
        layout = T.with_mem_unit(T.unet_layout(mine), ["peak_mem_bytes", "predicted_peak_bytes"])[0]
        left, right = st.columns(2)
        with left:
            chart(layout, C.call_bars("time_ms", "time per call (ms)", unit, len(layout)))
        with right:
            if empty:  # a chart with no bars would say nothing: say why
                st.info(f"{empty}.")
            else:
                chart(layout, C.call_bars(f"peak_mem_{unit}", f"peak memory per call ({unit})", unit, len(layout)))
        shown = [c for c in ("call_index", "block", "stage", "level", "kind", "heads", "head_dim", "tokens_q",
                             "tokens_k", "score_elements", "score_bytes", "flops", "time_ms", "attn_kernel_ms",
                             "proj_kernel_ms", "iqr_ms", "noisy", "peak_mem_bytes", "predicted_peak_bytes",
                             "bytes_moved", "arithmetic_intensity", "achieved_flops_per_s", "pct_of_peak",
                             "roofline_bound", "kernel") if c in layout]
        table(layout[shown].rename(columns=T.SPLIT_NAMES), "blocks")
        traces_ui(cells, run_id, cell_id, root)
    else:
        st.info("No cell of the chosen runs and filters ended ok: nothing to draw. The cells and their errors:")
    roofline_ui(cells, blocks)
    tuned_ui(cells, blocks)
    st.subheader("Cells")
    st.caption("forward peak total: measured, counted as the planner counts it (weights + inputs + the forward's "
               "transient); predicted forward peak: the planner's, from fake tensors; ratio: measured / predicted.")
    table(T.cells_table(cells), "cells")


def component_maps(blocks: pd.DataFrame, colour: str, empty: str) -> str:
    """One cell's calls drawn per component, each in a chart of its own (transforms.by_component: a recorded
    generation's U-Net on the U, its VAE's mid block on a U of its own, its text encoder's layers as bars), coloured
    by time or peak memory (empty: why no call has a peak). The memory unit of the cell's peaks."""
    field, title = COLOUR_BY[colour]
    unit = T.with_mem_unit(blocks, ["peak_mem_bytes", "predicted_peak_bytes"])[1]
    if field == "peak_mem_bytes":
        field, title = f"peak_mem_{unit}", f"peak memory ({unit})"
        if empty:
            st.info(f"{empty}.")
    for component, rows in T.by_component(blocks):
        layout = T.with_mem_unit(T.unet_layout(rows), ["peak_mem_bytes", "predicted_peak_bytes"], unit)[0]
        st.subheader(T.component_title(component, layout))
        if T.mapped(layout):
            chart(layout, C.unet_map(field, title, unit))
        else:
            chart(layout, C.call_bars(field, title, unit, len(layout)))
    return unit


def tuned_ui(cells: pd.DataFrame, blocks: pd.DataFrame) -> None:
    """A tune run's processor map (attnprof tune): per block the backend chosen, its time, the runner-up's, why."""
    rows, lines = T.tuned_maps(cells, blocks)
    if not len(rows):
        return
    st.subheader("Processor map: the fastest backend per block")
    for line in lines:
        st.caption(line)
    table(rows, "tuned-map")


def roofline_ui(cells: pd.DataFrame, blocks: pd.DataFrame) -> None:
    points = T.roofline_points(blocks)
    lines = T.roofline_lines(cells, points)
    st.subheader("Roofline: each call against the device's measured limits")
    if not len(lines):
        st.info("No call of the chosen cells has a place on the roofline (runs recorded before the device's limits "
                "were measured have none).")
        return
    st.caption("Each point one attention call of the chosen cells: its FLOPs (QK^T and PV) over its median time, "
               "against its FLOPs per byte moved in its backend's model. Dashed: the device's memory bandwidth and "
               "compute peak as the run measured them; a call below the lines leaves the device idle part of the time "
               "(the call's time includes its projections).")
    points, legend = T.labelled(points)
    chart(points, C.roofline(lines, legend))


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


def generation_page(cells: pd.DataFrame, chosen: list[str], root: Path) -> None:
    """A recorded generation (attnprof record, profiler.profile), or two side by side: per component the share of
    attention, per step and per generation the attention time, the costliest blocks."""
    st.header("Generation")
    if not chosen:
        st.info("None of the chosen runs holds a recorded generation (a run of kind record): make one with "
                "`attnprof record -- your_script.py` or `profiler.profile(pipe)`, then pick it in the sidebar.")
        return
    rows = [cells[(cells["run_id"] + "/" + cells["cell_id"]) == key].iloc[0].to_dict() for key in chosen]
    for cell in rows:
        st.markdown(f"**{T.generation_label(cell)}**: {T.generation_line(cell)}")
    calls = {T.generation_label(c): load_calls(str(root / c["run_id"]), c["cell_id"], _stamp(root / c["run_id"]))
             for c in rows}
    comps = [T.component_table(c) for c in rows]
    st.subheader("Per component: its forwards' time and attention's share of it")
    st.caption("Pale: the component's forwards in the generation; solid: their attention calls (the attention "
               "processor's whole call, q/k/v and output projections included; attention core and attention "
               f"projections split it: {ATTENTION_SPLIT}). 'not recorded': no hook of ours reached its attention "
               "(compiled, or a kind of module attnprof does not record), never 0.")
    both, legend = T.labelled(pd.concat(comps, ignore_index=True), ("cell",))
    chart(both, C.component_time(legend, len(both)))
    table(both.drop(columns=["label", "variant"]), "components")
    if len(rows) == 2:
        st.caption(f"Side by side: {T.generation_label(rows[1])} (b) against {T.generation_label(rows[0])} (a).")
        table(T.components_side_by_side(*comps), "components-side-by-side")
    generation_sections(rows, calls)
    for cell in rows:
        if cell.get("notes"):
            st.caption(f"Notes, {T.generation_label(cell)}: {cell['notes']}")


def generation_sections(rows: list[dict], calls: dict[str, pd.DataFrame]) -> None:
    """The Generation page's per-step, per-generation and costliest-block sections."""
    steps = pd.concat([T.step_table(c, label) for label, c in calls.items()], ignore_index=True)
    st.subheader("Per step: each denoising step's attention time")
    if len(steps):
        steps, legend = T.labelled(steps, ("component", "generation", "cell"))
        chart(steps, C.step_times(legend))
    else:
        st.info("No call of these generations ran in a denoising step.")
    st.subheader("Per generation: each pipeline call's attention, by component")
    table(pd.concat([T.generations_table(calls[T.generation_label(c)], c) for c in rows], ignore_index=True),
          "generations")
    (first, first_calls), *others = calls.items()
    top = T.costliest_blocks(first_calls, first)
    top = pd.concat([top, *(T.costliest_blocks(c, label, among=set(top.get("block", ()))) for label, c in others)],
                    ignore_index=True)
    st.subheader("The costliest blocks: all their calls summed" + (f" (those of {first})" if others else ""))
    if len(top):
        top, legend = T.labelled(top, ("cell", "component"))
        chart(top, C.block_costs(legend, len(top)))
        table(top.drop(columns=["label", "variant"]), "costliest-blocks")


def compare_page(cells: pd.DataFrame, envs: pd.DataFrame, by: str, baseline: str, budget: str) -> None:
    st.header("Compare")
    sizes = T.options(cells, "size")
    if by == "backend":
        compare_backends(cells, baseline, sizes)
    else:
        compare_runs(T.with_series(cells, envs, by), by, baseline, sizes)
    st.subheader("Best backend here")
    from profiler.spec import InputError, parse_bytes

    try:
        limit = parse_bytes(budget, "budget")
    except InputError as e:
        st.error(str(e))
        return
    st.caption(f"Per device and size: the fastest backend that ended ok, the memory-smallest, and the fastest whose "
               f"forward (weights + inputs + its transient) fits {T.human_bytes(limit)}.")
    table(T.best_backends(cells, limit), "best")
    st.subheader("By family: time beside error")
    st.caption("Reference, chunked, fused exact and fused approximate (int8 / fp8 kernels): each backend's attention "
               "time beside its error against the fp32 reference, so a fast kernel with a large error shows as such.")
    table(T.family_table(cells), "families")


def compare_backends(cells: pd.DataFrame, baseline: str, sizes: list[str]) -> None:
    cmp, unit = T.with_mem_unit(T.compare_table(cells, baseline), ["attention_peak_mem_bytes"])
    ok, legend = T.labelled(cmp[cmp["status"] == "ok"], T.CELL_SERIES)
    empty = T.no_peaks_reason(cells[cells["status"] == "ok"])  # an empty chart would say nothing: say why
    st.subheader("Time against peak memory, per size")
    if empty:
        st.info(f"{empty}.")
    else:
        chart(ok, C.time_against_peak(sizes, unit, legend), stretch=False)
    st.subheader(f"Ratio to {baseline} (below 1: faster or smaller)")
    left, right = st.columns(2)
    for where, y, title in ((left, "time_ratio", "time ratio"), (right, "peak_ratio", "peak memory ratio")):
        with where:
            if empty and y == "peak_ratio":
                st.info(f"{empty}.")
            else:
                chart(ok, C.ratio_to_baseline(y, title, baseline, sizes, legend))
    st.subheader("Largest size that ran, per backend")
    table(T.largest_ok(cells), "largest")
    st.subheader("All cells")
    table(T.compare_table(cells, baseline), "compare")


def compare_runs(cells: pd.DataFrame, by: str, baseline: str, sizes: list[str]) -> None:
    """Runs side by side: each backend's time per size, a series per run (or environment value), and each other
    run judged against the baseline run cell by cell with the noise rule (profiler.report.compare)."""
    from profiler.report.compare import THRESHOLD, compare, machine_text, rule_text, summary, summary_text
    from profiler.store import Run

    ok, title = T.labelled(cells[cells["status"] == "ok"], T.CELL_SERIES[:-1])  # the runs: side by side
    st.subheader(f"Attention time per {title} and size, side by side by {by}")
    chart(ok, C.side_by_side(sizes, by, title), stretch=False)
    base = cells[cells["run_id"] == baseline]
    for run_id in [r for r in dict.fromkeys(cells["run_id"]) if r != baseline]:
        manifests = tuple(Run.open(results_dir() / r).manifest() for r in (baseline, run_id))
        result = compare(base, cells[cells["run_id"] == run_id], manifests=manifests)
        st.subheader(f"{run_id} against {baseline}")
        st.caption(f"{summary_text(summary(result))}. As attnprof diff judges: {rule_text(THRESHOLD)}. "
                   f"{machine_text(result, manifests)}.")
        table(T.verdicts_first(result["matched"]), f"diff-{run_id}")
        for side, name in (("only_a", baseline), ("only_b", run_id)):
            if len(result[side]):
                st.warning(f"{len(result[side])} cells only in {name}, left out of the comparison:")
                table(result[side], f"{side}-{run_id}")


def scaling_page(cells: pd.DataFrame, blocks: pd.DataFrame) -> None:
    st.header("Scaling")
    scale = T.scaling_table(blocks)
    charts = C.scaling_charts(scale)
    for where, (_, spec, data) in zip(st.columns(2), charts[:2]):  # tokens | score tables
        with where:
            chart(data, spec)
    chart(charts[2][2], charts[2][1], stretch=False)  # time, then peaks: small multiples, each panel its own width
    empty = charts[3][2]["peak_bytes"].isna().all() and T.no_peaks_reason(cells[cells["status"] == "ok"])
    if empty:  # an empty chart would say nothing: say why
        st.info(f"{empty}.")
    else:
        chart(charts[3][2], charts[3][1], stretch=False)
    table(scale, "scaling")


def planner_ui() -> tuple:
    from profiler.unet.models import known_models

    a, b, c, d, e = st.columns(5)
    model = choice_ui("Model", list(known_models()), "plan_model", "sd15", where=a)
    size = text_ui("Size (WxH pixels)", "plan_size", "512x512", where=b)
    batch = text_ui("Batch", "plan_batch", "1", where=c)
    dtype = choice_ui("Dtype", ["float16", "bfloat16", "float32"], "plan_dtype", "float16", where=d)
    budget = text_ui("Memory budget (or a GPU: 4090, L4, H100)", "budget", "24GiB", where=e)
    return model, size, batch, dtype, budget


def guidance(batch: int) -> str:
    """What the batch means for a pipeline with classifier-free guidance, which runs the U-Net at batch 2 an image."""
    if batch == 1:
        return " (a pipeline with classifier-free guidance runs batch 2 for one image: set Batch to 2 for it)"
    return " (one image under classifier-free guidance)" if batch == 2 else ""


def planner_page(model: str, size: str, batch: str, dtype: str, budget: str) -> None:
    from profiler.planner.forward import LEFT_OUT
    from profiler.spec import InputError, parse_batch, parse_bytes, parse_size, size_text

    try:
        (width, height), n, limit = parse_size(size), parse_batch(batch), parse_bytes(budget, "memory budget")
    except InputError as e:
        st.error(str(e))
        return
    traced = load_trace(model, width, height, n, dtype)
    plan = T.planner_table(traced, limit)
    shown, unit = T.with_mem_unit(plan, ["need_bytes", "budget_bytes"])
    fits = int(plan["fits"].sum())
    st.caption(f"{model} at {width}x{height}, batch {n}{guidance(n)}, {dtype}, on a CUDA GPU: "
               f"{fits} of {len(plan)} backends fit in {size_text(budget)}. Need = the whole forward's peak: "
               "weights, inputs and every activation, traced on fake tensors (no GPU and no run needed). Not "
               f"counted: {LEFT_OUT}.")
    chart(shown, C.planner_needs(unit, limit / T.UNITS[unit], len(shown)))
    table(plan, "planner")
    st.subheader(f"Largest square image per backend, by GPU memory ({model}, batch {n}, {dtype})")
    st.caption("Every 64-pixel step screened (the activations from two traced forwards, each attention call from its "
               "memory model); attnprof fit --model ... --budget ... traces the answer exactly.")
    table(T.largest_table(load_largest(model, n, dtype)), "largest")
    pipeline = choice_ui("A whole generation", ["sd15", "sdxl"], "plan_pipeline", "sd15", horizontal=True)
    st.subheader(f"Largest square image a whole {pipeline} generation fits, by GPU memory (sdpa, {dtype}, "
                 f"batch {n}, classifier-free guidance, every model resident)")
    st.caption("Every phase must fit: the text encoders, the U-Net at twice the batch, the VAE decode (float32 where "
               "its config forces it); screened as above; attnprof fit --pipeline ... traces the answer exactly, "
               "and takes offload, tiling, ControlNet, IP-Adapter and ToMe.")
    table(T.pipeline_table(load_pipeline(pipeline, n, dtype)), "pipeline")
    with st.expander("Per-call figures (tokens, score tables, FLOPs, traced peaks)"):
        table(pd.DataFrame([{k: v for k, v in r.items() if k != "traced_peak_bytes"} for r in traced["rows"]]),
              "planner-blocks")
    times_section(model, n, dtype)
    generation_section(pipeline, width, height, dtype)


def generation_section(pipeline: str, width: int, height: int, dtype: str) -> None:
    """A whole generation's predicted time on every GPU of the table, per backend (planner/generation.py)."""
    from profiler.spec import InputError

    steps = int(st.number_input("Steps of the generation", 1, 200, 30, key="plan_steps"))
    try:
        times = load_generation_times(pipeline, width, height, steps, dtype)
    except InputError as e:
        st.error(str(e))
        return
    st.subheader(f"Predicted time of a whole {pipeline} generation, {width}x{height}, {steps} steps, one image "
                 f"under classifier-free guidance, {dtype}: per GPU and backend")
    st.caption("Text encoding, every denoising step, the VAE decode: each GPU's published throughput and bandwidth "
               "at the efficiencies its architecture's kernels are published to reach (or assumed, and said so: "
               "attnprof plan --pipeline ... --gpu NAME names each figure's source). An estimate, not a measurement.")
    wide = times.pivot(index="gpu", columns="backend", values="total_s").reindex(columns=list(GENERATION_BACKENDS))
    table(wide.round(2).reset_index().rename(columns={b: f"{b} (s)" for b in GENERATION_BACKENDS}), "generation")


def times_section(model: str, n: int, dtype: str) -> None:
    """Predicted time per backend and size on a GPU of the table (profiler/gpus.py): its published figures at the
    efficiencies its architecture's kernels are published (or assumed) to reach."""
    from profiler import gpus
    from profiler.spec import InputError

    gpu = choice_ui("GPU for the time", gpus.names(), "plan_gpu", "H100-SXM")
    try:
        times = load_times(model, n, dtype, gpu)
    except InputError as e:  # no such tensor rate on this GPU (bfloat16 on a T4)
        st.error(str(e))
        return
    st.subheader(f"Predicted forward time per backend and size on the {gpu} ({model}, batch {n}, {dtype})")
    st.caption(f"{gpus.describe(gpus.get(gpu), dtype)}. Each call from its FLOPs and the bytes its backend moves, the "
               "rest of the forward from its own ops, at the efficiencies of the GPU's architecture "
               "(planner/timing.py; attnprof plan --model ... --gpu NAME names each figure's source); attnprof plan "
               "--results calibrates it on stored runs of the device you have. An estimate, not a measurement.")
    chart(times, C.planner_times([f"{s}x{s}" for s in TIME_SIZES]))


# ---- the Queue page: profiles queued as Ray Jobs (profiler.service.jobs)

def jobs_address() -> str:
    from profiler.service.jobs import address

    return address()  # attnprof serve sets $ATTNPROF_JOBS_ADDRESS


def queue_ui() -> str:
    """The sweep to queue, as YAML: composed from widgets, or pasted."""
    from profiler.attention import backends
    from profiler.unet.models import known_models

    mode = choice_ui("Sweep", ["Compose", "Paste YAML"], "queue_mode", "Compose", horizontal=True)
    if mode == "Paste YAML":
        return st.text_area("Sweep config (the keys of configs/sweeps/*.yaml)", T.sweep_yaml(["tiny-sd15"],
                            "256x256, 512x512", "1", ["float32"], ["naive", "sdpa"], "cpu"), height=260,
                            key="queue_yaml")
    a, b, c = st.columns(3)
    models = a.multiselect("Models", list(known_models()), default=["sd15"], key="q_models")
    sizes = b.text_input("Sizes (WxH, comma-separated)", "512x512, 768x768", key="q_sizes")
    batch = c.text_input("Batch sizes (comma-separated)", "1", key="q_batch")
    dtypes = a.multiselect("Dtypes (none: the device's own, float16 on CUDA, float32 on the CPU)",
                           ["float16", "bfloat16", "float32"], default=[], key="q_dtypes")
    chosen = b.multiselect("Backends", backends.names(), default=["naive", "sdpa"], key="q_backends")
    device = c.selectbox("Device", ["auto", "cuda", "cpu"], key="q_device")
    text = T.sweep_yaml(models, sizes, batch, dtypes, chosen, device)
    st.code(text, language="yaml")
    return text


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def unlocked() -> bool:
    """Whether this browser session may queue, stop and read logs: on the loopback address the page acts for its
    user; beyond it, whoever reaches the page must first show Ray's token (token_ui), once per session."""
    return str(st.get_option("server.address") or "") in LOOPBACK or bool(st.session_state.get("token_ok"))


def token_ui() -> None:
    """Asks for Ray's token where the page is reachable beyond this machine, and checks it (not stored elsewhere)."""
    import hmac

    from profiler.service.jobs import token

    if unlocked():
        return
    entered = st.text_input("Ray's token (this page is reachable beyond this machine: `ray get-auth-token` on the "
                            "head prints it)", type="password", key="token_entered")
    expected = token()
    if entered and expected and hmac.compare_digest(entered.strip().encode(), expected.encode()):
        st.session_state["token_ok"] = True
        st.success("token accepted for this browser session")
    elif entered:
        st.error("that is not the cluster's token" if expected else
                 "no token to check it against here: start the service with attnprof serve (token auth on)")


def queue_page(text: str, results: Path) -> None:
    from profiler.service import jobs
    from profiler.spec import InputError

    token_ui()
    if st.button("Validate and submit", type="primary"):
        if not unlocked():
            st.error("nothing queued: enter Ray's token above first")
        else:
            try:
                sid, folder = jobs.submit(text, "the Queue page", addr=jobs_address(), fallback=results)
            except InputError as e:  # a bad config (nothing queued), or no job server
                st.error(str(e))
            else:
                st.success(f"queued {sid}: it runs on the cluster; its run lands in `{folder}`"
                           + (" and appears on the Runs page" if folder == results else ""))
                st.session_state["queue_job"] = sid  # the jobs table below follows it
    st.subheader("Jobs")
    jobs_table()


@st.fragment(run_every=2)
def jobs_table() -> None:
    from profiler.service import jobs
    from profiler.spec import InputError

    address = jobs_address()
    try:
        rows = jobs.jobs(address)
    except InputError as e:
        st.warning(f"{e}. Compose and validate anyway; nothing can be queued until a job server answers.")
        return
    if not rows:
        st.info(f"No profiles queued at {address} yet.")
        return
    shown = pd.DataFrame(rows).assign(cells=lambda d: [f"{a}/{b}" if b == b and b is not None else "-"
                                                       for a, b in zip(d["cells_done"], d["cells_total"])])
    st.table(shown[["job", "status", "cells", "folder", "submitted", "ended", "source", "message"]])
    job = st.selectbox("Job", [r["job"] for r in rows], key="queue_job")
    status = next(r["status"] for r in rows if r["job"] == job)
    st.markdown(f"**{job}**: {status}")
    if not unlocked():
        st.caption("Enter Ray's token above to stop a job or read its log.")
        return
    try:
        if status in ("PENDING", "RUNNING") and st.button("Stop this job", key="queue_stop"):
            jobs.stop(job, address)
            st.info(f"stopping {job}: its finished cells stay stored and the run can be resumed")
        with st.expander("Log"):
            st.code(jobs.logs(job, address)[-6000:] or "(empty)")
    except InputError as e:
        st.warning(str(e))


# ---- the app: widgets first, URL mirrored, layout last

def page_ui(page: str, cells: pd.DataFrame) -> dict:
    """The page's own choices: the cell to draw and the colour (Run), the baseline (Compare)."""
    out = {}
    if page == "Run" and len(cells):
        ok = cells[cells["status"] == "ok"]
        keys = ok["run_id"] + "/" + ok["cell_id"]  # a cell id names a spec: two runs of one grid share it
        labels = dict(zip(keys, ok["size"] + " " + ok["backend_label"] + " " + ok["dtype"] + " b" +
                          ok["batch"].astype(str) + " (" + ok["model"] + ", " + ok["run_id"] + ")"))
        if labels:
            _seed("cell", labels.__contains__, next(iter(labels)))
            out["cell"] = st.sidebar.selectbox("Cell to draw", list(labels), key="cell", format_func=labels.get)
        out["color"] = choice_ui("Colour by", list(COLOUR_BY), "color", "time", where=st.sidebar, horizontal=True)
    if page == "Generation" and len(cells):
        mine = T.recorded(cells)
        labels = dict(zip(mine["run_id"] + "/" + mine["cell_id"], [T.generation_label(c)
                                                                   for c in mine.to_dict("records")]))
        if labels:
            _seed("gen", labels.__contains__, next(iter(labels)))
            out["gen"] = st.sidebar.selectbox("Generation", list(labels), key="gen", format_func=labels.get)
            beside = ["none", *(k for k in labels if k != out["gen"])]
            labels["none"] = "none"
            _seed("beside", beside.__contains__, "none")
            out["beside"] = st.sidebar.selectbox("Beside it", beside, key="beside", format_func=labels.get)
    if page == "Compare" and len(cells):
        runs = list(dict.fromkeys(cells["run_id"]))
        envs = T.run_envs([results_dir() / r for r in runs])
        choices = ["backend"] + (["run"] + T.differing(envs) if len(runs) > 1 else [])
        out["by"] = choice_ui("Side by side by", choices, "by", "run" if len(runs) > 1 else "backend",
                              where=st.sidebar)
        if out["by"] == "backend":
            labels = T.options(cells, "backend_label")
            out["baseline"] = choice_ui("Baseline", labels, "baseline", "naive" if "naive" in labels else labels[0],
                                        where=st.sidebar)
        else:
            out["baseline"] = choice_ui("Baseline run", runs, "baseline", runs[0], where=st.sidebar)
        out["budget"] = text_ui("Budget for the best backend", "best_budget", "24GiB", where=st.sidebar)
        out["envs"] = envs
    return out


def mirror(url: dict) -> None:
    st.query_params.from_dict({k: v for k, v in url.items() if v not in (None, [], "")})


def main() -> None:
    st.set_page_config(page_title="attnprof dashboard", layout="wide")
    root = results_dir()
    index = load_index(str(root), tuple(_stamp(r) for r in list_runs(root)))
    page = choice_ui("Page", list(PAGES), "page", "Runs", where=st.sidebar)
    if page == "Planner":
        st.header("Planner")
        values = planner_ui()
        mirror(dict(zip(("page", "plan_model", "plan_size", "plan_batch", "plan_dtype", "budget"), (page, *values))))
        link_warnings(root)
        return planner_page(*values)
    if page == "Queue":
        st.header("Queue")
        st.caption(f"Profiles queued as Ray Jobs at {jobs_address()}; their runs land in `{root.resolve()}` "
                   "unless the sweep names another folder (out:).")
        text = queue_ui()
        mirror({"page": page})
        link_warnings(root)
        return queue_page(text, root.resolve())
    chosen = runs_ui(index, page)
    cells, blocks, problems = load_selected(root, chosen)
    found = T.run_findings(cells, blocks) if page == "Runs" else {}  # of the whole runs, before any filter
    filters = filters_ui(cells) if len(cells) else {}
    if filters:
        cells, blocks = T.apply_filters(cells, filters), T.apply_filters(blocks, filters)
    choices = page_ui(page, cells)
    mirror({"page": page, "run": chosen, **filters, **{k: v for k, v in choices.items() if k != "envs"}})
    link_warnings(root)

    unreadable = index[~index["readable"]]["run_id"].tolist() if len(index) else []
    if unreadable and page != "Runs":
        st.warning(f"Unreadable runs left out: {', '.join(unreadable)} (see the Runs page)")
    for problem in problems:
        st.warning(problem)
    if not len(index):
        return empty_page(root)
    if page == "Runs":
        return runs_page(index, found)
    if not len(cells):
        return st.info("No cells match: pick a run and widen the filters in the sidebar.")
    if page == "Run":
        run_page(cells, blocks, choices.get("cell"), choices["color"], root)
        report_button(root, chosen)
    elif page == "Generation":
        generation_page(cells, [k for k in (choices.get("gen"), choices.get("beside")) if k and k != "none"], root)
        report_button(root, chosen)
    elif page == "Compare":
        compare_page(cells, choices["envs"], choices["by"], choices["baseline"], choices["budget"])
        report_button(root, chosen)
    elif len(blocks):
        scaling_page(cells, blocks)
    else:
        st.info("No cell of the chosen runs and filters ended ok: nothing to scale.")


main()
