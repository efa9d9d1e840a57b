"""The dashboard's shared pieces: the results folder, the cached loaders (keyed on the files' modification times and
sizes), the widgets that start from the URL, and the table, chart and note every page draws with."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import generations as G
from dashboards import transforms as T


def results_dir() -> Path:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--results")
    args, _ = parser.parse_known_args(sys.argv[1:])
    return Path(args.results or os.environ.get("ATTNPROF_RESULTS") or "results")


# ---- cached loaders, keyed on the files' modification times and sizes

def stamp(run: Path) -> tuple:
    """What a run's cached tables are keyed on: its files' names, modification times and sizes."""
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
    return G.load_calls(Path(path), cell_id)


@st.cache_data(show_spinner="Writing the report...", max_entries=4)
def report_html(paths: tuple[str, ...], stamps: tuple) -> str:
    from dashboards.report import render

    return render([Path(p) for p in paths])


def report_button(root: Path, run_ids: list[str]) -> None:
    """The same self-contained HTML file as attnprof report, for the chosen runs."""
    if run_ids:
        paths = tuple(str(root / r) for r in run_ids)
        st.download_button("Download report.html (self-contained, opens with no network)",
                           report_html(paths, tuple(stamp(Path(p)) for p in paths)), file_name="report.html",
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
    """The chosen runs' cells and blocks, each joined, and a line for each run that could not be read."""
    tables = [load_run(str(root / r), stamp(root / r)) for r in run_ids]
    return T.joined(c for c, _, _ in tables), T.joined(b for _, b, _ in tables), [w for _, _, w in tables if w]


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


def choice_ui(label: str, options: list, key: str, default, where=None, horizontal=False, fmt=str):
    _seed(key, options.__contains__, default)
    if horizontal:
        return (where or st).radio(label, options, key=key, horizontal=True)
    return (where or st).selectbox(label, options, key=key, format_func=fmt)


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


class Picked(NamedTuple):
    """What a page of runs draws from: the results folder and its index, the runs chosen, their cells and blocks as
    filtered, and the whole runs' (cells, blocks) before any filter."""
    root: Path
    index: pd.DataFrame
    run_ids: list[str]
    cells: pd.DataFrame
    blocks: pd.DataFrame
    whole: tuple[pd.DataFrame, pd.DataFrame]


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


def empty(why: str) -> bool:
    """In place of a chart, a table or a page with nothing to draw: why, as a note (why '' says nothing). Whether it
    said something."""
    if why:
        st.info(why)
    return bool(why)


def empty_page(root: Path) -> None:
    empty(f"No runs under `{root}` yet. Make one, then reload this page:\n\n"
          "```\nmake profile\n```\nor a small one on the CPU:\n\n"
          f"```\nattnprof run --model tiny-sd15 --size 256x256 --backend naive --backend sdpa --device cpu "
          f"--dtype float32 --out {root}\n```\nThe Planner page needs no run.")


def findings_ui(found: dict[str, list[str]]) -> None:
    """The chosen runs' headline findings (profiler.report.findings: what attnprof show says first)."""
    for run_id, sentences in found.items():
        if sentences:
            st.markdown(f"**Findings, {run_id}**\n\n" + "\n".join(f"- {s}" for s in sentences))


def mirror(url: dict) -> None:
    st.query_params.from_dict({k: v for k, v in url.items() if v not in (None, [], "")})

