"""The Scaling page: tokens, score tables, time and peaks against image size."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import transforms as T
from dashboards import widgets as W


def sidebar(cells: pd.DataFrame) -> tuple[dict, dict]:
    """None of its own: the runs and the filters are every page's."""
    return {}, {}


def draw(picked: W.Picked) -> None:
    """Tokens and score tables by size, then time and peaks in small multiples, and the table behind them."""
    cells, blocks = picked.cells, picked.blocks
    if not len(blocks):
        W.empty("No cell of the chosen runs and filters ended ok: nothing to scale.")
        return
    st.header("Scaling")
    scale = T.scaling_table(blocks)
    charts = C.scaling_charts(scale)
    for where, (_, spec, data) in zip(st.columns(2), charts[:2]):  # tokens | score tables
        with where:
            W.chart(data, spec)
    W.chart(charts[2][2], charts[2][1], stretch=False)  # time, then peaks: small multiples, each panel its own width
    why = T.no_peaks_reason(cells[cells["status"] == "ok"]) if charts[3][2]["peak_bytes"].isna().all() else ""
    if not W.empty(why):  # an empty chart would say nothing: say why
        W.chart(charts[3][2], charts[3][1], stretch=False)
    W.table(scale, "scaling")
