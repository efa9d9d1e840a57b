"""Time before you measure: each attention call's time, and the whole forward's, on a device, from the roofline and
the device's own stored runs.

What a call costs (ms), from four features on the device's limits (peak FLOP/s P of the dtype, bandwidth B):
    compute   = the call's attention FLOPs / P              (QK^T and PV: the row's `flops`)
    memory    = the backend's bytes moved / B               (memory.bytes_moved: score-table passes, chunks)
    projections = the sum over the call's own other ops (to_q, to_k, to_v, to_out, layouts) of max(FLOPs / P,
                bytes / B): a call's measured time includes its projections (the recorder times the processor)
    1         = a per-call overhead (launches, dispatch)
The roofline bound is core + projections, core = max(compute, memory): a lower bound, every kernel at the peak and
no overhead. Calibrated, time = a.core (a per shape class: self or cross attention) + c.projections + d, the
coefficients >= 0 fitted by least squares to every ok call of the device's stored runs, per (device, backend with
its options, dtype): 1/a is the backend's efficiency against the roofline there. (Fitting compute and memory apart
was tried and dropped: for one backend both grow as tokens squared, so their split is noise, and on a loaded
machine the fit gave it to whichever term the noise favoured.) The rest of the
forward (convolutions, norms, the feed-forwards, every op outside attention calls) costs e.rest + f.ops, rest the sum
of max(FLOPs / P, bytes / B) over its ops and ops their number (per-op dispatch), fitted per (device, dtype) to the
cells' forward_time_ms - attention_time_ms. A prediction is never below the roofline bound.

The ops come from one forward on fake tensors (planner/forward.py's trace, the very forward of a sweep's preflight or
of a plan, so that a shape is traced once): every aten op is counted with its
FLOPs (torch.utils.flop_counter's formulas: matmuls and convolutions) and the bytes of its tensor inputs and outputs
(views move nothing); inside an attention call the attention itself is left out (it is modelled per backend above),
so the call's ops are its projections. The device is the measured one (its limits in each run's manifest, keyed as
measure/limits.py keys them), or a GPU you do not have from the GPU table (profiler/gpus.py), whose published
figures give the roofline bound only. The fit, its leave-one-out error and residuals go to time-calibration.json
beside the device limits' cache, keyed like it.
"""
from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from .. import backends
from ..env import cache_dir
from ..spec import InputError, parse_dtype
from .forward import walk
from .memory import bytes_moved

CALIBRATION_FILE = "time-calibration.json"
CALL_FEATURES = ("core_self", "core_cross", "projections", "overhead")
REST_FEATURES = ("rest", "ops")
def roof_ms(ops: np.ndarray, peak_flops: float, peak_bytes_per_s: float) -> float:
    """The ops one after another, each at the roofline's bound."""
    return float(np.maximum(ops[:, 0] / peak_flops, ops[:, 1] / peak_bytes_per_s).sum() * 1e3)


def call_features(row: dict, backend: str, options: dict, dtype: str, projections_ms: float, peak_flops: float,
                  peak_bytes_per_s: float) -> dict:
    """A call's features in ms (module docstring), and its roofline bound."""
    compute = row["flops"] / peak_flops * 1e3
    memory = bytes_moved(backend, row, dtype, **options) / peak_bytes_per_s * 1e3
    core, self_ = max(compute, memory), row["kind"] == "self"
    return {"core_self": core * self_, "core_cross": core * (not self_), "projections": projections_ms,
            "overhead": 1.0, "roofline_ms": core + projections_ms}


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the unconstrained fits on each subset of the columns
    whose coefficients all come out >= 0 (a handful of columns here, so every subset is tried)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y ** 2))
    used = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    for k in range(1, len(used) + 1):
        for cols in itertools.combinations(used, k):
            coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if np.all(coef >= 0):
                err = float(np.sum((x[:, cols] @ coef - y) ** 2))
                if err < best_err - 1e-12 * max(best_err, 1e-30):
                    best, best_err = np.zeros(x.shape[1]), err
                    best[list(cols)] = coef
    return best


def fit_model(samples: list[dict], features: tuple, target: str) -> dict:
    """Coefficients (>= 0) of target on the features over the samples, and the leave-one-out error: each cell's
    samples predicted from a fit to the other cells' (each at least its roofline bound, floor_ms), their sum against
    the cell's measured sum."""
    x = np.array([[s[f] for f in features] for s in samples], float).reshape(-1, len(features))
    y = np.array([s[target] for s in samples], float)
    floor = np.array([s.get("floor_ms", 0.0) for s in samples], float)
    cells = list(dict.fromkeys(s["cell_id"] for s in samples))
    loo = []
    for cell in cells if len(cells) > 1 else []:
        inside = np.array([s["cell_id"] == cell for s in samples])
        c = nnls(x[~inside], y[~inside])
        loo.append({"cell_id": cell, "measured_ms": float(y[inside].sum()),
                    "predicted_ms": float(np.maximum(x[inside] @ c, floor[inside]).sum())})
    return {"coefficients": dict(zip(features, map(float, nnls(x, y)))), "samples": len(samples),
            "cells": len(cells), "loo": loo, "loo_error_pct": mean_error(loo)}


def mean_error(pairs: list[dict]) -> float | None:
    """The mean of |predicted - measured| / measured, in percent."""
    if not pairs:
        return None
    return float(100 * np.mean([abs(e["predicted_ms"] - e["measured_ms"]) / e["measured_ms"] for e in pairs]))


def apply(fitted: dict | None, features: dict, floor: float) -> float:
    if not fitted:
        return floor
    return max(floor, sum(v * features[f] for f, v in fitted["coefficients"].items()))


def group_key(backend: str, options, dtype: str) -> str:
    return f"{backends.label(backend, options)} {dtype}"


def _settings(cell: dict) -> tuple:
    return tuple(sorted(json.loads(cell["settings"]).items()))


def samples(results: Path, key: str, passed: dict | None = None) -> tuple[list[dict], list[dict], dict, list[str]]:
    """From every ok cell of the runs under results measured on the device of this limits key: (one sample per
    attention call, one per cell, the device's limits from the latest such run's manifest, the run ids). A run of a
    kind the time model is not fitted on (store.RUN_KINDS: a replay, a recorded generation) is passed over, and
    named in `passed` (run id -> its kind)."""
    from ..store import Run, kind_of, list_runs

    calls, cells, limits, runs = [], [], {}, []
    for path in list_runs(Path(results)):
        run = Run.open(path)
        manifest = run.manifest()
        if not kind_of(manifest).calibrates:
            if passed is not None:
                passed[run.id] = kind_of(manifest).name
            continue
        if (manifest.get("device_limits") or {}).get("key") != key or not manifest.get("device_peak_bytes_per_s"):
            continue
        table, blocks = run.read()
        ok = table[table["status"] == "ok"] if len(table) else table
        limits = {k: manifest[k] for k in ("device_peak_flops", "device_peak_bytes_per_s", "device_limits")}
        runs.append(run.id)
        for cell in ok.to_dict("records"):
            if cell["backend"] not in backends.BACKENDS or not cell.get("attention_time_ms") == \
                    cell.get("attention_time_ms"):  # a plugin's backend not loaded here; no attention time (fused)
                continue
            rows = blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index").to_dict("records")
            try:
                c, r = _cell_samples(cell, rows, manifest)
            except InputError:  # its model no longer resolves here (a file moved, a hub id not cached)
                continue
            calls += [{**s, "run": run.id} for s in c]
            cells.append({**r, "run": run.id})
    return calls, cells, limits, runs


def _cell_samples(cell: dict, rows: list[dict], manifest: dict) -> tuple[list[dict], dict]:
    peaks = manifest["device_peak_flops"][cell["dtype"]], manifest["device_peak_bytes_per_s"]
    w = walk(cell["model"], int(cell["width"]), int(cell["height"]), int(cell["batch"]), cell["dtype"],
             _settings(cell))
    group, options = group_key(cell["backend"], cell["backend_options"], cell["dtype"]), \
        json.loads(cell["backend_options"] or "{}")
    calls = []
    for row in rows:
        f = call_features(row, cell["backend"], options, cell["dtype"], roof_ms(w["calls"][row["call_index"]], *peaks),
                          *peaks)
        calls.append({**f, "floor_ms": f["roofline_ms"], "time_ms": row["time_ms"], "cell_id": cell["cell_id"],
                      "group": group})
    rest = roof_ms(w["rest"], *peaks)
    return calls, {"rest": rest, "ops": float(len(w["rest"])), "floor_ms": rest, "cell_id": cell["cell_id"],
                   "group": group, "dtype": cell["dtype"],
                   "rest_ms": cell["forward_time_ms"] - cell["attention_time_ms"],
                   "attention_time_ms": cell["attention_time_ms"], "forward_time_ms": cell["forward_time_ms"]}


def calibrate(results: Path, key: str, write: bool = True) -> dict | None:
    """The time model of the device of this limits key, fitted to its stored runs under results (None where it has
    none): {"key", "runs", "limits", "backends": {group: fit}, "rest": {dtype: fit}}, each backend's fit with its
    leave-one-out error of the forward too. Written to the calibration file under the key."""
    passed: dict[str, str] = {}
    calls, cells, limits, runs = samples(results, key, passed)
    if not cells:
        return None
    out = {"key": key, "results": str(results), "runs": runs, "limits": limits, "backends": {}, "rest": {},
           "passed_over": passed}
    for dtype in sorted({c["dtype"] for c in cells}):
        out["rest"][dtype] = fit_model([c for c in cells if c["dtype"] == dtype], REST_FEATURES, "rest_ms")
    for group in sorted({c["group"] for c in calls}):
        fitted = fit_model([c for c in calls if c["group"] == group], CALL_FEATURES, "time_ms")
        fitted["loo_forward"] = _forward_loo(fitted, cells, out["rest"])
        fitted["loo_forward_error_pct"] = mean_error(fitted["loo_forward"])
        fitted["runs"] = len({c["run"] for c in calls if c["group"] == group})
        out["backends"][group] = fitted
    if write:
        from ..store import add_to_cache

        add_to_cache(calibration_path(), key, out)
    return out


def _forward_loo(fitted: dict, cells: list[dict], rest: dict) -> list[dict]:
    """Each cell's forward left out: its calls' and its rest's predictions from fits to the other cells."""
    by_cell = {c["cell_id"]: c for c in cells}
    out = []
    for e in fitted["loo"]:
        cell = by_cell[e["cell_id"]]
        rest_e = next((r for r in rest[cell["dtype"]]["loo"] if r["cell_id"] == e["cell_id"]), None)
        if rest_e:
            out.append({"cell_id": e["cell_id"], "measured_ms": cell["forward_time_ms"],
                        "predicted_ms": e["predicted_ms"] + rest_e["predicted_ms"]})
    return out


def calibration_path() -> Path:
    return cache_dir() / CALIBRATION_FILE


def source_text(fitted: dict | None, gpu: dict | None = None, device: str | None = None) -> str:
    if gpu is not None and not fitted:
        return f"roofline bound on the {gpu['name']}'s published figures: a lower bound, not a measurement"
    if gpu is not None:
        return (f"the {gpu['name']}'s published figures, calibrated on {fitted['cells']} cells in {fitted['runs']} "
                f"runs of a {device} ({gpu['arch']}, the same architecture): an estimate, not a measurement")
    if not fitted:
        return ("roofline bound on this device's measured limits (no stored runs of this device and backend to "
                "calibrate on)")
    loo = fitted["loo_error_pct"]
    fwd = fitted.get("loo_forward_error_pct")
    err = "no leave-one-out error (one cell)" if loo is None else \
        f"leave-one-out error {loo:.1f}% (attention)" + (f", {fwd:.1f}% (forward)" if fwd is not None else "")
    return f"calibrated on {fitted['cells']} cells in {fitted['runs']} runs of this device, {err}"


def passed_text(passed: dict | None) -> str:
    """'; passed over 2 runs (record, replay: not cells of named models timed by the harness)', or ''."""
    if not passed:
        return ""
    kinds = ", ".join(sorted(set(passed.values())))
    return f"; passed over {len(passed)} run{'s' if len(passed) > 1 else ''} ({kinds}: not cells of named models " \
           "timed by the harness)"


def _sdpa_kernels(blocks: list[dict], backend: str, dtype: str, device: str, gpu: dict | None) -> None:
    """The SDPA kernel of each call where the plan has none (a meta-device plan): bytes_moved differs for math."""
    from .. import devices

    if not backends.uses_sdpa(backend) or all(r.get("sdpa_kernel") for r in blocks):
        return
    target = devices.gpu_target(gpu["arch"]) if gpu else None
    where = "cuda" if gpu else device
    for r in blocks:
        r.setdefault("sdpa_kernel", devices.sdpa_choice(dtype, r["head_dim"], r["tokens_k"], where, target))


def predict(p: dict, backend: str, options: dict, limits: dict, calibration: dict | None = None,
            gpu: dict | None = None, device: str = "cuda") -> dict:
    """Each call's predicted_time_ms and roofline_time_ms added to the plan's blocks (in place), and the totals:
    predicted_attention_time_ms, predicted_rest_time_ms, predicted_forward_time_ms, their roofline bounds, the
    source."""
    dtype = p["dtype"]
    _sdpa_kernels(p["blocks"], backend, dtype, device, gpu)
    peaks = limits["device_peak_flops"][dtype], limits["device_peak_bytes_per_s"]
    w = walk(p["model"], p["width"], p["height"], p["batch"], dtype, tuple(sorted((p.get("settings") or {}).items())))
    if [r["block"] for r in p["blocks"]] != w["blocks"]:
        raise RuntimeError("the walk's attention calls differ from the plan's")  # the same forward: a bug if so
    fitted = (calibration or {}).get("backends", {}).get(group_key(backend, options, dtype))
    rest_fit = (calibration or {}).get("rest", {}).get(dtype) if fitted else None
    for row, ops in zip(p["blocks"], w["calls"]):
        f = call_features(row, backend, options, dtype, roof_ms(ops, *peaks), *peaks)
        row.update(roofline_time_ms=f["roofline_ms"], predicted_time_ms=apply(fitted, f, f["roofline_ms"]))
    rest_roof = roof_ms(w["rest"], *peaks)
    rest = apply(rest_fit, {"rest": rest_roof, "ops": float(len(w["rest"]))}, rest_roof)
    attention = sum(r["predicted_time_ms"] for r in p["blocks"])
    roof = sum(r["roofline_time_ms"] for r in p["blocks"])
    times = {"predicted_attention_time_ms": attention, "predicted_rest_time_ms": rest,
             "predicted_forward_time_ms": attention + rest, "roofline_attention_time_ms": roof,
             "roofline_forward_time_ms": roof + rest_roof, "time_backend": backends.label(backend, options),
             "time_source": source_text(fitted, gpu, (calibration or {}).get("device")) +
             passed_text((calibration or {}).get("passed_over")),
             "time_calibrated": bool(fitted),
             "time_limits": {"peak_flops_per_s": peaks[0], "peak_bytes_per_s": peaks[1],
                             "key": limits.get("device_limits", {}).get("key")}}
    p["totals"].update(times)
    return times


def target(device: str, dtype: str, gpu_name: str | None = None, results: str | None = None) -> tuple | None:
    """(limits, calibration, gpu) of the device to predict for: the GPU table's gpu_name (its published figures,
    calibrated on the runs under results made on a GPU of its architecture, where there are any), or this machine's
    device (its measured limits, calibrated on the stored runs under results made on it); None for
    CUDA on a machine without a GPU and no gpu_name."""
    from .. import gpus
    from ..measure.limits import device_key, device_limits

    if gpu_name:
        gpu = gpus.get(gpu_name)
        return gpus.limits(gpu, dtype), (same_arch(Path(results), gpu, dtype) if results else None), gpu
    if device == "cuda" and not torch.cuda.is_available():
        return None
    calibration = calibrate(Path(results), device_key(device)) if results else None
    if calibration and dtype in calibration["limits"]["device_peak_flops"]:
        return calibration["limits"], calibration, None
    return device_limits(device, [dtype]), calibration, None


def same_arch(results: Path, gpu: dict, dtype: str) -> dict | None:
    """The time model fitted to the stored runs under results made on a GPU of the same architecture as gpu (a table
    row), for applying to its published figures: each backend's efficiencies against the roofline and its per-call
    overhead carried over. Of several such devices, the one with the most cells of this dtype. None where there is
    none. The result's "device" names the GPU the runs were made on."""
    from .. import gpus
    from ..store import Run, list_runs

    found = {}
    for path in list_runs(results) if results.is_dir() else []:
        manifest = Run.open(path).manifest()
        key = (manifest.get("device_limits") or {}).get("key")
        env = manifest.get("environment") or {}
        if key and str(env.get("device", "")).startswith("cuda") and gpus.arch_of(env) == gpu["arch"]:
            found.setdefault(key, env.get("device_name") or key)
    fits = [{**c, "device": name} for key, name in found.items()
            if (c := calibrate(results, key, write=False)) and dtype in c["rest"]]
    return max(fits, key=lambda c: c["rest"][dtype]["cells"], default=None)


def format_times(t: dict) -> list[tuple[str, str]]:
    """The plan's time lines (facts) from its totals."""
    if "predicted_forward_time_ms" not in t:
        return []
    what = "calibrated" if t["time_calibrated"] else "roofline bound"
    return [("predicted time", f"{t['time_backend']} ({what}): attention {t['predicted_attention_time_ms']:.3g} ms + "
                               f"the rest of the forward {t['predicted_rest_time_ms']:.3g} ms = forward "
                               f"{t['predicted_forward_time_ms']:.3g} ms"),
            ("time from", t["time_source"])] + ([("GPU figures", t["gpu_figures"])] if t.get("gpu_figures") else [])


def walked_plan(model: str, width: int, height: int, batch: int, dtype: str, settings: tuple = ()) -> dict:
    """A plan for predict() made of the walk's calls (no forward of its own where the shape was traced already);
    its rows are its own, for predict() to write its times into."""
    rows = walk(model, width, height, batch, dtype, settings)["rows"]
    return {"model": model, "width": width, "height": height, "batch": batch, "dtype": parse_dtype(dtype),
            "settings": dict(settings), "totals": {}, "blocks": copy.deepcopy(rows)}


def predict_cells(cells: list, limits: dict, results: Path) -> dict[str, dict]:
    """Per cell of a sweep, before it runs: its predicted forward and attention time and each call's, on the device
    whose limits the sweep measured, calibrated on the runs under results made on it."""
    calibration = calibrate(Path(results), limits["device_limits"]["key"]) if Path(results).is_dir() else None
    out = {}
    for c in cells:  # the calls of one shape are every backend's: one walk per shape (the preflight's trace made it)
        eager = tuple(s for s in c.settings if s[0] != "compile")  # a compiled U-Net predicted as eager
        p = walked_plan(c.model, c.width, c.height, c.batch, c.dtype, eager)
        t = predict(p, c.backend, c.options, limits, calibration, device=c.device.split(":")[0])
        out[c.cell_id] = {"predicted_forward_time_ms": t["predicted_forward_time_ms"],
                          "predicted_attention_time_ms": t["predicted_attention_time_ms"],
                          "time_source": f"{t['time_backend']}: {t['time_source']}",
                          "predicted_call_times_ms": [r["predicted_time_ms"] for r in p["blocks"]]}
    return out


def sweep_text(predicted: dict[str, dict], forwards_per_cell: int) -> str:
    """The line a sweep prints before its first cell."""
    if not predicted:
        return "predicted: no cell to run"
    total = sum(v["predicted_forward_time_ms"] for v in predicted.values()) * forwards_per_cell / 1e3
    sources = sorted({v["time_source"] for v in predicted.values()})
    return (f"predicted: {len(predicted)} cells, {total:.1f} s of forwards ({forwards_per_cell} a cell: warm-up, timed "
            f"and probe; model builds and references not counted), from {'; '.join(sources)}")


def attach(cell: dict, blocks: list[dict], extra: dict) -> dict:
    """A measured cell's prediction onto its rows: each call's predicted_time_ms and predicted_time_ratio (measured
    over predicted), the cell's attention and forward ratios. Returns the cell's extra (execute/groups.py) less the
    per-call list, for the cell row."""
    extra = dict(extra)
    calls = extra.pop("predicted_call_times_ms", None)
    if cell.get("status") != "ok" or calls is None or len(calls) != len(blocks):
        return extra
    for row, t in zip(blocks, calls):
        row.update(predicted_time_ms=t, predicted_time_ratio=row["time_ms"] / t if t else None)
    for what in ("forward", "attention"):
        t = extra.get(f"predicted_{what}_time_ms")
        extra[f"{what}_time_ratio"] = cell[f"{what}_time_ms"] / t if t else None
    return extra


def format_versus(cells) -> str | None:
    """The end of a run: predicted against measured, over its ok cells that carry a prediction."""
    if "predicted_forward_time_ms" not in cells or "forward_time_ms" not in cells:
        return None
    ok = cells[(cells["status"] == "ok") & cells["predicted_forward_time_ms"].notna()]
    if not len(ok):
        return None
    lines = ["predicted against measured (ms per forward; ratio = measured / predicted):"]
    for r in ok.to_dict("records"):
        att, fwd = r["predicted_attention_time_ms"], r["predicted_forward_time_ms"]
        lines.append(f"  {r['backend']:10s} {r['width']}x{r['height']}: attention {att:.4g}"
                     f" vs {r['attention_time_ms']:.4g} ({r['attention_time_ms'] / att:.2f}x),"
                     f" forward {fwd:.4g} vs {r['forward_time_ms']:.4g} ({r['forward_time_ms'] / fwd:.2f}x)")
    return "\n".join(lines)


def by_size(model: str, sizes: list[tuple[int, int]], names: list[str], dtype: str, batch: int,
            gpu_name: str) -> list[dict]:
    """Each backend's roofline-bound attention and forward time per size on a GPU of the table (the dashboard's
    Planner page): one row per (backend, size)."""
    from .. import gpus

    gpu = gpus.get(gpu_name)
    limits = gpus.limits(gpu, parse_dtype(dtype))
    rows = []
    for w, h in sizes:
        for name in names:
            t = predict(walked_plan(model, w, h, batch, dtype), name, {}, limits, gpu=gpu)
            rows.append({"backend": name, "size": f"{w}x{h}", "pixels": w * h, "gpu": gpu["name"],
                         "attention_ms": t["predicted_attention_time_ms"], "forward_ms": t["predicted_forward_time_ms"],
                         "source": t["time_source"]})
    return rows
