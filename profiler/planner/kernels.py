"""The time model on a GPU's kernels: each attention call's kernel time, fitted to the kernel times GPUs printed.

On a GPU an eager forward at batch 1 or 2 waits on the host (the H200 run of 2026-12-04: the GPU busy 6-42% of each
forward), so a call there is two figures priced apart: its kernels' (here) and the host's dispatch and launches
(planner/host.py). A call's kernel time, in ms:

    a_k,self . core_self + a_k,cross . core_cross + c . projections + d

with planner/timing.py's features on the published figures of the GPU (gpus.py: its dense peak P and bandwidth B; no
cache or softmax term, which a GPU's fused kernels keep inside), k the kernel that ran the call's attention (the SDPA
kernel PyTorch chose for it or the backend forced: cudnn, flash, efficient, math; naive's baddbmm, softmax and bmm;
xformers' is the efficient kernel, flash-attn's the flash one), and c and d shared by every kernel: the projections
are the same GEMMs under every backend, d the kernels' minimum time a call. Fitted by least squares, every coefficient
>= 0, to every admitted call of one GPU architecture's data (1/a: the kernel's efficiency against the published peak):
- kept with the project (configs/kernels/*.csv, package data): the H200 run of 2026-12-04 (docs/gpu-check-2026-12-04),
  each call's gpu_time_ms: the CUPTI kernels its probe pass credited to it, one forward;
- the runs under --results made on a GPU of that architecture: a block row's time_ms where its time_source is "cupti"
  (the median of its profiled forwards' kernel times), else its gpu_time_ms, else nothing: a CUDA row without either
  is event-timed, which on a host-bound forward is the host's time (2.4-17x the kernels on the H200), and its cell is
  refused.
A cell with a warm-up below MIN_WARMUP forwards or fewer than MIN_REPEATS repeats is refused (its first forwards carry
cuDNN's plans, cuBLAS's heuristics and lazy loading: the first run's one cold cell, warm-up 0 and 1 repeat, taught
the event-timed model 153.8 x projections + 1.5 ms a call, 57-108x the kernels); so is a fit resting on one cell;
each with one line naming the cell.

On another architecture the kernels' coefficients are those of the data's, scaled by the published efficiencies of
each kernel family on both (gpus.ATTENTION: FlashAttention-2 and the memory-efficient kernel are sm80 kernels, 32% of
an H100's peak against 50% of an A100's); c, d and the unfused kernels' carried over as they are (assumed).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..attention import backends
from ..env import configs
from ..spec import InputError
from .physics import CEILING
from .roofline import Device, call_features, nnls, roof_ms

MIN_WARMUP, MIN_REPEATS = 1, 3
CELL_KEYS = ("run_id", "cell_id")


def kernel_ms(row: dict) -> float | None:
    """A stored CUDA row's kernel time: time_ms where it is CUPTI's (time_source "cupti"), else the probe pass's
    gpu_time_ms, else None (an event-timed row: the host's time on a host-bound forward)."""
    if row.get("time_source") == "cupti":
        return float(row["time_ms"])
    g = row.get("gpu_time_ms")
    return float(g) if g is not None and g == g else None


def cell_name(row: dict) -> str:
    return (f"{row['model']} {int(row['width'])}x{int(row['height'])} {row['backend']} (run {row['run_id']}, cell "
            f"{row['cell_id']})")


def admit(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows of the cells the time model may fit on, and one line per cell refused: a warm-up below MIN_WARMUP, fewer
    than MIN_REPEATS repeats, a call without kernel time, a status other than ok."""
    kept, refused = [], []
    for _, cell in rows.groupby(list(CELL_KEYS), sort=False):
        first = cell.iloc[0].to_dict()
        warmup, repeats = first.get("warmup"), first.get("repeats")
        why = []
        if not _count(warmup) >= MIN_WARMUP:
            why.append(f"warm-up {_n(warmup)} (at least {MIN_WARMUP})")
        if not _count(repeats) >= MIN_REPEATS:
            why.append(f"{_n(repeats)} repeats (at least {MIN_REPEATS})")
        if any(kernel_ms(r) is None for r in cell.to_dict("records")):
            why.append("calls without kernel time (event-timed: the host's time on a host-bound forward)")
        if str(first.get("status", "ok")) != "ok":
            why.append(f"status {first['status']}")
        if why:
            refused.append(f"refused {cell_name(first)}: {', '.join(why)}")
        else:
            kept.append(cell)
    return (pd.concat(kept) if kept else rows.iloc[0:0]), refused


def _count(value) -> float:
    """A count as stored (NaN or absent: -1, below every minimum)."""
    return float(value) if value is not None and value == value else -1.0


def _n(value) -> str:
    return str(int(value)) if _count(value) >= 0 else "not recorded"


def kept_rows(arch: str | None = None) -> pd.DataFrame:
    """The kernel times kept with the project (configs/kernels/*.csv), of one architecture where given."""
    files = sorted((configs() / "kernels").glob("*.csv"))
    rows = pd.concat([pd.read_csv(f, dtype={"cell_id": str, "run_id": str}) for f in files]) if files else \
        pd.DataFrame(columns=["arch"])
    rows = rows.assign(upcast=rows.get("upcast", pd.Series(dtype=str)).fillna(""),
                       sdpa_kernel=rows.get("sdpa_kernel", pd.Series(dtype=str)).fillna(""))
    return rows[rows["arch"] == arch] if arch else rows


def samples(rows: pd.DataFrame, device: Device) -> list[dict]:
    """One sample per call of admitted rows: its features on the device (a GPU's published figures), its kernel, its
    kernel time, its cell and its floor (the roofline bound)."""
    from .forward import walk

    out = []
    for (model, w, h, batch, dtype, settings), cell_rows in rows.groupby(
            ["model", "width", "height", "batch", "dtype", "settings"], sort=False):
        calls = walk(model, int(w), int(h), int(batch), dtype, tuple(sorted(json.loads(settings or "{}").items())))
        for cell_id, cell in cell_rows.groupby(list(CELL_KEYS), sort=False):
            for r in cell.sort_values("call_index").to_dict("records"):
                ops = calls["calls"][int(r["call_index"])]
                options = json.loads(r.get("backend_options") or "{}")
                f = call_features(r, r["backend"], options, dtype, roof_ms(ops, device), device)
                out.append({**f, "kernel": backends.call_kernel(r["backend"], r), "kernel_ms": kernel_ms(r),
                            "model": model, "backend": r["backend"], "cell": cell_name(r), "floor_ms": f["roofline_ms"],
                            "ops": len(ops)})
    return out


def _design(s: list[dict], kernels: list[str]) -> np.ndarray:
    cols = []
    for k in kernels:
        mine = np.array([x["kernel"] == k for x in s], float)
        cols += [mine * [x["core_self"] for x in s], mine * [x["core_cross"] for x in s]]
    cols += [np.array([x["projections"] for x in s], float), np.ones(len(s))]
    return np.stack(cols, 1)


def fit(s: list[dict]) -> dict:
    """The kernel model fitted to samples (module docstring), every core's coefficient at least 1 / CEILING (no
    attention kernel above 90% of its roofline); the projections' left free (the H200's come out at 0.36: 2.8 times
    the bandwidth, their small tensors staying in its L2; as a share of a GPU's peaks they are capped where used,
    planner/published.kernel_shares): {"kernels": {kernel: {"core_self", "core_cross"}},
    "projections", "overhead", "cells", "calls", "cells_of": {kernel: n}}. A fit resting on one cell: InputError, one
    line naming it."""
    cells = sorted({x["cell"] for x in s})
    if len(cells) < 2:
        raise InputError(f"the time model on kernel time refuses a fit resting on one cell: "
                         f"{cells[0] if cells else 'no admitted cell'}")
    kernels = sorted({x["kernel"] for x in s})
    x, y = _design(s, kernels), np.array([x["kernel_ms"] for x in s], float)
    low = np.r_[np.full(x.shape[1] - 2, 1 / CEILING), 0.0, 0.0]  # a core's share at most CEILING
    coef = low + nnls(x, y - x @ low)
    return {"kernels": {k: {"core_self": float(coef[2 * i]), "core_cross": float(coef[2 * i + 1])}
                        for i, k in enumerate(kernels)},
            "projections": float(coef[-2]), "overhead": float(coef[-1]), "cells": len(cells), "calls": len(s),
            "ops_per_call": float(np.mean([x["ops"] for x in s])),
            "cells_of": {k: len({x["cell"] for x in s if x["kernel"] == k}) for k in kernels}}


def coefficients(fitted: dict, kernel: str) -> dict | None:
    """The fit's coefficients for one kernel's calls, as timing.apply takes them; None for a kernel without data."""
    k = fitted["kernels"].get(kernel)
    if k is None:
        return None
    return {"coefficients": {**k, "projections": fitted["projections"], "overhead": fitted["overhead"]},
            "cells": fitted["cells_of"][kernel]}


def predicted(fitted: dict, s: list[dict]) -> np.ndarray:
    """Each sample's predicted kernel time (never below its floor)."""
    from .timing import apply

    return np.array([apply(coefficients(fitted, x["kernel"]), x, x["floor_ms"]) for x in s])


def cross_model(s: list[dict]) -> list[dict]:
    """Each model's calls predicted from a fit to the others' (sd15 <-> sdxl), summed per backend:
    [{"backend", "model", "from", "predicted_ms", "kernel_ms", "ratio"}]."""
    out = []
    for model in sorted({x["model"] for x in s}):
        mine, others = [x for x in s if x["model"] == model], [x for x in s if x["model"] != model]
        fitted = fit(others)
        p = predicted(fitted, mine)
        for backend in sorted({x["backend"] for x in mine}):
            idx = [i for i, x in enumerate(mine) if x["backend"] == backend]
            if mine[idx[0]]["kernel"] not in fitted["kernels"]:
                continue
            got, want = float(p[idx].sum()), float(sum(mine[i]["kernel_ms"] for i in idx))
            out.append({"backend": backend, "model": model, "from": ", ".join(sorted({x["model"] for x in others})),
                        "predicted_ms": got, "kernel_ms": want, "ratio": got / want})
    return out


def stored_rows(results: Path, arch: str | None = None, key: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """The block rows of the CUDA runs under results made on a GPU of this architecture (or of this limits key),
    each with its cell's warm-up and repeats (the cell row's, else the run's sweep settings), status and GPU; and a
    line per run passed over."""
    from .. import gpus
    from ..store import Unreadable, kind_of, readable_runs

    found, passed = [], []
    for run, m in readable_runs(Path(results)):
        env = m.get("environment") or {}
        if not str(env.get("device", "")).startswith("cuda") or not kind_of(m).calibrates or \
                (arch and gpus.arch_of(env) != arch) or (key and (m.get("device_limits") or {}).get("key") != key):
            continue
        try:
            cells, blocks = run.read()
        except Unreadable as e:
            passed.append(f"passed over run {run.id}: unreadable: {e}")
            continue
        sweep = m.get("sweep") or {}
        keep = [c for c in ("cell_id", "status", "warmup", "repeats") if c in cells]
        merged = blocks.merge(cells[keep], on="cell_id", how="left", suffixes=("", "_cell"))
        for what in ("warmup", "repeats"):
            if what not in merged:
                merged[what] = sweep.get(what)
        merged["status"] = merged.get("status_cell", merged.get("status"))
        found.append(merged.assign(run_id=run.id, gpu=env.get("device_name"), arch=gpus.arch_of(env)))
    return (pd.concat(found, ignore_index=True) if found else pd.DataFrame()), passed


FITS_FILE = "kernel-fits.json"
MODEL_VERSION = 6  # the cache's key changes with the model's features (bump it where the features change)


def model_key() -> list:
    """What a cached fit depends on beyond its data: the model's version and the tables it reads, by their content
    (gpus.digest: an edit to the GPU table, its efficiencies or its attention shares is a new key)."""
    from .. import gpus

    return [MODEL_VERSION, gpus.digest()]


def arch_fit(arch: str, dtype: str, results: Path | None = None) -> dict:
    """The kernel model of one architecture in one dtype (a dtype with no data of its own, bfloat16 or float32,
    taking float16's kernels: its efficiencies against float16's peak carried to the dtype's, assumed and said),
    fitted to its data kept with the project and its CUDA runs under results, each call's features on the published
    figures of the GPU that ran it: {"fit" (None where nothing is admitted or the fit rests on one cell), "refused":
    [lines], "data": what it was fitted on, "dtype": the dtype of that data}. Cached by its data
    (cache_dir()/kernel-fits.json); the fit of the data kept with the project alone (no results) once a process."""
    key = (arch, dtype, *model_key())
    if not results and key in _KEPT_FITS:
        return _KEPT_FITS[key]
    out = _arch_fit(arch, dtype, results)
    if not results:
        _KEPT_FITS[key] = out
    return out


_KEPT_FITS: dict = {}  # arch_fit of the kept data by arch, dtype and model_key: its files do not change under a process


def _arch_fit(arch: str, dtype: str, results: Path | None) -> dict:
    from .. import gpus
    from ..env import cache_dir
    from ..store import add_to_cache, read_cache

    rows = kept_rows(arch)
    stored, passed = stored_rows(results, arch) if results and Path(results).is_dir() else (pd.DataFrame(), [])
    rows = pd.concat([rows, stored], ignore_index=True) if len(stored) else rows
    of_dtype, used = (rows[rows["dtype"] == dtype] if len(rows) else rows), dtype
    if not len(of_dtype) and dtype != "float16" and len(rows):
        of_dtype, used = rows[rows["dtype"] == "float16"], "float16"
    key = json.dumps([*model_key(), arch, dtype, used, _fingerprint(of_dtype)])
    path = cache_dir() / FITS_FILE
    if key in read_cache(path):
        return read_cache(path)[key]
    admitted_rows, refused = admit(of_dtype) if len(of_dtype) else (of_dtype, [])
    s = []
    for name, mine in admitted_rows.groupby("gpu") if len(admitted_rows) else []:
        gpu = gpus.named_in(name)
        if gpu is None:
            refused.append(f"passed over the calls of {name}: not a GPU of the table (attnprof gpus)")
            continue
        s += samples(mine, Device(gpu["tflops"][used] * 1e12, gpu["bytes_per_s"]))
    try:
        fitted = fit(s) if s else None
    except InputError as e:
        fitted, refused = None, refused + [str(e)]
    data = ", ".join(f"{n} ({len(g.groupby(list(CELL_KEYS)))} cells)" for n, g in admitted_rows.groupby("gpu")) \
        if len(admitted_rows) else "none"
    out = {"fit": fitted, "refused": passed + refused, "data": data, "dtype": used}
    add_to_cache(path, key, out)
    return out


def _fingerprint(rows: pd.DataFrame) -> list:
    """What a fit's data is: its cells and their kernel times summed (a changed or added run changes it)."""
    if not len(rows):
        return []
    t = rows.assign(k=[kernel_ms(r) or 0.0 for r in rows.to_dict("records")])
    return sorted([str(a), str(b), round(float(g["k"].sum()), 9), len(g)] for (a, b), g in t.groupby(list(CELL_KEYS)))


DATA_ARCH = "sm90"  # the architecture of the kernel data kept with the project


def gpu_kernels(gpu: dict, dtype: str, results: Path | None = None) -> dict | None:
    """The kernel coefficients for a GPU of the table, for timing.predict: its architecture's fit, else DATA_ARCH's
    carried over by the published efficiencies (gpus.attention_scale); {"kernels": {kernel: coefficients}, "source",
    "refused", "overhead"}; None where no fit is admitted."""
    from .. import gpus

    arch = gpu["arch"]
    found = arch_fit(arch, dtype, results)
    base = found if found["fit"] else arch_fit(DATA_ARCH, dtype, None)
    if not base["fit"]:
        return None
    data_arch = arch if found["fit"] else DATA_ARCH
    out, why = {}, {}
    for k in base["fit"]["kernels"]:
        c = coefficients(base["fit"], k)
        scale, how = gpus.attention_scale(k, data_arch, arch)
        c["coefficients"].update(core_self=c["coefficients"]["core_self"] * scale,
                                 core_cross=c["coefficients"]["core_cross"] * scale)
        out[k] = {**c, "scaled": how}
        why.setdefault((round(scale, 3), how), []).append(k)
    carried = "; ".join(f"{', '.join(ks)} x{scale:.2f}: {how}" for (scale, how), ks in why.items())
    dtype_note = "" if base["dtype"] == dtype else (f"{dtype} calls at the efficiencies of {base['dtype']}'s kernel "
                                                    f"times against its peak (assumed: no {dtype} kernel times)")
    source = (f"kernel times fitted on {base['data']}, {base['fit']['calls']} calls" +
              ("" if data_arch == arch else f", carried from {data_arch} to {arch} ({carried})") +
              (f"; {dtype_note}" if dtype_note else ""))
    refused = found["refused"] + ([] if found is base else base["refused"])
    return {"kernels": out, "source": source, "refused": refused, "overhead": base["fit"]["overhead"],
            "data": f"{base['data']}, {base['fit']['calls']} calls", "data_arch": data_arch, "dtype_note": dtype_note,
            "op_ms": base["fit"]["overhead"] / base["fit"]["ops_per_call"], "projections": base["fit"]["projections"]}
