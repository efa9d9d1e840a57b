"""The Runs page: every run under the results folder, one row each, and the chosen runs' findings."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import transforms as T
from dashboards import widgets as W


def sidebar(cells: pd.DataFrame) -> tuple[dict, dict]:
    """None of its own: the runs and the filters are every page's."""
    return {}, {}


def draw(picked: W.Picked) -> None:
    """The runs' findings (of the whole runs, before any filter), their warnings, one row per run."""
    index = picked.index
    st.header("Runs")
    W.findings_ui(T.run_findings(*picked.whole))
    for row in index[index["warning"] != ""].itertuples():
        st.warning(f"{row.run_id}: {row.warning}")
    st.caption("One row per run; cells by status. Pick runs in the sidebar.")
    W.table(index, "runs")
