"""Vega-Lite specs of the charts that the dashboard (app.py) and the HTML report (report.py) share: data in, spec
out (the dashboard passes the data beside the spec, the report embeds it)."""
from __future__ import annotations

import pandas as pd


def log_axis(field: str, title: str, **extra) -> dict:
    return {"field": field, "type": "quantitative", "scale": {"type": "log"}, "title": title, **extra}


def call_tooltip(unit: str) -> list:
    """What hovering over one attention call shows."""
    return ["block", "kind", "tokens", "score_table", {"field": "time_ms", "title": "time (ms)", "format": ".3f"},
            {"field": f"peak_mem_{unit}", "title": f"peak ({unit})", "format": ".2f"}]


def unet_map(field: str, title: str, unit: str) -> dict:
    """One cell's attention calls placed on the U (transforms.unet_layout), coloured by `field`."""
    return {"mark": {"type": "rect", "stroke": "white", "tooltip": True}, "height": 260, "encoding": {
        "x": {"field": "group_label", "type": "ordinal", "sort": {"field": "column"},
              "title": "transformer block, down -> mid -> up", "axis": {"labelAngle": -40}},
        "xOffset": {"field": "kind", "sort": ["self", "cross"]},
        "y": {"field": "level_label", "type": "ordinal", "sort": {"field": "level"}, "title": None},
        "yOffset": {"field": "layer", "type": "ordinal"},
        "color": {"field": field, "type": "quantitative", "title": title, "scale": {"scheme": "viridis"}},
        "tooltip": call_tooltip(unit)}}


def time_against_peak(sizes: list[str], unit: str, series: str = "backend_label", title: str = "backend") -> dict:
    """Attention time against peak memory, a panel per size, a colour per series (backend, run, GPU, ...)."""
    peak = f"attention_peak_mem_{unit}"
    tooltip = list(dict.fromkeys(["backend_label", "family", "size", series])) + [
        {"field": "attention_time_ms", "format": ".2f"}, {"field": peak, "format": ".2f"}]
    return {"mark": {"type": "point", "filled": True, "size": 100, "tooltip": True}, "width": 260, "height": 220,
            "encoding": {"facet": {"field": "size", "sort": sizes, "columns": 3, "title": None},
                         "x": log_axis(peak, f"attention peak memory ({unit})"),
                         "y": log_axis("attention_time_ms", "attention time (ms)"),
                         "color": {"field": series, "title": title},
                         "shape": {"field": "family" if series == "backend_label" else "backend_label",
                                   "title": "family" if series == "backend_label" else "backend"},
                         "tooltip": tooltip}}


def side_by_side(sizes: list[str], series: str, title: str) -> dict:
    """Each backend's attention time per size, one point per series value next to each other."""
    return {"mark": {"type": "point", "filled": True, "size": 110, "tooltip": True}, "width": 260, "height": 220,
            "encoding": {"facet": {"field": "size", "sort": sizes, "columns": 3, "title": None},
                         "x": {"field": "backend_label", "type": "nominal", "title": None},
                         "xOffset": {"field": series, "type": "nominal"},
                         "y": log_axis("attention_time_ms", "attention time (ms)"),
                         "color": {"field": series, "type": "nominal", "title": title},
                         "tooltip": ["backend_label", "size", series, {"field": "attention_time_ms", "format": ".2f"},
                                     {"field": "iqr_ms", "format": ".2f"}]}}


def scaling_time() -> dict:
    return {"mark": {"type": "line", "point": True, "tooltip": True},
            "title": "attention time (sum of the calls' medians)",
            "encoding": {"x": log_axis("pixels", "image size (pixels = width x height)"),
                         "y": log_axis("attention_time_ms", "time (ms)"),
                         "color": {"field": "backend_label", "title": "backend"},
                         "detail": {"field": "run_id"},  # a line per run: two runs at one size are not joined
                         "tooltip": ["size", "backend_label", "run_id",
                                     {"field": "attention_time_ms", "format": ".2f"}]}}


def scaling_peak(unit: str) -> dict:
    return {"mark": {"type": "line", "point": True, "tooltip": True},
            "title": "largest call's peak memory, measured (solid) and predicted (dashed)",
            "encoding": {"x": log_axis("pixels", "image size (pixels = width x height)"),
                         "y": log_axis(f"peak_{unit}", f"peak memory ({unit})"),
                         "color": {"field": "backend_label", "title": "backend"},
                         "strokeDash": {"field": "source", "sort": ["measured", "predicted"],
                                        "legend": {"orient": "top", "title": None}},
                         "detail": {"field": "run_id"},
                         "tooltip": ["size", "backend_label", "run_id", "source",
                                     {"field": f"peak_{unit}", "format": ".2f"}]}}


def roofline(lines: pd.DataFrame) -> dict:
    """Each attention call a point (FLOPs per byte moved against achieved FLOP/s, log-log); the device's two limits
    (transforms.roofline_lines: memory bandwidth up to the ridge, then the compute peak) as dashed lines, named."""
    x = log_axis("arithmetic_intensity", "arithmetic intensity (FLOPs per byte moved, the backend's model)")
    y = log_axis("achieved_flops_per_s", "achieved FLOP/s (the call's FLOPs / its median time)", axis={"format": "~s"})
    values = lines.astype(object).where(lines.notna(), None).to_dict("records")
    return {"height": 340, "layer": [
        {"mark": {"type": "point", "filled": True, "size": 60, "opacity": 0.8, "tooltip": True},
         "encoding": {"x": x, "y": y, "color": {"field": "backend_label", "title": "backend"},
                      "shape": {"field": "size", "title": "size"},
                      "tooltip": ["block", "backend_label", "size", "kind", "tokens",
                                  {"field": "time_ms", "title": "time (ms)", "format": ".3f"},
                                  {"field": "achieved_flops_per_s", "title": "FLOP/s", "format": ".3~s"},
                                  {"field": "arithmetic_intensity", "title": "FLOPs / byte", "format": ".3~r"},
                                  {"field": "pct_of_peak", "title": "% of the bound", "format": ".1f"},
                                  "roofline_bound"]}},
        {"data": {"values": values}, "mark": {"type": "line", "color": "black", "strokeDash": [5, 3]},
         "encoding": {"x": x, "y": y, "detail": {"field": "limit"}}},
        {"data": {"values": values}, "transform": [{"filter": "datum.label"}],
         "mark": {"type": "text", "align": "left", "dy": -7, "fontSize": 11},
         "encoding": {"x": x, "y": y, "text": {"field": "label"}}}]}


def with_data(spec: dict, data: pd.DataFrame) -> dict:
    """The spec with its data inline (for a page with no server): NaN as null."""
    records = data.astype(object).where(data.notna(), None).to_dict("records")
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", **spec, "data": {"values": records}}
