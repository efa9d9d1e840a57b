"""Data transforms behind the dashboard: plain pandas over profiler.store, no Streamlit, tested by pytest.

Tables keep raw numbers with units in the column names (for CSV); display() turns them into MiB / GiB and ms."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from profiler.attention import backends
from profiler.fmt import human_bytes, human_count, human_ms
from profiler.report.show import UNREADABLE, runs_index as load_index  # noqa: F401 (the Runs page's table)
from profiler.spec import GiB, MiB
from profiler.store import DONE_STATUSES, Run  # noqa: F401 (DONE_STATUSES: the app's status columns)

FILTERS = ("model", "settings_label", "backend", "dtype", "size")
UNITS = {"MiB": MiB, "GiB": GiB}


# ---- the runs index and one run's tables

def load_run(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(cells, blocks) of one run, as the store reads them (profiler/report/frame.py: size, pixels, aspect,
    backend_label, settings_label, family and forward_peak_ratio added). Raises on a corrupt run. The blocks' raw
    samples (time_samples_ms) are dropped: the dashboard shows medians, IQR and the noisy flag."""
    cells, blocks = Run.open(path).read()
    return cells, blocks.drop(columns=["time_samples_ms"], errors="ignore")


def joined(parts) -> pd.DataFrame:
    """The frames among parts that have rows, as one (several runs' cells or blocks); an empty frame where none has."""
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def family_order(df: pd.DataFrame) -> pd.Series:
    """Each row's place by its backend's family (backends.FAMILIES, then 'other'), for a sort that groups them."""
    return df["family"].map({f: i for i, f in enumerate((*backends.FAMILIES, "other"))})


# ---- what tells one series of a chart from another

SERIES = ("backend_label", "model", "settings_label", "dtype", "batch", "aspect", "run_id")
CELL_SERIES = ("backend_label", "model", "settings_label", "dtype", "batch", "run_id")  # a panel per size
_NAMES = {"backend_label": ("backend", "{}"), "batch": ("batch", "batch {}"), "aspect": ("aspect", "aspect {}"),
          "run_id": ("run", "{}"), "settings_label": ("settings", "({})"), "generation": ("generation", "generation {}")}


def labelled(df: pd.DataFrame, fields=SERIES) -> tuple[pd.DataFrame, str]:
    """(df with `label`, its title): each row's values of those of `fields` that vary in df, e.g.
    'sdpa tiny-sdxl float32' and 'backend, model, dtype'; the first field alone where none varies. A chart that
    colours by `label` splits its series by everything that differs between them (dashboards/charts.py). Where the
    backend varies beside other fields, `variant` holds those others ('tiny-sdxl float32'; else ''): the second
    dimension that charts.coloured draws as a dash or a shape."""
    present = [f for f in fields if f in df]
    varying = [f for f in present if df[f].nunique(dropna=False) > 1] or present[:1]
    def name(row, skip=()):
        return " ".join(_NAMES.get(f, (f, "{}"))[1].format(v) for f, v in zip(varying, row) if f not in skip)

    rows = list(df[varying].itertuples(index=False))
    labels = [name(r) for r in rows]
    variants = [name(r, ("backend_label",)) if "backend_label" in varying else "" for r in rows]
    return df.assign(label=labels, variant=variants), ", ".join(_NAMES.get(f, (f,))[0] for f in varying)


PANELS = ("model", "settings_label", "dtype", "batch", "aspect")  # the Scaling page: a panel per combination
LINES = ("backend_label", "run_id")  # in a panel, a line per backend (and per run where runs overlap)


def panelled(df: pd.DataFrame) -> tuple[pd.DataFrame, str, str]:
    """(df with `panel` and `label`, the panels' title, the lines' title) for small multiples: a panel per
    combination of those of PANELS that vary (labelled), in each a line per backend; split by run only where two
    runs hold one backend's cell of one panel at one size, so that runs of one size each draw one line."""
    df, panels = labelled(df, PANELS)
    df = df.rename(columns={"label": "panel"})
    overlap = "run_id" in df and df.duplicated(["panel", "backend_label", "size"]).any()
    df, legend = labelled(df, LINES if overlap else LINES[:1])
    return df, panels, legend


def size_ticks(df: pd.DataFrame) -> dict:
    """A log axis of pixels whose ticks are the sizes in df, each named as people name it (512x512), not a count."""
    names = df.groupby("pixels")["size"].agg(lambda s: " / ".join(dict.fromkeys(s)))  # 512x1024 / 1024x512
    expr = " : ".join(f"datum.value == {int(p)} ? '{n}'" for p, n in names.items()) + " : ''"
    return {"values": [int(p) for p in names.index], "labelExpr": expr, "labelOverlap": "greedy"}


# ---- filters

def options(df: pd.DataFrame, column: str) -> list:
    """The values of a filter column: sizes by pixel count, backends in registry order, others sorted."""
    if not len(df) or column not in df:
        return []
    values = df[column].dropna().unique().tolist()
    if column == "size":
        return sorted(values, key=lambda s: (int(s.split("x")[0]) * int(s.split("x")[1]), s))
    if column == "backend":
        order = {n: i for i, n in enumerate(backends.BACKENDS)}
        return sorted(values, key=lambda n: (order.get(n, len(order)), n))
    return sorted(values)


def apply_filters(df: pd.DataFrame, filters: dict[str, list]) -> pd.DataFrame:
    """Rows whose value is among the chosen ones, for each filter column; an empty choice keeps every row."""
    keep = pd.Series(True, index=df.index)
    for column, chosen in filters.items():
        if chosen and column in df:
            keep &= df[column].isin(chosen)
    return df[keep]


# ---- the Run page

def unet_layout(blocks: pd.DataFrame) -> pd.DataFrame:
    """One cell's attention calls placed on the U: `column` runs down -> mid -> up in call order (one column per
    Transformer2DModel), `level` is the row, `kind` and `layer` (transformer block) split each tile."""
    if blocks["cell_id"].nunique() > 1:
        raise ValueError("unet_layout draws one cell: filter the blocks to one cell_id first")
    b = blocks.sort_values("call_index").reset_index(drop=True)
    parts = b["block"].str.extract(r"^(?P<group>.+?)\.transformer_blocks\.(?P<layer>\d+)\.attn\d(?:\.image)?$")
    b["group"] = parts["group"].fillna(b["block"])  # a VAE's mid-block attention is its own group
    b["layer"] = parts["layer"].fillna(0).astype(int)
    repeated = b.groupby(["group", "kind", "layer"]).cumcount()  # a tiled VAE calls one block once per tile
    b["layer"] = b["layer"] + repeated
    b["column"] = b["group"].map({g: i for i, g in enumerate(dict.fromkeys(b["group"]))})
    b["group_label"] = b["group"].str.replace(r"^(?:([\w.]+)\.)?mid_block\.attentions\.\d+$", r"\1 mid", regex=True) \
        .str.replace(r"^(?:([\w.]+)\.)?(down|up)_blocks\.(\d+)\.attentions\.(\d+)$", r"\1 \2 \3.\4", regex=True) \
        .str.strip()  # down 1.0, up 2.1, mid; controlnet down 0.0; decoder mid; vae.decoder mid
    tokens = b[b["kind"] == "self"].groupby("level")["tokens_q"].first()
    b["level_label"] = b["level"].map(lambda lv: f"level {lv}: {tokens.get(lv, '?')} tokens")
    b["tokens"] = b["tokens_q"].astype(str) + " x " + b["tokens_k"].astype(str)
    b["score_table"] = b["score_bytes"].map(human_bytes)
    return b


def unet_title(layout: pd.DataFrame) -> str:
    """What the U-Net map draws, naming only the parts this cell has (its ControlNet, IP-Adapter's image tokens)."""
    if layout["block"].str.match(r"(vae\.)?(en|de)coder\.").all():
        return "The VAE: its mid block's attention (one tile per call: a tiled decode calls it per tile)"
    controlnet = layout["block"].str.startswith("controlnet.")
    kinds = " | ".join(k for k in ("self", "cross", "image") if k in set(layout["kind"]))
    image = ": IP-Adapter's image tokens" if "image" in kinds else ""
    if controlnet.all():  # a recorded generation's ControlNet: a component of its own
        return f"The ControlNet: down and mid by level; each tile one attention call ({kinds}{image})"
    parts = " and its ControlNet" if controlnet.any() else ""
    return f"The U-Net{parts}: down, mid and up by level; each tile one attention call ({kinds}{image})"


DENOISERS = ("unet", "model", "transformer", "prior", "controlnet")  # a recorded generation's, drawn first


def by_component(blocks: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One cell's block rows split by the component that made them, each drawn in a chart of its own (a recorded
    generation's U-Net, VAE and text encoder; a VAE's 192 tokens never in a U-Net row): the denoisers first, then the
    others in call order. A cell of a sweep (no component) is one group, ''."""
    if "component" not in blocks or blocks["component"].isna().all():
        return [("", blocks)]
    named = blocks.assign(component=blocks["component"].fillna(""))
    order = list(dict.fromkeys(named.sort_values("call_index")["component"]))
    order = [c for c in DENOISERS if c in order] + [c for c in order if c not in DENOISERS]
    return [(c, named[named["component"] == c]) for c in order]


def mapped(layout: pd.DataFrame) -> bool:
    """Whether a component's calls have a place on the U (down, mid, up by level): a U-Net's, a ControlNet's, a
    VAE's; a text encoder's (its layers in order, stage 'other') are drawn as bars instead."""
    return bool((layout["stage"] != "other").any())


def component_title(component: str, layout: pd.DataFrame) -> str:
    """A component's chart title: the U-Net map's (unet_title) where its calls are on the U, else its calls in order."""
    if mapped(layout):
        return unet_title(layout)
    heads = ", ".join(f"{h} heads of {d}" for h, d in dict.fromkeys(zip(layout["heads"], layout["head_dim"])))
    tokens = ", ".join(str(t) for t in dict.fromkeys(layout["tokens_q"]))
    return f"The {component or 'model'}: its attention calls in order, one bar each ({heads}; {tokens} tokens)"


def no_peaks_reason(cells: pd.DataFrame) -> str:
    """Why the chosen cells' memory charts are empty where no call of them has a measured peak ('' where some
    has): generations recorded on the CPU (only a CUDA allocator counts a call's peak without changing the run),
    else cells whose calls were fused away (compiled)."""
    if not len(cells) or cells.get("attention_peak_mem_bytes", pd.Series(dtype=float)).notna().any():
        return ""
    if (cells.get("kind") == "record").all() and (cells["device"] == "cpu").all():
        return ("No peak memory to draw: these are generations recorded on the CPU, where no call has a peak of its "
                "own (only a CUDA allocator counts one without changing the run; attnprof run --device cpu measures "
                "a model's calls' peaks in a probe pass of its own).")
    return "No peak memory to draw: no call of these cells has a measured peak (a compiled cell's are fused away)."


# ---- the Compare page

def compare_table(cells: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Every cell with its attention time and peak as a ratio to the baseline backend's cell of the same run, model,
    dtype, batch and size (NaN where either did not end ok)."""
    key = ["run_id", "model", "settings_label", "dtype", "batch", "width", "height"]
    measured = ["attention_time_ms", "attention_peak_mem_bytes"]
    base = cells[(cells["backend_label"] == baseline) & (cells["status"] == "ok")][key + measured]
    base = base.drop_duplicates(key).rename(columns={m: f"baseline_{m}" for m in measured})
    out = cells.merge(base, on=key, how="left")
    ok = out["status"] == "ok"
    out["time_ratio"] = (out["attention_time_ms"] / out["baseline_attention_time_ms"]).where(ok)
    out["peak_ratio"] = (out["attention_peak_mem_bytes"] / out["baseline_attention_peak_mem_bytes"]).where(ok)
    columns = ["run_id", "model", "settings_label", "dtype", "batch", "size", "pixels", "family", "backend_label",
               "status", "attention_time_ms", "max_rel_err", "error_ok", "attention_peak_mem_bytes", "time_ratio",
               "peak_ratio", "forward_time_ms", "compile_s", "forward_peak_mem_bytes", "noisy", "error"]
    out = out.assign(_family=family_order(out))
    return out.sort_values(["model", "dtype", "batch", "pixels", "_family"], kind="stable")[
        [c for c in columns if c in out]]


def verdicts_first(matched: pd.DataFrame) -> pd.DataFrame:
    """A diff's matched cells (profiler.report.compare) with what a reader looks for first on the left: the verdict,
    the cell (backend, size, model) and the time's and peak's ratios and verdicts, then the rest as compare orders
    them: in a window 1400 px wide the verdict is never scrolled off to the right."""
    first = ["verdict", "backend", "width", "height", "batch", "dtype", "time_ratio", "time_verdict", "peak_ratio",
             "peak_verdict", "time_note", "model"]
    first = [c for c in first if c in matched]
    return matched[first + [c for c in matched.columns if c not in first]]


def family_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The ok cells grouped by family (reference, chunked, fused exact, fused approximate), each backend's
    attention time beside its error against the fp32 reference and its peak: a fast kernel with a large error
    shows as such. One row per (model, dtype, batch, size, backend)."""
    ok = cells[cells["status"] == "ok"]
    if not len(ok):
        return pd.DataFrame()
    ok = ok.assign(_family=family_order(ok))
    columns = ["family", "backend_label", "model", "settings_label", "dtype", "batch", "size", "attention_time_ms",
               "max_rel_err", "error_ok", "attention_peak_mem_bytes", "compile_s", "run_id"]
    return ok.sort_values(["_family", "model", "dtype", "batch", "pixels", "attention_time_ms"], kind="stable")[
        [c for c in columns if c in ok]].reset_index(drop=True)


def largest_ok(cells: pd.DataFrame) -> pd.DataFrame:
    """Per backend (and run, model, dtype, batch): the largest size that ended ok, and the smallest size above it
    that did not, with its status."""
    rows = []
    key = ["run_id", "model", "settings_label", "dtype", "batch", "backend_label", "family"]
    for values, g in cells.groupby(key, sort=False):
        ok = g[g["status"] == "ok"].sort_values("pixels", kind="stable")
        top = ok.iloc[-1] if len(ok) else None
        above = g[(g["status"] != "ok") & (g["pixels"] > (top["pixels"] if top is not None else -1))]
        first = above.sort_values("pixels", kind="stable").iloc[0] if len(above) else None
        rows.append({**dict(zip(key, values)), "sizes_tried": g["size"].nunique(),
                     "largest_ok_size": top["size"] if top is not None else "none",
                     "largest_ok_pixels": int(top["pixels"]) if top is not None else 0,
                     "failed_above": f"{first['status']} at {first['size']}" if first is not None else ""})
    return pd.DataFrame(rows, columns=key + ["sizes_tried", "largest_ok_size", "largest_ok_pixels", "failed_above"])


def roofline_points(blocks: pd.DataFrame) -> pd.DataFrame:
    """The ok calls that have a place on the roofline (achieved FLOP/s and FLOPs per byte moved; runs recorded
    before these fields have none), one row each."""
    if not len(blocks):
        return pd.DataFrame()
    ok = blocks[(blocks["status"] == "ok") & blocks["achieved_flops_per_s"].gt(0)
                & blocks["arithmetic_intensity"].gt(0)]
    return ok.assign(tokens=ok["tokens_q"].astype(str) + " x " + ok["tokens_k"].astype(str))


def roofline_lines(cells: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    """The device's two limits as lines over the points' range of intensity, per (device, dtype) of the ok cells:
    the memory-bandwidth line (FLOP/s = bandwidth x intensity) up to the ridge point, then the compute peak; each
    line's `limit` names it with its figure, and its first point carries it as a `name`."""
    limits = ["device_peak_flops_per_s", "device_peak_bytes_per_s"]
    if not len(points):
        return pd.DataFrame()
    ok = cells[(cells["status"] == "ok")].dropna(subset=limits)
    lo, hi = points["arithmetic_intensity"].min() / 2, points["arithmetic_intensity"].max() * 2
    rows = []
    for (device, dtype, peak, bandwidth), _ in ok.groupby(["device_name", "dtype", *limits], sort=False):
        ridge = peak / bandwidth
        x0, x1 = min(lo, ridge / 2), max(hi, ridge * 2)
        memory = f"{device}: memory {human_bytes(bandwidth)}/s"
        compute = f"{device}: {dtype} compute {peak / 1e12:.3g} TFLOP/s" if peak >= 1e12 else \
            f"{device}: {dtype} compute {peak / 1e9:.3g} GFLOP/s"
        rows += [{"limit": memory, "arithmetic_intensity": x0, "achieved_flops_per_s": bandwidth * x0, "name": memory},
                 {"limit": memory, "arithmetic_intensity": ridge, "achieved_flops_per_s": peak, "name": None},
                 {"limit": compute, "arithmetic_intensity": ridge, "achieved_flops_per_s": peak, "name": compute},
                 {"limit": compute, "arithmetic_intensity": x1, "achieved_flops_per_s": peak, "name": None}]
    return pd.DataFrame(rows).drop_duplicates()


# The cells table of the Run page and of the report: what a cell is, how it ended, its figures beside the planner's.
# time_source says what the times are: kernel time (cupti) on CUDA, the host clock on the CPU, CUDA events (the host's
# time on a host-bound GPU) for CUDA runs recorded before kernel timing; bound and gpu_busy_pct say what set a CUDA
# forward's pace, attention_kernel_ms and attention_proj_ms where the calls' time went (shown as attention core and
# attention projections: SPLIT_NAMES), attention_host_ms their host time.
CELL_COLUMNS = ("run_id", "model", "settings_label", "size", "batch", "dtype", "family", "backend_label", "status",
                "error", "attention_time_ms", "time_source", "attention_kernel_ms", "attention_proj_ms",
                "attention_host_ms", "bound",
                "gpu_busy_pct", "forward_gpu_ms", "forward_graph_ms", "unsteady", "max_rel_err", "iqr_ms",
                "attention_peak_mem_bytes",
                "predicted_peak_bytes", "forward_peak_total_bytes", "predicted_forward_peak_bytes",
                "forward_peak_ratio", "forward_time_ms", "compile_s", "attention_achieved_flops_per_s",
                "attention_pct_of_peak", "attention_roofline_bound", "noisy", "kernel", "trace_files")


# Where an attention call's time went (report.compare.ATTENTION_SPLIT), stored in one pair of columns on both devices
# (kernel time on CUDA, host time on the CPU), as the tables name it
SPLIT_NAMES = {"attention_kernel_ms": "attention_core_ms", "attention_proj_ms": "attention_projections_ms",
               "attn_kernel_ms": "core_ms", "proj_kernel_ms": "projections_ms"}


def cells_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells table of the Run page and of the report: CELL_COLUMNS that the cells hold, the attention split
    always (NaN, shown '-', for a run stored without it) and named as SPLIT_NAMES says."""
    columns = [c for c in CELL_COLUMNS if c in cells or c in SPLIT_NAMES]
    return cells.reindex(columns=columns).rename(columns=SPLIT_NAMES)


def run_findings(cells: pd.DataFrame, blocks: pd.DataFrame) -> dict[str, list[str]]:
    """Each run's headline findings (profiler.report.findings, as attnprof show states them), by run id."""
    from profiler.report.findings import findings

    if not len(cells):
        return {}
    return {run: findings(cells[cells["run_id"] == run],
                          blocks[blocks["run_id"] == run] if len(blocks) else blocks)
            for run in dict.fromkeys(cells["run_id"])}


TUNED_COLUMNS = ("run_id", "map", "block", "kind", "heads", "head_dim", "tokens_q", "tokens_k", "chosen", "time_ms",
                 "runner_up", "runner_up_ms", "why")


def tuned_maps(cells: pd.DataFrame, blocks: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The processor maps of the runs (attnprof tune's cells, backend `tuned`): per block its shape, the backend
    chosen, its kernel's time alone, the runner-up's and why; and each map's proof (findings.tune_line)."""
    from profiler.report.findings import tune_line

    maps = cells[cells["backend"].eq("tuned") & cells["status"].eq("ok")] if len(cells) and "backend" in cells \
        else cells.iloc[:0]
    if not len(maps) or not len(blocks) or "chosen" not in blocks:
        return pd.DataFrame(columns=TUNED_COLUMNS), []
    rows = blocks[blocks["cell_id"].isin(maps["cell_id"]) & blocks["run_id"].isin(maps["run_id"])]
    rows = rows.sort_values(["run_id", "call_index"]).assign(map=rows["backend_label"])
    lines = [f"{c['run_id']}, {c['backend_label']}: {tune_line(c)}" for c in maps.to_dict("records")]
    return rows[list(TUNED_COLUMNS)].reset_index(drop=True), lines


# ---- runs against runs (profiler.report.compare holds the matching and the noise rule)

ENV_SKIP = ("device", "cpu_count", "platform")  # the same in every run of a grid, or said by device_name / cpu


def run_envs(paths: list[Path]) -> pd.DataFrame:
    """One row per run: run_id and its environment's fields (device name, library versions, threads, ...)."""
    rows = []
    for path in paths:
        run = Run.open(Path(path))
        env = run.manifest().get("environment") or {}
        rows.append({"run_id": run.id, **{k: str(v) for k, v in env.items()}})
    return pd.DataFrame(rows)


def differing(envs: pd.DataFrame) -> list[str]:
    """The environment fields whose values differ between the runs: what a comparison can be side by side by."""
    return [c for c in envs.columns if c != "run_id" and c not in ENV_SKIP and envs[c].nunique(dropna=False) > 1]


def with_series(cells: pd.DataFrame, envs: pd.DataFrame, by: str) -> pd.DataFrame:
    """cells with `series`: the backend, the run, or an environment field's value of the cell's run (with the run's
    id where runs share the value, so that no two runs' points fall on one spot)."""
    if by == "backend":
        return cells.assign(series=cells["backend_label"])
    if by == "run":
        return cells.assign(series=cells["run_id"])
    values = cells["run_id"].map(dict(zip(envs["run_id"], envs[by])))
    if by in cells:  # also recorded per cell (torch_threads): the cell's own value where it has one
        own = cells[by].map(lambda v: None if v is None or v != v else str(int(v) if isinstance(v, float) else v))
        values = own.where(own.notna(), values)
    series = f"{by}=" + values.astype(str)
    shared = cells.groupby(series)["run_id"].transform("nunique") > 1
    return cells.assign(series=series.where(~shared, series + " (" + cells["run_id"] + ")"))


def best_backends(cells: pd.DataFrame, budget_bytes: int) -> pd.DataFrame:
    """Per device and size (and model, dtype, batch): the fastest backend that ended ok, the memory-smallest, and
    the fastest among those whose forward (weights + inputs + its transient) fits the budget."""
    ok = cells[cells["status"] == "ok"].copy()
    if not len(ok):
        return pd.DataFrame()
    need = ok["forward_peak_total_bytes"] if "forward_peak_total_bytes" in ok else ok["attention_peak_mem_bytes"]
    ok["fits"] = need.fillna(ok["attention_peak_mem_bytes"]) <= budget_bytes
    rows = []
    for (device, model, settings, dtype, batch, size), g in ok.groupby(
            ["device_name", "model", "settings_label", "dtype", "batch", "size"], sort=False):
        timed, peaked = (g[g[c].notna()] for c in ("attention_time_ms", "attention_peak_mem_bytes"))  # none: a
        fast = timed.loc[timed["attention_time_ms"].idxmin()] if len(timed) else None  # compiled cell fused away,
        small = peaked.loc[peaked["attention_peak_mem_bytes"].idxmin()] if len(peaked) else None  # a CPU record
        fitting = timed[timed["fits"]]
        best = fitting.loc[fitting["attention_time_ms"].idxmin()] if len(fitting) else None
        rows.append({"device_name": device, "model": model, "settings_label": settings, "dtype": dtype,
                     "batch": batch, "size": size,
                     "pixels": int(g["pixels"].iloc[0]), "fastest": fast["backend_label"] if fast is not None else
                     "none timed", "fastest_time_ms": fast["attention_time_ms"] if fast is not None else float("nan"),
                     "smallest": small["backend_label"] if small is not None else "none measured",
                     "smallest_peak_bytes": small["attention_peak_mem_bytes"] if small is not None else float("nan"),
                     "fastest_that_fits": best["backend_label"] if best is not None else "none",
                     "fastest_that_fits_time_ms": best["attention_time_ms"] if best is not None else float("nan"),
                     "budget_bytes": budget_bytes})
    return pd.DataFrame(rows).sort_values(["device_name", "model", "pixels"], kind="stable").reset_index(drop=True)


def pipeline_table(rows: list[dict]) -> pd.DataFrame:
    """One row per GPU size: the largest square image a whole generation fits, the phase that sets it, and each
    phase's own largest (planner/pipeline.py's pipeline_by_budget)."""
    size = lambda s: f"{s[0]}x{s[1]}" if s else "none"  # noqa: E731
    return pd.DataFrame([{"gpu_memory_gib": r["budget_bytes"] // GiB, "largest": size(r["largest"]),
                          "limited_by": r["limited_by"], **{f"{ph}_alone": size(v) for ph, v in r["phases"].items()}}
                         for r in rows])


# ---- the Scaling page

def scaling_table(blocks: pd.DataFrame) -> pd.DataFrame:
    """Per cell that ran: the finest level's tokens, the largest score table, the attention time (sum of the calls'
    medians) and the largest call's peak memory, measured beside the memory model's prediction."""
    key = ["run_id", "model", "settings_label", "dtype", "batch", "backend_label", "family", "size", "width",
           "height", "pixels", "aspect"]
    ok = blocks[blocks["status"] == "ok"]
    if "component" in ok:  # a recorded generation's denoiser: its text encoder's 77 tokens are no level of it
        ok = ok[ok["component"].isna() | ok["component"].isin(DENOISERS)]
    out = ok.groupby(key, as_index=False).agg(
        tokens_max=("tokens_q", "max"), score_elements_max=("score_elements", "max"),
        score_table_max_bytes=("score_bytes", "max"), attention_time_ms=("time_ms", "sum"),
        peak_mem_bytes=("peak_mem_bytes", "max"), predicted_peak_bytes=("predicted_peak_bytes", "max"))
    return out.sort_values(["model", "backend_label", "pixels"], kind="stable").reset_index(drop=True)


def scaling_long(table: pd.DataFrame) -> pd.DataFrame:
    """The peak columns of scaling_table stacked, with `source` = measured / predicted, for one chart."""
    keep = [c for c in table if c not in ("peak_mem_bytes", "predicted_peak_bytes")]
    long = table.melt(id_vars=keep, value_vars=["peak_mem_bytes", "predicted_peak_bytes"], var_name="source",
                      value_name="peak_bytes")
    long["source"] = long["source"].map({"peak_mem_bytes": "measured", "predicted_peak_bytes": "predicted"})
    return long


def shape_table(table: pd.DataFrame, value: str, depends_on: tuple[str, ...]) -> pd.DataFrame:
    """One row per shape that `value` depends on (tokens: model and aspect; score tables: also dtype and batch) and
    size, from scaling_table: what does not depend on the backend or the run, drawn once."""
    keep = [*depends_on, "size", "pixels", value]
    return table[keep].drop_duplicates([*depends_on, "size"]).reset_index(drop=True)


# ---- the Planner page

def planner_table(traced: dict, budget_bytes: int) -> pd.DataFrame:
    """Each backend's predicted need (planner/forward.py: the whole forward's peak, weights and inputs included, default
    options) against a budget, with its largest attention call and how the calls were traced."""
    from profiler.planner.forward import method_text

    rows = []
    for name, b in traced["backends"].items():
        top = max(traced["rows"], key=lambda r: r["traced_peak_bytes"][name])
        need = b["predicted_forward_peak_bytes"]
        rows.append({"backend": name, "family": backends.family(name), "need_bytes": need, "weights_bytes":
                     traced["weights_bytes"], "transient_peak_bytes": b["transient_peak_bytes"],
                     "largest_call": top["block"], "largest_call_peak_bytes": top["traced_peak_bytes"][name],
                     "budget_bytes": budget_bytes, "fits": need <= budget_bytes, "headroom_bytes": budget_bytes - need,
                     "how": method_text(b["how"])})
    return pd.DataFrame(rows)


GPU_SIZES_GIB = (8, 12, 16, 24, 40, 48, 80, 141)


def largest_table(fits: list[dict]) -> pd.DataFrame:
    """Backends (rows) by GPU memory (columns): the largest square image whose forward fits, from fit_many."""
    rows = {}
    for f in fits:
        column = f"{f['budget_bytes'] / GiB:g} GiB"
        for b in f["backends"]:
            size = f"{b['largest'][0]}x{b['largest'][1]}" if b["largest"] else "none"
            rows.setdefault(b["backend"], {"backend": b["backend"]})[column] = size
    return pd.DataFrame(list(rows.values()))


# ---- the Queue page

def sweep_yaml(models: list[str], sizes: str, batch: str, dtypes: list[str], chosen: list[str], device: str,
               repeats: int = 3, warmup: int = 1) -> str:
    """A sweep config from the Queue page's widgets; the sizes and batch fields as typed, comma- or space-separated,
    so that validation names what was wrong. No dtypes: the key is left out, and each cell takes its device's default
    (float16 on CUDA, float32 on the CPU, where float16 is emulated)."""
    import yaml

    def items(text: str) -> list:
        return [int(x) if x.isdigit() else x for x in text.replace(",", " ").split()]

    doc = {"models": models, "sizes": [str(x) for x in items(sizes)], "batch": items(batch),
           **({"dtypes": dtypes} if dtypes else {}), "backends": chosen, "repeats": repeats, "warmup": warmup,
           "device": device}
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


# ---- units for people

def mem_unit(max_bytes) -> tuple[str, int]:
    """The axis unit for memory: GiB from 1 GiB up, else MiB."""
    return ("GiB", GiB) if max_bytes == max_bytes and max_bytes >= GiB else ("MiB", MiB)


def with_mem_unit(df: pd.DataFrame, columns: list[str], unit: str | None = None) -> tuple[pd.DataFrame, str]:
    """For charts: each <name>_bytes column also as <name>_MiB or <name>_GiB, one unit for all by the largest value
    (or the unit given: a part drawn in the unit of the whole)."""
    unit = unit or mem_unit(max(df[c].max() for c in columns) if len(df) else 0)[0]
    return df.assign(**{c.removesuffix("_bytes") + "_" + unit: df[c] / UNITS[unit] for c in columns}), unit


def _shown(fmt):
    return lambda v: "-" if v is None or (isinstance(v, float) and v != v) else fmt(v)


# How display() shows a column, by the end of its name: (ending, format, the name's ending dropped). First match wins.
SHOWN = (("_bytes", human_bytes, True), ("bytes_moved", human_bytes, False), ("_ms", human_ms, True),
         ("_ratio", lambda r: f"{r:.2f}x", False), ("_pct", lambda v: f"{v:.1f}%", True), ("_flops_per_s", lambda v: f"{human_count(v)}FLOP/s", False),
         ("_err", lambda v: f"{v:.2e}", False), ("pct_of_peak", lambda v: f"{v:.1f}%", False),
         ("arithmetic_intensity", lambda v: f"{v:.3g} FLOP/B", False),
         ("flops", lambda v: f"{human_count(v)}FLOP", False), ("_s", lambda v: f"{v:.2f} s", True))


def display(df: pd.DataFrame) -> pd.DataFrame:
    """A copy for reading, each number with its unit (SHOWN): *_bytes as MiB / GiB, *_ms as ms, *_ratio as 1.23x,
    FLOP/s with a prefix (1.00 GFLOP/s), errors as 1.07e-06, shares as 12.3%, *_s as seconds; unit suffixes
    dropped from the names."""
    out = df.copy()
    names = {}
    for column in df.columns:
        rule = next(((end, fmt, drop) for end, fmt, drop in SHOWN if column.endswith(end)), None)
        if rule is None or df[column].dtype == bool:
            continue
        end, fmt, drop = rule
        out[column] = df[column].map(_shown(fmt))
        names[column] = column.removesuffix(end) if drop else column
    names = {c: "score table" if c == "score_bytes" else n.replace("_", " ") if c != n else n
             for c, n in names.items()}
    return out.rename(columns=names)
