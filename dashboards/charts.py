"""Vega-Lite specs of the charts that the dashboard (views/) and the HTML report (report.py) share: data in, spec
out (the dashboard passes the data beside the spec, the report embeds it).

Two rules hold for every spec here (tests/test_charts.py checks each function on real runs): every tooltip entry is
a field definition with its type and title, and every series a chart draws is split by every field that varies in
its data: where a chart's colour tells series apart it colours by `label`, which transforms.labelled builds from
those fields (backend, model, dtype, batch, aspect, run) whose values vary."""
from __future__ import annotations

import pandas as pd

from dashboards import transforms as T

SCHEMA = "https://vega.github.io/schema/vega-lite/v6.json"  # the version vl-convert's bundle and Streamlit draw with
SIZE_X = "image size (pixels = width x height)"


def tip(field: str, title: str, kind: str = "nominal", fmt: str | None = None) -> dict:
    """One tooltip entry: a field definition, as Vega-Lite wants it (a bare name is dropped with a warning)."""
    return {"field": field, "type": kind, "title": title, **({"format": fmt} if fmt else {})}


def num(field: str, title: str, fmt: str = ".2f") -> dict:
    return tip(field, title, "quantitative", fmt)


def log_axis(field: str, title: str, **extra) -> dict:
    return {"field": field, "type": "quantitative", "scale": {"type": "log"}, "title": title, **extra}


def colour(field: str, title: str, columns: int = 4, **extra) -> dict:
    """A nominal colour whose legend sits below the chart, `columns` entries to a row, and shows labels whole (a
    label names backend, model, dtype, ... where they vary): however many series, the plot keeps its width."""
    return {"field": field, "type": "nominal", "title": title, "legend": {**LEGEND, "columns": columns}, **extra}


LEGEND = {"orient": "bottom", "labelLimit": 420}


PANEL_WIDTH, PANEL_HEIGHT, PANEL_COLUMNS = 320, 220, 2  # small multiples: two side by side fit a laptop's window


def _facet(sizes: list[str]) -> dict:
    return {"field": "size", "type": "ordinal", "sort": sizes, "columns": PANEL_COLUMNS, "title": None}


def _rule(**encoding) -> dict:
    """A dashed reference line drawn once (its own one-row data, not once per row of the chart's)."""
    return {"data": {"values": [{}]}, "mark": {"type": "rule", "color": "black", "strokeDash": [4, 4]},
            "encoding": encoding}


# ---- the Run page: one cell's attention calls

def call_tooltip(unit: str) -> list:
    """What hovering over one attention call shows: which block it is first."""
    return [tip("block", "block"), tip("kind", "kind"), tip("tokens", "tokens (query x key)"),
            tip("score_table", "score table"), num("time_ms", "time (ms)", ".3f"),
            num(f"peak_mem_{unit}", f"peak ({unit})")]


def unet_map(field: str, title: str, unit: str) -> dict:
    """One cell's attention calls placed on the U (transforms.unet_layout), coloured by `field`."""
    return {"mark": {"type": "rect", "stroke": "white", "tooltip": True}, "height": 260, "encoding": {
        "x": {"field": "group_label", "type": "ordinal", "sort": {"field": "column"},
              "title": "transformer block, down -> mid -> up", "axis": {"labelAngle": -40}},
        "xOffset": {"field": "kind", "type": "nominal", "sort": ["self", "cross", "image"]},
        "y": {"field": "level_label", "type": "ordinal", "sort": {"field": "level"}, "title": None},
        "yOffset": {"field": "layer", "type": "ordinal"},
        "color": {"field": field, "type": "quantitative", "title": title, "scale": {"scheme": "viridis"}},
        "tooltip": call_tooltip(unit)}}


def call_bars(x: str, title: str, unit: str, calls: int) -> dict:
    """One bar per attention call of one cell, in call order, coloured by stage."""
    return {"mark": {"type": "bar", "tooltip": True}, "height": 18 * calls + 40, "encoding": {
        "y": {"field": "block", "type": "nominal", "sort": {"field": "call_index"}, "title": None,
              "axis": {"labelLimit": 320, "labelOverlap": False}},
        "x": {"field": x, "type": "quantitative", "title": title},
        "color": colour("stage", "stage", sort=["down", "mid", "up"]),
        "tooltip": call_tooltip(unit)}}


# ---- the Generation page: recorded generations (generations.component_table, step_table, costliest_blocks)

def component_time(legend: str, rows: int) -> dict:
    """Per component of each recorded generation (a bar per `label`, side by side), its forwards' time pale and its
    attention's time solid inside it: attention's share of each component at a glance. A component whose attention
    was not recorded has no solid bar (its tooltip says NaN, its table 'not recorded')."""
    tooltip = [tip("label", legend), tip("component", "component"), tip("class", "class"),
               num("time_ms", "its forwards (ms)"), num("attention_ms", "their attention (ms)"),
               num("attention_of_component_pct", "attention's share of them (%)", ".1f"),
               num("time_share_pct", "share of the generation's wall time (%)", ".1f")]
    x = {"type": "quantitative", "title": "time in the generation (ms): its forwards pale, their attention solid"}
    return {"height": 26 * rows + 30, "encoding": {
        "y": {"field": "component", "type": "nominal", "title": None, "sort": None},
        "yOffset": {"field": "label", "type": "nominal"}, "color": colour("label", legend, columns=1),
        "tooltip": tooltip}, "layer": [
        {"mark": {"type": "bar", "opacity": 0.35, "tooltip": True}, "encoding": {"x": {"field": "time_ms", **x}}},
        {"mark": {"type": "bar", "tooltip": True}, "encoding": {"x": {"field": "attention_ms", **x}}}]}


def step_times(legend: str) -> dict:
    """Each denoising step's attention time (its calls summed), a line per `label` (component, generation and
    recorded cell, where they vary: transforms.labelled)."""
    return {"mark": {"type": "line", "point": True, "tooltip": True}, "height": 260, "encoding": {
        "x": {"field": "step", "type": "ordinal", "title": "step (the denoiser's forward, counted in its generation)",
              "axis": {"labelAngle": 0}},
        "y": {"field": "attention_ms", "type": "quantitative", "title": "attention time in the step (ms)"},
        "color": colour("label", legend, columns=2),
        "tooltip": [tip("label", legend), tip("step", "step", "ordinal"), tip("calls", "calls", "quantitative"),
                    num("attention_ms", "attention (ms)", ".3f")]}}


def block_costs(legend: str, rows: int) -> dict:
    """The costliest blocks, each its calls' total time as a bar (a bar per `label` side by side where two recorded
    cells are drawn), the costliest first."""
    return {"mark": {"type": "bar", "tooltip": True}, "height": 20 * rows + 40, "encoding": {
        "y": {"field": "block", "type": "nominal", "sort": "-x", "title": None,
              "axis": {"labelLimit": 420, "labelOverlap": False}},
        "yOffset": {"field": "label", "type": "nominal"},
        "x": {"field": "total_ms", "type": "quantitative", "title": "time of all its calls (ms)"},
        "color": colour("label", legend, columns=2),
        "tooltip": [tip("block", "block"), tip("label", legend), tip("kind", "kind"),
                    tip("tokens", "tokens (query x key)"), tip("calls", "calls", "quantitative"),
                    num("total_ms", "all its calls (ms)", ".3f"), num("median_ms", "its median call (ms)", ".3f"),
                    num("share_of_attention_pct", "share of the attention time (%)", ".1f")]}}


# ---- the Compare page

def cell_tooltip(unit: str) -> list:
    """What hovering over one cell's point shows."""
    return [tip("backend_label", "backend"), tip("model", "model"), tip("dtype", "dtype"),
            tip("batch", "batch", "ordinal"), tip("size", "size"), tip("run_id", "run"),
            num("attention_time_ms", "attention time (ms)"), num(f"attention_peak_mem_{unit}", f"peak ({unit})")]


def time_against_peak(sizes: list[str], unit: str, title: str) -> dict:
    """Attention time against peak memory, a panel per size, a colour per `label` (transforms.labelled over the
    cells' backend, model, dtype, batch and run), a shape per family."""
    return {"mark": {"type": "point", "filled": True, "size": 100, "tooltip": True}, "width": PANEL_WIDTH,
            "height": PANEL_HEIGHT,
            "encoding": {"facet": _facet(sizes),
                         "x": log_axis(f"attention_peak_mem_{unit}", f"attention peak memory ({unit})"),
                         "y": log_axis("attention_time_ms", "attention time (ms)"),
                         "color": colour("label", title, columns=2), "shape": colour("family", "family"),
                         "tooltip": cell_tooltip(unit)}}


def ratio_to_baseline(y: str, title: str, baseline: str, sizes: list[str], legend: str) -> dict:
    """Each cell's time or peak as a ratio to the baseline backend's cell (transforms.compare_table), a point per
    `label` side by side at each size, and the line at 1."""
    return {"layer": [
        {"mark": {"type": "point", "filled": True, "size": 120, "tooltip": True}, "encoding": {
            "x": {"field": "size", "type": "ordinal", "sort": sizes, "title": "size (pixels)"},
            "xOffset": {"field": "label", "type": "nominal"}, "y": log_axis(y, f"{title} (x {baseline})"),
            "color": colour("label", legend, columns=1),
            "tooltip": [tip("label", legend), tip("size", "size"), num("attention_time_ms", "attention time (ms)"),
                        num("time_ratio", "time ratio"), num("peak_ratio", "peak ratio")]}},
        _rule(y={"datum": 1})]}


def side_by_side(sizes: list[str], by: str, title: str) -> dict:
    """Each `label`'s attention time per size (transforms.labelled over backend, model, dtype and batch), one point
    per `series` (a run, or an environment value: transforms.with_series) next to each other."""
    return {"mark": {"type": "point", "filled": True, "size": 110, "tooltip": True}, "width": PANEL_WIDTH,
            "height": PANEL_HEIGHT,
            "encoding": {"facet": _facet(sizes),
                         "x": {"field": "label", "type": "nominal", "title": None,  # the labels say it
                               "axis": {"labelLimit": 0}},
                         "xOffset": {"field": "series", "type": "nominal"},
                         "y": log_axis("attention_time_ms", "attention time (ms)"),
                         "color": colour("series", by, columns=2),
                         "tooltip": [tip("label", title), tip("size", "size"), tip("series", by),
                                     tip("run_id", "run"), num("attention_time_ms", "attention time (ms)"),
                                     num("forward_iqr_ms", "forward time IQR (ms)")]}}


# ---- the Scaling page (transforms.scaling_table, scaling_long, shape_table, panelled)

def size_axis(data: pd.DataFrame) -> dict:
    """Image size on a log axis, ticked at the sizes in data and named as sizes (512x512)."""
    return log_axis("pixels", SIZE_X, axis=T.size_ticks(data))


def _panels(data: pd.DataFrame, unit, title: str) -> dict:
    """Small multiples: one panel per `panel` value (transforms.panelled), each unit(its rows) with its own size
    ticks, `columns` to a row, one legend below them all; a panel keeps its width whatever the number of series."""
    names = list(dict.fromkeys(data["panel"]))
    return {"columns": PANEL_COLUMNS, "title": title, "autosize": {"type": "pad"}, "concat": [
        {"title": name, "width": PANEL_WIDTH, "height": PANEL_HEIGHT,
         "transform": [{"filter": {"field": "panel", "equal": name}}], **unit(data[data["panel"] == name])}
        for name in names]}


def scaling_shape(data: pd.DataFrame, y: str, title: str, legend: str) -> dict:
    """What depends on the shape alone (tokens; score tables), against image size: a line per `label`."""
    return {"mark": {"type": "line", "point": True, "tooltip": True}, "title": title, "height": PANEL_HEIGHT,
            "encoding": {"x": size_axis(data), "y": log_axis(y, title), "color": colour("label", legend, columns=1),
                         "tooltip": [tip("label", legend), tip("size", "size"), num(y, title)]}}


def scaling_time(data: pd.DataFrame, panels: str, legend: str) -> dict:
    """Attention time against image size, a panel per `panel` (transforms.panelled over model, settings, dtype,
    batch and aspect, where they vary), a line per `label` (backend, and run where runs overlap)."""
    def unit(rows: pd.DataFrame) -> dict:
        return {"mark": {"type": "line", "point": True, "tooltip": True}, "encoding": {
            "x": size_axis(rows), "y": log_axis("attention_time_ms", "time (ms)"),
            "color": colour("label", legend, columns=PANEL_COLUMNS * 2),
            "tooltip": [tip("label", legend), tip("panel", panels), tip("size", "size"), tip("run_id", "run"),
                        num("attention_time_ms", "attention time (ms)")]}}

    return _panels(data, unit, f"attention time (sum of the calls' medians), a panel per {panels}")


def scaling_peak(data: pd.DataFrame, unit: str, panels: str, legend: str) -> dict:
    """The largest call's peak, measured (solid line, filled points) beside predicted (dashed, hollow), a panel per
    `panel` as in scaling_time: only the lines encode the source, so that its legend draws a solid and a dashed line
    (a legend shared with the points' draws dots)."""
    tooltip = [tip("label", legend), tip("panel", panels), tip("size", "size"), tip("run_id", "run"),
               tip("source", "source"), num(f"peak_{unit}", f"peak ({unit})")]

    def points(source: str, filled: bool) -> dict:
        return {"transform": [{"filter": {"field": "source", "equal": source}}],
                "mark": {"type": "point", "filled": filled, "tooltip": True}, "encoding": {"tooltip": tooltip}}

    def panel(rows: pd.DataFrame) -> dict:
        return {"encoding": {"x": size_axis(rows), "y": log_axis(f"peak_{unit}", f"peak memory ({unit})"),
                             "color": colour("label", legend, columns=PANEL_COLUMNS * 2)},
                "layer": [{"mark": "line", "encoding": {"strokeDash": {
                              "field": "source", "type": "nominal", "title": None,
                              "scale": {"domain": ["measured", "predicted"], "range": [[1, 0], [6, 4]]},
                              "legend": {"orient": "top", "symbolType": "stroke", "symbolSize": 400,
                                         "symbolStrokeWidth": 2, "symbolStrokeColor": "black"}}}},
                          points("measured", True), points("predicted", False)]}

    return _panels(data, panel, f"largest call's peak memory, measured and predicted, a panel per {panels}")


def scaling_charts(scale: pd.DataFrame) -> list[tuple[str, dict, pd.DataFrame]]:
    """(title, spec, data) of the Scaling page's and the report's four charts, from transforms.scaling_table: what
    the shape sets (tokens, score tables), then what was measured (time, peaks) in small multiples."""
    tokens, by_model = T.labelled(T.shape_table(scale, "tokens_max", ("model", "settings_label", "aspect")))
    by_shape = ("model", "settings_label", "dtype", "batch", "aspect")  # a score table: its shape and the dtype
    scores, unit = T.with_mem_unit(T.shape_table(scale, "score_table_max_bytes", by_shape), ["score_table_max_bytes"])
    scores, by_shape = T.labelled(scores)
    time, panels, legend = T.panelled(scale)
    peaks, peak_unit = T.with_mem_unit(T.scaling_long(time), ["peak_bytes"])
    return [("Scaling: tokens at the finest level against image size",
             scaling_shape(tokens, "tokens_max", "tokens at the finest level", by_model), tokens),
            ("Scaling: the largest score table", scaling_shape(scores, f"score_table_max_{unit}",
                                                               f"largest score table ({unit})", by_shape), scores),
            ("Scaling: attention time against image size", scaling_time(time, panels, legend), time),
            ("Scaling: the largest call's peak memory, measured and predicted",
             scaling_peak(peaks, peak_unit, panels, legend), peaks)]


# ---- the Planner page (transforms.planner_table)

def planner_needs(unit: str, budget: float, backends: int) -> dict:
    """Each backend's predicted need as a bar, coloured by whether it fits, and the budget as a dashed line. The
    height is given (not a step per bar), so that a chart fitted to its container keeps it."""
    return {"height": 24 * backends + 20, "layer": [
        {"mark": {"type": "bar", "tooltip": True}, "encoding": {
            "y": {"field": "backend", "type": "nominal", "sort": None, "title": None,
                  "axis": {"labelLimit": 0}},  # names whole: diffusers:_native_flash, diffusers:_native_math
            "x": {"field": f"need_{unit}", "type": "quantitative", "title": f"predicted need ({unit})"},
            "color": colour("fits", "fits", scale={"domain": [True, False], "range": ["#2a9d8f", "#e76f51"]}),
            "tooltip": [tip("backend", "backend"), tip("family", "family"), tip("largest_call", "largest call"),
                        num(f"need_{unit}", f"need ({unit})")]}},
        _rule(x={"datum": budget})]}


def planner_times(sizes: list[str]) -> dict:
    """Each backend's predicted forward time (the data: planner.calibration.by_size) against the image size, a line per
    backend; the attention's share in the tooltip."""
    return {"height": 300, "mark": {"type": "line", "point": True, "tooltip": True}, "encoding": {
        "x": {"field": "size", "type": "ordinal", "sort": sizes, "title": SIZE_X,
              "axis": {"labelAngle": 0, "labelLimit": 0}},  # "1536x1536" whole, not rotated and clipped to "x512"
        "y": log_axis("forward_ms", "predicted forward time (ms, published efficiencies)"),
        "color": colour("backend", "backend"),
        "tooltip": [tip("backend", "backend"), tip("size", "size"), num("forward_ms", "forward (ms)", ".3f"),
                    num("attention_ms", "attention (ms)", ".3f"), tip("gpu", "GPU")]}}


def roofline(lines: pd.DataFrame, legend: str = "backend") -> dict:
    """Each attention call a point (FLOPs per byte moved against achieved FLOP/s, log-log; the data:
    transforms.roofline_points through transforms.labelled), coloured by its `label`; the device's two limits
    (transforms.roofline_lines: memory bandwidth up to the ridge, then the compute peak) as dashed lines, named."""
    x = log_axis("arithmetic_intensity", "arithmetic intensity (FLOPs per byte moved, the backend's model)")
    y = log_axis("achieved_flops_per_s", "achieved FLOP/s (FLOPs / median time)", axis={"format": "~s"})
    values = lines.astype(object).where(lines.notna(), None).to_dict("records")
    return {"width": 640, "height": 340, "layer": [  # the width where nothing sets it (the report)
        {"mark": {"type": "point", "filled": True, "size": 60, "opacity": 0.8, "tooltip": True},
         "encoding": {"x": x, "y": y, "color": colour("label", legend, columns=2),
                      "shape": colour("size", "size"),
                      "detail": {"field": "block", "type": "nominal"},
                      "tooltip": [tip("block", "block"), tip("label", legend), tip("size", "size"),
                                  tip("kind", "kind"), tip("tokens", "tokens (query x key)"),
                                  num("time_ms", "time (ms)", ".3f"), num("achieved_flops_per_s", "FLOP/s", ".3~s"),
                                  num("arithmetic_intensity", "FLOPs / byte", ".3~r"),
                                  num("pct_of_peak", "% of the bound", ".1f"), tip("roofline_bound", "bound")]}},
        {"data": {"values": values}, "mark": {"type": "line", "color": "black", "strokeDash": [5, 3]},
         "encoding": {"x": x, "y": y, "detail": {"field": "limit", "type": "nominal"}}},
        {"data": {"values": [v for v in values if v.get("name")]},
         "mark": {"type": "text", "align": "left", "dy": -7, "fontSize": 11},
         "encoding": {"x": x, "y": y, "text": {"field": "name", "type": "nominal"}}}]}


def with_data(spec: dict, data: pd.DataFrame) -> dict:
    """The spec with its data inline (for a page with no server): NaN as null; its colours fixed (coloured)."""
    records = data.astype(object).where(data.notna(), None).to_dict("records")
    return {"$schema": SCHEMA, **coloured(spec, data), "data": {"values": records}}


# Twenty colours told apart (Tableau 20): a backend of ours has its own on every page and in the report; the other
# series of a chart take the next free ones, so that no two series of one chart share a colour up to twenty
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac", "#a0cbe8", "#ffbe7d", "#ff9d9a", "#86bcb6", "#8cd17d", "#f1ce63", "#d4a6c8", "#fabfd2",
           "#d7b5a6", "#79706e")
OWN_COLOUR = {name: PALETTE[i] for i, name in enumerate(
    ("naive", "sliced", "split", "subquad", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-math", "sdpa-cudnn",
     "xformers", "flash-attn", "flash-attn-3", "flex", "sage"))}


def colours(values: list, owners: list | None = None) -> list[str]:
    """A colour for each of the values (a chart's series, in order): a value whose owner (the value itself, or the
    backend given for it) is a backend of ours takes that backend's own colour, the first such value in order where
    several share one owner; the rest the free ones in turn; distinct up to len(PALETTE) values."""
    out, used = [None] * len(values), set()
    for i, owner in enumerate(owners or [str(v) for v in values]):
        c = OWN_COLOUR.get(owner)
        if c and c not in used:
            out[i] = c
            used.add(c)
    free = iter([c for c in PALETTE if c not in used] + list(PALETTE) * (1 + len(values) // len(PALETTE)))
    return [c or next(free) for c in out]


SECOND = {"point": ("shape",), "line": ("shape", "strokeDash")}  # how a mark tells a label's variant apart beside
# its colour: a point by its shape, a line by its dash and its points' shape (one legend: a line's alone draws blank)


def coloured(spec: dict, data: pd.DataFrame, by: str | None = None, title: str = "") -> dict:
    """The spec with every nominal colour of a field in data given a scale of its own (colours), a backend's series
    of the most common variant (transforms.labelled) in its own colour; and where the colour is `label` and the
    variants differ, each point or line mark not already shaped or dashed shaped (points) or dashed (lines) by the
    variant, the second dimension (run, model, setting). Applied where the data and the spec meet:
    widgets.chart() and with_data()."""
    spec = dict(spec)
    enc = dict(spec.get("encoding") or {})
    c = enc.get("color")
    if c and c.get("type") == "nominal" and c.get("field") in data:
        by, title = c["field"], c.get("title") or ""
        if "scale" not in c:
            values = sorted(data[c["field"]].dropna().unique().tolist(), key=str)
            order, owners = _owners(data, by, values)
            colour_of = dict(zip(order, colours(order, owners)))
            enc["color"] = {**c, "scale": {"domain": values, "range": [colour_of[v] for v in values]}}
    kind = spec.get("mark", {}).get("type") if isinstance(spec.get("mark"), dict) else spec.get("mark")
    if by == "label" and SECOND.get(kind) and not {"shape", "strokeDash"} & set(enc) \
            and "variant" in data and data["variant"].nunique() > 1:
        second = {**colour("variant", title.removeprefix("backend, ")),  # above the plot: short, beside the colours
                  "legend": {**LEGEND, "orient": "top"}}
        enc.update({channel: second for channel in SECOND[kind]})
    if enc:
        spec["encoding"] = enc
    for key in ("layer", "concat", "vconcat", "hconcat"):
        if key in spec:
            spec[key] = [coloured(part, data, by, title) for part in spec[key]]
    if "spec" in spec:
        spec["spec"] = coloured(spec["spec"], data, by, title)
    return spec


def _owners(data: pd.DataFrame, field: str, values: list) -> tuple[list, list | None]:
    """(values, the backend owning each) in the order colours() gives own colours: the labels of the variant that
    most backends share first."""
    if field != "label" or not {"backend_label", "variant"} <= set(data):
        return values, None
    first = data.drop_duplicates("label").set_index("label")
    count = first.groupby("variant").size()
    order = sorted(values, key=lambda v: (-count[first.at[v, "variant"]], str(first.at[v, "variant"]), str(v)))
    return order, [str(first.at[v, "backend_label"]) for v in order]
