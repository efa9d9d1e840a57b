"""attnprof dashboard: a thin Streamlit view over the runs under a results folder (profiler.store) and the pure
transforms in dashboards/transforms.py; a module per page in dashboards/views/, their shared widgets and loaders in
dashboards/widgets.py.

    attnprof dashboard [--results DIR]          (or: streamlit run dashboards/app.py -- --results DIR)

The results folder comes from --results, else $ATTNPROF_RESULTS, else ./results. Filters live in the URL."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # streamlit puts only this file's folder on the path
    sys.path.insert(0, str(REPO))

import streamlit as st  # noqa: E402

from dashboards import transforms as T  # noqa: E402
from dashboards import widgets as W  # noqa: E402
from dashboards.views import compare, generation, planner, queue, run, runs, scaling  # noqa: E402
from profiler.store import list_runs  # noqa: E402

# page title -> its module: sidebar() draws its own widgets and returns (what the URL mirrors, what draw takes)
PAGES = {"Runs": runs, "Run": run, "Generation": generation, "Compare": compare, "Scaling": scaling,
         "Planner": planner, "Queue": queue}
RUNLESS = ("Planner", "Queue")  # pages that read no run: their widgets on the page, no runs and no filters


def main() -> None:
    """Widgets first, the URL mirrored, layout last."""
    st.set_page_config(page_title="attnprof dashboard", layout="wide")
    root = W.results_dir()
    index = W.load_index(str(root), tuple(W.stamp(r) for r in list_runs(root)))
    title = W.choice_ui("Page", list(PAGES), "page", "Runs", where=st.sidebar)
    page = PAGES[title]
    if title in RUNLESS:
        st.header(title)
        url, args = page.sidebar(root)
        W.mirror({"page": title, **url})
        W.link_warnings(root)
        return page.draw(**args)
    chosen = W.runs_ui(index, title)
    cells, blocks, problems = W.load_selected(root, chosen)
    whole = cells, blocks
    filters = W.filters_ui(cells) if len(cells) else {}
    if filters:
        cells, blocks = T.apply_filters(cells, filters), T.apply_filters(blocks, filters)
    url, args = page.sidebar(cells) if len(cells) else ({}, {})
    W.mirror({"page": title, "run": chosen, **filters, **url})
    W.link_warnings(root)

    unreadable = index[~index["readable"]]["run_id"].tolist() if len(index) else []
    if unreadable and title != "Runs":
        st.warning(f"Unreadable runs left out: {', '.join(unreadable)} (see the Runs page)")
    for problem in problems:
        st.warning(problem)
    if not len(index):
        return W.empty_page(root)
    if title != "Runs" and not len(cells):
        return W.empty("No cells match: pick a run and widen the filters in the sidebar.")
    page.draw(W.Picked(root, index, chosen, cells, blocks, whole), **args)


main()
