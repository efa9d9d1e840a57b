"""The Generation page: a recorded generation (attnprof record, profiler.profile), or two side by side."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import generations as G
from dashboards import transforms as T
from dashboards import widgets as W
from profiler.report.compare import ATTENTION_SPLIT


def sidebar(cells: pd.DataFrame) -> tuple[dict, dict]:
    """The recorded generation to draw and one to draw beside it ('none'), where the chosen runs hold any; for the
    URL and for draw alike."""
    mine = G.recorded(cells)
    labels = dict(zip(mine["run_id"] + "/" + mine["cell_id"], [G.generation_label(c)
                                                               for c in mine.to_dict("records")]))
    if not labels:
        return {}, {}
    gen = W.choice_ui("Generation", list(labels), "gen", next(iter(labels)), where=st.sidebar, fmt=labels.get)
    beside = ["none", *(k for k in labels if k != gen)]
    labels["none"] = "none"
    out = {"gen": gen, "beside": W.choice_ui("Beside it", beside, "beside", "none", where=st.sidebar, fmt=labels.get)}
    return out, out


def draw(picked: W.Picked, gen: str | None = None, beside: str | None = None) -> None:
    """A recorded generation (attnprof record, profiler.profile), or two side by side: per component the share of
    attention, per step and per generation the attention time, the costliest blocks; then the runs' report."""
    chosen = [k for k in (gen, beside) if k and k != "none"]
    st.header("Generation")
    if chosen:
        generations_ui(picked.cells, chosen, picked.root)
    else:
        W.empty("None of the chosen runs holds a recorded generation (a run of kind record): make one with "
                "`attnprof record -- your_script.py` or `profiler.profile(pipe)`, then pick it in the sidebar.")
    W.report_button(picked.root, picked.run_ids)


def generations_ui(cells: pd.DataFrame, chosen: list[str], root: Path) -> None:
    """The chosen generations' lines, per component and the sections below (generation_sections), their notes."""
    rows = [cells[(cells["run_id"] + "/" + cells["cell_id"]) == key].iloc[0].to_dict() for key in chosen]
    for cell in rows:
        st.markdown(f"**{G.generation_label(cell)}**: {G.generation_line(cell)}")
    calls = {G.generation_label(c): W.load_calls(str(root / c["run_id"]), c["cell_id"], W.stamp(root / c["run_id"]))
             for c in rows}
    comps = [G.component_table(c) for c in rows]
    st.subheader("Per component: its forwards' time and attention's share of it")
    st.caption("Pale: the component's forwards in the generation; solid: their attention calls (the attention "
               "processor's whole call, q/k/v and output projections included; attention core and attention "
               f"projections split it: {ATTENTION_SPLIT}). 'not recorded': no hook of ours reached its attention "
               "(compiled, or a kind of module attnprof does not record), never 0.")
    both, legend = T.labelled(pd.concat(comps, ignore_index=True), ("cell",))
    W.chart(both, C.component_time(legend, len(both)))
    W.table(both.drop(columns=["label", "variant"]), "components")
    if len(rows) == 2:
        st.caption(f"Side by side: {G.generation_label(rows[1])} (b) against {G.generation_label(rows[0])} (a).")
        W.table(G.components_side_by_side(*comps), "components-side-by-side")
    generation_sections(rows, calls)
    for cell in rows:
        if cell.get("notes"):
            st.caption(f"Notes, {G.generation_label(cell)}: {cell['notes']}")


def generation_sections(rows: list[dict], calls: dict[str, pd.DataFrame]) -> None:
    """The Generation page's per-step, per-generation and costliest-block sections."""
    steps = pd.concat([G.step_table(c, label) for label, c in calls.items()], ignore_index=True)
    st.subheader("Per step: each denoising step's attention time")
    if not W.empty("" if len(steps) else "No call of these generations ran in a denoising step."):
        steps, legend = T.labelled(steps, ("component", "generation", "cell"))
        W.chart(steps, C.step_times(legend))
    st.subheader("Per generation: each pipeline call's attention, by component")
    W.table(pd.concat([G.generations_table(calls[G.generation_label(c)], c) for c in rows], ignore_index=True),
            "generations")
    (first, first_calls), *others = calls.items()
    top = G.costliest_blocks(first_calls, first)
    top = pd.concat([top, *(G.costliest_blocks(c, label, among=set(top.get("block", ()))) for label, c in others)],
                    ignore_index=True)
    st.subheader("The costliest blocks: all their calls summed" + (f" (those of {first})" if others else ""))
    if len(top):
        top, legend = T.labelled(top, ("cell", "component"))
        W.chart(top, C.block_costs(legend, len(top)))
        W.table(top.drop(columns=["label", "variant"]), "costliest-blocks")
