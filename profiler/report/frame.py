"""One schema for every reader of a stored run: Run.cells() and Run.read() hand their rows through here, so that show,
diff, the findings, the time model, replay and the dashboard all see the same columns whatever version of the
profiler recorded the run. Two things happen here and nowhere else:

- the columns a run recorded before a field existed lacks are filled with what their absence meant: no model
  settings ("{}"), the backend's default options ("{}"), a call's softmax upcast told by its 4-byte scores, a
  cell's device as its device_name, no place on the roofline (NaN), and the clock of its times (time_source:
  "cuda events" on CUDA, whose times were events around each call in a hooked forward, the host's time on a
  host-bound GPU; "host clock" on the CPU; a cell's prediction source, once stored as time_source, moved to
  predicted_time_source);
- the columns people read are derived once: size ('512x512'), pixels, aspect ('13:19'), backend_label
  ('sliced(slice_size=4)', backends.label), settings_label ('controlnet', or NO_SETTINGS), frames (a video model's,
  from its settings; NaN for images), family (backends.family) and, where a cell has both figures,
  forward_peak_ratio (measured over predicted).

A frame built by hand (a test's, one whose settings were edited) becomes a stored one's by passing through
`normalised`; derived columns are computed afresh each time."""
from __future__ import annotations

import json
import math

import pandas as pd

from ..attention import backends
from ..spec import ITEMSIZE, parse_dtype, settings_label

NO_SETTINGS = "none"  # settings_label of a cell whose model runs without settings
FILLED = {"settings": "{}", "backend_options": "{}"}  # column: its value in rows recorded before it existed
ROOFLINE = {"cells": ("device_peak_flops_per_s", "device_peak_bytes_per_s"),  # recorded since the device's limits
            "blocks": ("achieved_flops_per_s", "arithmetic_intensity")}  # were measured: none before


def normalised(df: pd.DataFrame) -> pd.DataFrame:
    """Stored rows (cells or blocks: these have call_index) with every column an old run lacks filled and every
    derived column added (those whose stored columns the rows hold: a test's rows may hold a few); an empty frame as
    it is."""
    if not len(df):
        return df
    kind = "blocks" if "call_index" in df else "cells"
    df = df.assign(**{c: df[c].fillna(v) if c in df else v for c, v in FILLED.items()},
                   **{c: math.nan for c in ROOFLINE[kind] if c not in df})
    if "device" in df:
        df = df.assign(**clocks(df))
    if kind == "blocks" and {"dtype", "score_bytes", "score_elements"} <= set(df):
        df = df.assign(upcast=upcast(df))
    elif kind == "cells" and "device" in df:  # cells recorded before they named their device, or failed first
        df = df.assign(device_name=df["device_name"].fillna(df["device"]) if "device_name" in df else df["device"])
    return df.assign(**_derived(df))


CLOCKS = {"cupti": "cupti kernel time", "host clock": "the host clock",  # what a stored time_source may say of
          "cuda events": "cuda events: the host's time on a host-bound GPU"}  # its times, and what that means


def clocks(df: pd.DataFrame) -> dict[str, pd.Series]:
    """time_source as stored, or for rows recorded before it (frame's docstring) the clock their device implies;
    a prediction's source text once stored under that name, as predicted_time_source."""
    implied = df["device"].astype(str).str.startswith("cuda").map({True: "cuda events", False: "host clock"})
    stored = df["time_source"] if "time_source" in df else pd.Series(None, index=df.index, dtype=object)
    clock = stored.where(stored.isin(list(CLOCKS)), implied)
    out = {"time_source": clock}
    moved = stored.notna() & ~stored.isin(list(CLOCKS))
    if moved.any():
        kept = df["predicted_time_source"] if "predicted_time_source" in df else stored.where(~moved)
        out["predicted_time_source"] = kept.where(kept.notna(), stored.where(moved))
    return out


def upcast(blocks: pd.DataFrame) -> pd.Series:
    """Each call's softmax upcast as recorded ('attention', 'softmax' or ''), and for rows recorded before the field
    existed, as their score bytes tell it: 4-byte scores of a dtype below 4 bytes are U-Net rows, whose upcast is
    upcast_attention (the rule of the memory models)."""
    recorded = blocks["upcast"] if "upcast" in blocks else pd.Series(None, index=blocks.index, dtype=object)
    itemsize = blocks["dtype"].map({d: ITEMSIZE[parse_dtype(d)] for d in set(blocks["dtype"])})
    told = ((itemsize < 4) & (blocks["score_bytes"] != blocks["score_elements"] * itemsize)).map(
        {True: "attention", False: ""})
    return recorded.where(recorded.notna(), told)


def _derived(df: pd.DataFrame) -> dict[str, pd.Series | list]:
    """The display columns, each from the stored ones (per distinct value: a run may hold a million block rows)."""
    out = {}
    if {"width", "height"} <= set(df):
        shape = {(w, h): f"{w // math.gcd(w, h)}:{h // math.gcd(w, h)}" for w, h in set(zip(df["width"], df["height"]))}
        out.update(size=df["width"].astype(str) + "x" + df["height"].astype(str), pixels=df["width"] * df["height"],
                   aspect=[shape[s] for s in zip(df["width"], df["height"])])
    words = df["settings"].map({s: settings_label(s) or NO_SETTINGS for s in set(df["settings"])})
    frames = {s: json.loads(s).get("frames", math.nan) for s in set(df["settings"])}
    out["frames"] = df["settings"].map(frames)  # a video model's frames (its settings say them); NaN: images
    if "backend" in df:
        pairs = list(zip(df["backend"], df["backend_options"]))
        labels = {p: backends.label(*p) for p in dict.fromkeys(pairs)}
        out.update(backend_label=[labels[p] for p in pairs], settings_label=words,
                   family=df["backend"].map(backends.family))
    else:
        out["settings_label"] = words
    if {"forward_peak_total_bytes", "predicted_forward_peak_bytes"} <= set(df):  # measured beside predicted
        out["forward_peak_ratio"] = df["forward_peak_total_bytes"] / df["predicted_forward_peak_bytes"]
    return out
