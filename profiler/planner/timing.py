"""Time before you measure: each attention call's time, the whole forward's, and (planner/generation.py) a whole
generation's, on a device, from the roofline and the device's own stored runs.

The device (Device, from measure/limits.py's figures or the GPU table's): the dense matmul peak P of the dtype, the
memory bandwidth B, and where measured the last-level cache (its size and bandwidth B_c: a working set of at most
half the cache moves at B_c), what new pages cost where the allocator maps every buffer of at least fresh_min_bytes
anew, each page a fault (B_new: a CPU whose memory is not kept, devices.keep_memory), softmax's rate S (elements
per second) and the score GEMMs' rate G (score elements per second through QK^T and PV at a small head dim, where a
score costs the GEMMs' loop, not their FLOPs nor their bytes). A GPU of the table has P and B only. What one op
costs at the device's limits (its roofline time, ms):
    max(FLOPs / P, bytes moved / B or B_c) + its new output's bytes / B_new where that output gets new pages.
What one attention call costs, four features in ms:
    core     = max(FLOPs / P, score elements / G where the backend writes score tables (memory.writes_tables),
                   the backend's bytes moved / B or B_c by its working set) + score elements / S
               (memory.bytes_moved, working_set: the backend's own traffic, tables and chunks),
               split by the call's shape class: core_self, core_cross
    projections = the sum over the call's own other ops (to_q, to_k, to_v, to_out, layouts) of their roofline time
    overhead = 1 (launches, dispatch)
and, not fitted, its score tables' new pages / B_new (memory.new_page_bytes: measured physics that the sizes calibrated
on may never reach; 64 MiB tables of sliced at 512x512 on a CPU whose allocator maps anew from 32 MiB; none where
the memory is kept). A recorded call's are the new pages it was counted to touch (faulted_bytes: its minor faults),
which glibc's moving thresholds give smaller tables too in some processes and not in others (sliced's 4 MiB tables
at 256x256: its attention 165 to 185 ms a forward in four pairs of recordings, 323 to 449 in four others).
Calibrated, a call takes a_self.core_self + a_cross.core_cross + c.projections + d + pages, the coefficients >= 0 fitted
by least squares to every measured call of the device's stored runs, per (device, backend with its options, dtype):
1/a is the backend's efficiency against the roofline there. The cache and page terms are the device's measured
physics, not fitted: a working set that outgrows the cache between the sizes calibrated on and the size asked moves
at B there (sliced's tables on a 32 MiB L3: in the cache at 256x256, out of it from 384x384). The rest of a forward
(every op outside attention calls) costs sum over op classes k (convolution, matmul, norm, other) of
e_k.roofline_k + f.ops, fitted per (device, dtype) to the measured forwards less their attention: the U-Net's of
every sweep cell, and each component's of every recorded generation (the U-Net, the VAE, the text encoders: their
different mixes of classes tell the classes apart). A prediction is never below the roofline bound.

The ops come from one forward on fake tensors (planner/forward.py's walk, the very forward of a sweep's preflight or
of a plan): every aten op is counted with its FLOPs (torch.utils.flop_counter's formulas), the bytes of its tensor
inputs and outputs, its new output and its class; inside an attention call the attention itself is left out (it is
modelled per backend above). The fit, its leave-one-out error and residuals go to time-calibration.json beside the
device limits' cache, keyed like it. A run whose own calibrations say the machine slowed while it ran is left out,
and named.
"""
from __future__ import annotations

import copy
import json

import numpy as np

from ..attention import backends
from ..fmt import duration
from ..spec import InputError, parse_dtype
from .forward import OP_CLASSES, walk
from .roofline import CALL_FEATURES, REST_FEATURES, Device, call_features, nnls, roof_ms  # noqa: F401 (the model's)

def fit_model(samples: list[dict], features: tuple, target: str, group: str = "cell_id") -> dict:
    """Coefficients (>= 0) of target on the features over the samples, and the leave-one-out error: each group's
    samples (a cell's, by default) predicted from a fit to the other groups' (each at least its roofline bound,
    floor_ms), their sum against the group's measured sum. "predicted" holds each sample's left-out prediction."""
    x = np.array([[s[f] for f in features] for s in samples], float).reshape(-1, len(features))
    fixed = np.array([s.get("fixed_ms", 0.0) for s in samples], float)
    y = np.array([s[target] for s in samples], float) - fixed
    w = np.sqrt(np.array([s.get("weight", 1.0) for s in samples], float))  # rows scaled: weighted least squares
    floor = np.array([s.get("floor_ms", 0.0) for s in samples], float)
    groups = list(dict.fromkeys(s[group] for s in samples))
    loo, predicted = [], np.full(len(samples), np.nan)
    for g in groups if len(groups) > 1 else []:
        inside = np.array([s[group] == g for s in samples])
        c = nnls(x[~inside] * w[~inside, None], y[~inside] * w[~inside])
        predicted[inside] = np.maximum(x[inside] @ c + fixed[inside], floor[inside])
        loo.append({"cell_id": g, "measured_ms": float((y + fixed)[inside].sum()),
                    "predicted_ms": float(predicted[inside].sum())})
    return {"coefficients": dict(zip(features, map(float, nnls(x * w[:, None], y * w)))), "samples": len(samples),
            "cells": len(groups), "loo": loo, "loo_error_pct": mean_error(loo), "predicted": predicted.tolist()}


def mean_error(pairs: list[dict]) -> float | None:
    """The mean of |predicted - measured| / measured, in percent."""
    if not pairs:
        return None
    return float(100 * np.mean([abs(e["predicted_ms"] - e["measured_ms"]) / e["measured_ms"] for e in pairs]))


def apply(fitted: dict | None, features: dict, floor: float) -> float:
    """The fit's prediction from the features (plus their fixed_ms, the terms not fitted), never below floor."""
    if not fitted:
        return floor
    fitted_ms = sum(v * features[f] for f, v in fitted["coefficients"].items())
    return max(floor, fitted_ms + features.get("fixed_ms", 0.0))


def group_key(backend: str, options, dtype: str) -> str:
    return f"{backends.label(backend, options)} {dtype}"


def forward_samples(model: str, cell: dict, rows: list[dict], manifest: dict, settings: tuple,
                    cell_id: str | None = None) -> tuple[list[dict], dict]:
    """One measured forward of a named model as samples: a sample per attention call (rows: its measured calls in
    order, each with time_ms) and one of its rest (rest_ms: the forward less its calls). Where the calls do not
    line up with the walk's, InputError."""
    dtype, cell_id = cell["dtype"], cell_id or cell["cell_id"]
    device = Device.of(manifest, dtype)
    w = walk(model, int(cell["width"]), int(cell["height"]), int(cell["batch"]), dtype, settings)
    if len(rows) != len(w["calls"]) or any(int(r["tokens_q"]) != int(o["tokens_q"]) for r, o in zip(rows, w["rows"])):
        raise InputError(f"{model}'s measured calls are not its planned ones")
    group, options = group_key(cell["backend"], cell["backend_options"], dtype), \
        json.loads(cell["backend_options"] or "{}")
    calls = []
    for row, ops in zip(rows, w["calls"]):
        f = call_features(row, cell["backend"], options, dtype, roof_ms(ops, device), device)
        calls.append({**f, "floor_ms": f["roofline_ms"], "time_ms": row["time_ms"], "cell_id": cell_id,
                      "group": group})
    rest = device.rest_features(w["rest"])
    return calls, {**rest, "floor_ms": roof_ms(w["rest"], device), "cell_id": cell_id, "group": group,
                   "dtype": dtype, "rest_ms": cell["forward_time_ms"] - cell["attention_time_ms"]}


def source_text(fitted: dict | None, gpu: dict | None = None, device: str | None = None,
                published: str | None = None) -> str:
    if gpu is not None and not fitted:
        return f"roofline bound on the {gpu['name']}'s published figures: a lower bound, not a measurement"
    if gpu is not None and published:
        return published
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


def published_backend(calibration: dict, backend: str) -> str:
    """What a published calibration says of this backend's attention efficiency."""
    return calibration["per_backend"][backend]["published"]


def passed_text(passed: dict | None) -> str:
    """'; left out 1 run (20261204-...: replay: ...); weighted down 2 runs (...: weighted 1/2.40: the machine's
    speed moved ...)', or ''."""
    out = ""
    for what, runs in (("left out", {r: w for r, w in (passed or {}).items() if not w.startswith("weighted")}),
                       ("weighted down", {r: w for r, w in (passed or {}).items() if w.startswith("weighted")})):
        if runs:
            whys = "; ".join(f"{run}: {why}" for run, why in sorted(runs.items()))
            out += f"; {what} {len(runs)} run{'s' if len(runs) > 1 else ''} ({whys})"
    return out


def _sdpa_kernels(blocks: list[dict], backend: str, dtype: str, device: str, gpu: dict | None) -> None:
    """The SDPA kernel of each call where the plan has none (a meta-device plan): bytes_moved differs for math."""
    from ..attention import kernel_choice

    if not backends.uses_sdpa(backend) or all(r.get("sdpa_kernel") for r in blocks):
        return
    target = kernel_choice.gpu_target(gpu["arch"]) if gpu else None
    where = "cuda" if gpu else device
    for r in blocks:
        r.setdefault("sdpa_kernel", kernel_choice.sdpa_choice(dtype, r["head_dim"], r["tokens_k"], where, target))


def predict(p: dict, backend: str, options: dict, limits: dict, calibration: dict | None = None,
            gpu: dict | None = None, device: str = "cuda") -> dict:
    """Each call's predicted_time_ms and roofline_time_ms added to the plan's blocks (in place), and the totals:
    predicted_attention_time_ms, predicted_rest_time_ms, predicted_forward_time_ms, their roofline bounds, the
    source. A calibration with "kernels" (a GPU's: planner/kernels.py) prices each call by the kernel that runs its
    attention; one with "host" (planner/host.py) adds the host's time, the forward's bound and its time from a CUDA
    graph (host_times)."""
    dtype = p["dtype"]
    _sdpa_kernels(p["blocks"], backend, dtype, device, gpu)
    dev = Device.of(limits, dtype)
    w = walk(p["model"], p["width"], p["height"], p["batch"], dtype, tuple(sorted((p.get("settings") or {}).items())))
    if [r["block"] for r in p["blocks"]] != w["blocks"]:
        raise RuntimeError("the walk's attention calls differ from the plan's")  # the same forward: a bug if so
    cal = calibration or {}
    said = {"peak_flops_per_s": dev.flops, "peak_bytes_per_s": dev.bandwidth,
            "key": limits.get("device_limits", {}).get("key")}  # the limits the time was priced on
    if cal.get("physics"):  # a GPU of the table: op by op, its host overlapped (planner/physics.py)
        from .physics import price

        times = {**price(p, w, backend, options, gpu, cal), "time_backend": backends.label(backend, options),
                 "time_source": cal["published"], "time_calibrated": True, "time_published": True,
                 **time_kind(True, cal), "time_limits": said}
        p["totals"].update(times)
        return times
    fitted = cal.get("backends", {}).get(group_key(backend, options, dtype)) or \
        cal.get("per_backend", {}).get(backend)
    kernels, by_backend = cal.get("kernels") or {}, False
    for row, ops in zip(p["blocks"], w["calls"]):
        f = call_features(row, backend, options, dtype, roof_ms(ops, dev), dev)
        mine = kernels.get(backends.call_kernel(backend, row, gpu and gpu["arch"]))
        by_backend |= mine is None
        row.update(roofline_time_ms=f["roofline_ms"], predicted_time_ms=apply(mine or fitted, f, f["roofline_ms"]))
    calibrated = bool(fitted or kernels)
    rest_fit = cal.get("rest", {}).get(dtype) if calibrated else None
    rest_roof = roof_ms(w["rest"], dev)
    rest = apply(rest_fit, dev.rest_features(w["rest"]), rest_roof)
    attention = sum(r["predicted_time_ms"] for r in p["blocks"])
    roof = sum(r["roofline_time_ms"] for r in p["blocks"])
    published = calibrated and cal.get("published") and cal["published"] + \
        (f"; {fitted['published']}" if by_backend and fitted and fitted.get("published") else "")
    times = {"predicted_attention_time_ms": attention, "predicted_rest_time_ms": rest,
             "predicted_forward_time_ms": attention + rest, "roofline_attention_time_ms": roof,
             "roofline_forward_time_ms": roof + rest_roof, "time_backend": backends.label(backend, options),
             "time_source": (cal["kernel_source"] if kernels and not published else
                             source_text(fitted, gpu, cal.get("device"), published)) +
             passed_text(cal.get("passed_over")),
             "time_calibrated": calibrated, "time_published": bool(published),
             **time_kind(fitted, cal, calibrated),
             "time_limits": said, "rest_ops": len(w["rest"]),
             **host_times(cal.get("host"), p["blocks"], rest, rest_fit, w, dev, backend, options, dtype)}
    p["totals"].update(times)
    return times


def host_times(host: dict | None, blocks: list[dict], rest_ms: float, rest_fit: dict | None, w: dict, dev: Device,
               backend: str = "sdpa", options: dict | None = None, dtype: str = "float16") -> dict:
    """A GPU forward's host time (its ops under the backend at the host's time per op), its kernels' and the eager
    forward, the two overlapped op by op (planner/physics.overlap: each rest op at its fitted class's time, each
    attention call whole at its predicted time; the rest's ops summing to rest_ms), its bound and its time from a
    CUDA graph (the kernels'); {} without a host figure (a CPU, whose ops run on the host)."""
    if not host:
        return {}
    from .host import core_ops
    from .physics import ordered, overlap

    ops = w["rest"]
    rest = dev.ops_ms(ops) if len(ops) else np.zeros(0)
    if rest_fit:
        c = rest_fit["coefficients"]
        rest = rest * np.array([c[k] for k in OP_CLASSES])[ops[:, 3].astype(int)] + c.get("ops", 0.0)
    rest = rest * (rest_ms / rest.sum()) if rest.sum() > 0 else rest
    cores = [core_ops(backend, options or {}, r, dtype) for r in w["rows"]]
    o = overlap(*ordered(w, rest, [b["predicted_time_ms"] for b in blocks], cores), host["us_per_op"])
    return {"predicted_forward_time_ms": o["eager_ms"], "predicted_gpu_time_ms": o["gpu_ms"],
            "predicted_host_time_ms": o["host_ms"], "predicted_graph_time_ms": o["graph_ms"], "bound": o["bound"],
            "host_source": host["source"]}


MAX_ERROR_PCT = 50.0  # a calibrated prediction whose expected (leave-one-out) error is over this is not printed


NO_HELD_OUT = "the kernel fits carry no held-out error"  # a GPU's prediction fitted on kernel times alone


def time_kind(fitted: dict | None, calibration: dict, calibrated: bool | None = None) -> dict:
    """What a predicted time is, for printing it: time_kind "floor" (the roofline bound: a lower bound, no
    evidence of the real time), "calibrated" (fitted on stored runs; time_error_pct its expected error, the
    leave-one-out error of the forward where known, else of the attention) or "published" (a GPU's published
    figures and efficiencies). Where a calibrated error is unknown, time_error_why says why: one cell to calibrate
    on, or (no fit of stored forwards, a GPU's kernel fits only) NO_HELD_OUT. calibrated: whether anything fitted the
    prediction (a GPU's kernel fits count), where that is more than `fitted`."""
    if not (fitted if calibrated is None else calibrated):
        return {"time_kind": "floor", "time_error_pct": None, "time_error_why": None}
    if calibration.get("published"):
        return {"time_kind": "published", "time_error_pct": None, "time_error_why": None}
    error = fitted.get("loo_forward_error_pct") if isinstance(fitted, dict) else None
    fallback = fitted.get("loo_error_pct") if isinstance(fitted, dict) else None
    pct = fallback if error is None else error
    why = None if pct is not None else "one cell to calibrate on" if isinstance(fitted, dict) else NO_HELD_OUT
    return {"time_kind": "calibrated", "time_error_pct": pct, "time_error_why": why}


def error_words(t: dict) -> str:
    """A calibrated prediction's expected error in words: 'expected error 8%, leave-one-out', or where it is unknown
    why, as far as t says ('expected error unknown: one cell to calibrate on', '... : the kernel fits carry no
    held-out error')."""
    pct = t.get("time_error_pct")
    if pct is not None and pct == pct:
        return f"expected error {pct:.0f}%, leave-one-out"
    why = t.get("time_error_why")
    return "expected error unknown" + (f": {why}" if isinstance(why, str) and why else "")


def said_time(value: str, t: dict, floor_note: bool = True) -> str | None:
    """A predicted figure as far as its evidence goes (t: its time_kind, time_error_pct, time_error_why): 'at least
    VALUE (the roofline floor, a lower bound)' for a floor, 'VALUE (expected error 8%, leave-one-out)' for a
    calibrated one, VALUE for published figures; None where its expected error is over MAX_ERROR_PCT (too_wrong)."""
    if too_wrong(t):
        return None
    if t.get("time_kind") == "floor":
        return f"at least {value}" + (" (the roofline floor, a lower bound)" if floor_note else "")
    return f"{value} ({error_words(t)})" if t.get("time_kind") == "calibrated" else value


def wrong_text(t: dict) -> str:
    """Why a prediction is not printed: 'its calibration's leave-one-out error 993% is over 50%'."""
    return f"its calibration's leave-one-out error {t['time_error_pct']:.0f}% is over {MAX_ERROR_PCT:.0f}%"


def over_text(pct: float) -> str:
    """The same, in a clause: 'leave-one-out error is 993%, over 50%'."""
    return f"leave-one-out error is {pct:.0f}%, over {MAX_ERROR_PCT:.0f}%"


def format_times(t: dict) -> list[tuple[str, str]]:
    """The plan's time lines (facts) from its totals, as far as their evidence goes (said_time): a roofline floor
    'at least', a calibrated time with its expected error, none where that error is over MAX_ERROR_PCT."""
    if "predicted_forward_time_ms" not in t:
        return []
    what = "published efficiencies" if t.get("time_published") else "calibrated" if t["time_calibrated"] else \
        "roofline bound"
    source = [("time from", t["time_source"])] + ([("GPU figures", t["gpu_figures"])] if t.get("gpu_figures") else [])
    if too_wrong(t):
        return [("predicted time", f"{t['time_backend']} ({what}): none: {wrong_text(t)}")] + source
    floor = "at least " if t.get("time_kind") == "floor" else ""
    how = f"; {error_words(t)}" if t.get("time_kind") == "calibrated" else \
        "; the roofline floor, a lower bound" if floor else ""
    if "bound" in t:  # a GPU: the kernels, the host, the eager forward (the longer) and the graph's
        span = f" (likely {t['predicted_forward_low_ms']:.3g} to {t['predicted_forward_high_ms']:.3g})" \
            if "predicted_forward_low_ms" in t else ""
        lines = [("predicted time", f"{t['time_backend']} ({what}): GPU kernels {floor}"
                                    f"{t['predicted_gpu_time_ms']:.3g} ms (attention {t['predicted_attention_time_ms']:.3g}"
                                    f" + the rest {t['predicted_rest_time_ms']:.3g}), host "
                                    f"{t['predicted_host_time_ms']:.3g} ms: eager {floor}"
                                    f"{t['predicted_forward_time_ms']:.3g} ms{span}, {t['bound']}-bound; with CUDA "
                                    f"graphs about {t['predicted_graph_time_ms']:.3g} ms{how}"),
                 ("host from", t["host_source"])] + ([("time rests on", t["time_basis"])] if t.get("time_basis") else [])
    else:
        lines = [("predicted time", f"{t['time_backend']} ({what}): attention {t['predicted_attention_time_ms']:.3g} "
                                    f"ms + the rest of the forward {t['predicted_rest_time_ms']:.3g} ms = forward "
                                    f"{floor}{t['predicted_forward_time_ms']:.3g} ms{how}")]
    return lines + source


def walked_plan(model: str, width: int, height: int, batch: int, dtype: str, settings: tuple = ()) -> dict:
    """A plan for predict() made of the walk's calls (no forward of its own where the shape was traced already);
    its rows are its own, for predict() to write its times into."""
    rows = walk(model, width, height, batch, dtype, settings)["rows"]
    return {"model": model, "width": width, "height": height, "batch": batch, "dtype": parse_dtype(dtype),
            "settings": dict(settings), "totals": {}, "blocks": copy.deepcopy(rows)}


def sweep_text(predicted: dict[str, dict], forwards_per_cell: int, overhead: dict | None = None,
               cells: int | None = None) -> str:
    """The line a sweep prints before its first cell: the cells it holds (`cells`) and those it runs (predicted's),
    and their expected wall time as far as the evidence goes: "about" with the expected error where every cell's
    time is calibrated, "at least" where any is the roofline floor (no run of this device and backend to calibrate
    on: a lower bound, which a first run's forwards have exceeded 3-130x), none for the cells whose calibration's
    leave-one-out error is over MAX_ERROR_PCT. With what this device's finished runs took beyond their forwards
    (harness_overhead) the whole run's, else its forwards'."""
    if not predicted:
        return "predicted: no cell to run"
    n = len(predicted)
    count = f"{cells} cells, {n} to run ({cells - n} recorded without running: unavailable here or over the memory " \
        "budget)" if cells and cells > n else f"{n} cells"
    wild = {k: v for k, v in predicted.items() if too_wrong(v)}
    kept = {k: v for k, v in predicted.items() if k not in wild}
    parts = [count] + ([_total_text(kept, forwards_per_cell, overhead)] if kept else []) + \
        ([_wild_text(wild)] if wild else [])
    return "predicted: " + "; ".join(parts)


def too_wrong(t: dict) -> bool:
    """A calibrated prediction whose expected error is over MAX_ERROR_PCT: no evidence to print it by."""
    return t.get("time_kind") == "calibrated" and (t.get("time_error_pct") or 0.0) > MAX_ERROR_PCT


def _total_text(kept: dict[str, dict], forwards_per_cell: int, overhead: dict | None) -> str:
    """The expected wall time of the cells with a time to print: 'about' with the largest expected error, or 'at
    least' where any is a roofline floor; the backends' sources where any is calibrated."""
    floors = [v for v in kept.values() if v.get("time_kind") == "floor"]
    errors = [v["time_error_pct"] for v in kept.values() if v.get("time_error_pct") is not None]
    forwards = predicted_wall_s(kept, forwards_per_cell)
    each = f"{forwards:.1f} s of forwards ({forwards_per_cell} a cell: warm-up, timed and probe)"
    if len(floors) == len(kept):
        note = ("each the roofline floor, a lower bound with no stored run of this device and backend to calibrate "
                "on (a first run's forwards take several times it)")
    elif floors:
        note = f"{len(floors)} of the {len(kept)} cells' forwards by the roofline floor alone, a lower bound"
    else:
        whys = sorted({v.get("time_error_why") or "" for v in kept.values() if v.get("time_error_pct") is None})
        note = f"expected error up to {max(errors):.0f}% (leave-one-out)" if errors else \
            "expected error unknown" + (f" ({'; '.join(w for w in whys if w)})" if any(whys) else "")
    how = "at least" if floors else "about"
    if overhead:
        total = predicted_wall_s(kept, forwards_per_cell, overhead)
        text = (f"{how} {duration(total)} in all, {note}: {each}, and {overhead['cell_s']:.1f} s a cell and "
                f"{overhead['run_s']:.1f} s a run beyond them (model builds, references, probes, workers: the median "
                f"of {overhead['cells']} cells in {overhead['runs']} finished runs of this device)")
    else:
        text = (f"{how} {each}, {note}; model builds, references and probes not counted (no finished run of this "
                "device to tell them)")
    sources = grouped_sources(v["time_source"] for v in kept.values())
    return text if len(floors) == len(kept) else f"{text}; forwards from {sources}"


def _wild_text(wild: dict[str, dict]) -> str:
    """'no time for sliced (3 cells): its calibration's leave-one-out error is 993%, over 50%'."""
    by: dict[str, list[float]] = {}
    for v in wild.values():
        by.setdefault(v["time_source"].split(": ")[0], []).append(v["time_error_pct"])
    return "; ".join(f"no time for {who} ({len(errs)} cell{'s' if len(errs) > 1 else ''}): its calibration's "
                     f"{over_text(max(errs))}" for who, errs in by.items())


def grouped_sources(sources) -> str:
    """Time sources ('naive: roofline bound ...') once per source, the backends that share one named together:
    'naive, sdpa: roofline bound ...; sliced: calibrated on ...'."""
    by_how: dict[str, list[str]] = {}
    for source in sorted(set(sources)):
        who, sep, how = source.partition(": ")
        by_how.setdefault(how if sep else source, []).append(who if sep else "")
    return "; ".join(f"{', '.join(filter(None, who))}: {how}" if any(who) else how for how, who in by_how.items())


def predicted_wall_s(predicted: dict[str, dict], forwards_per_cell: int, overhead: dict | None = None) -> float:
    """The cells' forwards, plus what each cell and the run take beyond them where overhead says (harness_overhead)."""
    forwards = sum(v["predicted_forward_time_ms"] for v in predicted.values()) * forwards_per_cell / 1e3
    return forwards + (len(predicted) * overhead["cell_s"] + overhead["run_s"] if overhead else 0.0)


def format_wall(manifest: dict) -> str | None:
    """The end of a run: its wall time against the one predicted before it began (where it ran whole, once): "at
    least" where the prediction counted a roofline floor."""
    from datetime import datetime

    p = manifest.get("predicted_wall_s")
    if not p or not manifest.get("ended_at") or manifest.get("interrupted"):
        return None
    wall = (datetime.fromisoformat(manifest["ended_at"]) - datetime.fromisoformat(manifest["created_at"])
            ).total_seconds()
    if manifest.get("predicted_wall_floor"):
        return f"the whole run took {duration(wall)}, predicted at least {duration(p)} ({wall / p:.2f}x that floor)"
    return f"the whole run took {duration(wall)}, predicted {duration(p)} ({wall / p:.2f}x)"


def attach(cell: dict, blocks: list[dict], extra: dict) -> dict:
    """A measured cell's prediction onto its rows: each call's predicted_time_ms, predicted_time_ratio (measured
    over predicted) and roofline_time_ms (its floor), the cell's attention and forward ratios. Returns the cell's
    extra (execute/groups.py) less the per-call lists, for the cell row."""
    extra = dict(extra)
    calls = extra.pop("predicted_call_times_ms", None)
    floors = extra.pop("roofline_call_times_ms", None) or [None] * len(blocks)
    if cell.get("status") != "ok" or calls is None or len(calls) != len(blocks):
        return extra
    for row, t, floor in zip(blocks, calls, floors):
        row.update(predicted_time_ms=t, predicted_time_ratio=row["time_ms"] / t if t else None,
                   roofline_time_ms=floor)
    for what in ("forward", "attention"):
        t = extra.get(f"predicted_{what}_time_ms")
        extra[f"{what}_time_ratio"] = cell[f"{what}_time_ms"] / t if t else None
    return extra


def format_versus(cells) -> str | None:
    """The end of a run: predicted against measured, over its ok cells that carry a prediction; a roofline floor
    said as "at least", a calibrated prediction with its expected error, none where that error is over
    MAX_ERROR_PCT."""
    if "predicted_forward_time_ms" not in cells or "forward_time_ms" not in cells:
        return None
    ok = cells[(cells["status"] == "ok") & cells["predicted_forward_time_ms"].notna()]
    if not len(ok):
        return None
    from ..spec import settings_label

    lines = ["predicted against measured (ms per forward; ratio = measured / predicted; 'at least': the roofline "
             "floor, a lower bound where no stored run calibrates it):"]
    varying = [c for c in ("model", "settings", "dtype", "batch") if c in ok and ok[c].nunique() > 1]
    names = [" ".join([r["backend_label"] if "backend_label" in r else r["backend"]]
                      + [f"({settings_label(r[c]) or 'none'})" if c == "settings" else f"batch {r[c]}"
                         if c == "batch" else str(r[c]) for c in varying]) for r in ok.to_dict("records")]
    width = max(map(len, names))
    for name, r in zip(names, ok.to_dict("records")):
        lines.append(f"  {name:{width}s} {r['width']}x{r['height']}: {_versus(r)}")
    return "\n".join(lines)


def _versus(r: dict) -> str:
    """One cell's predicted against measured, as far as its prediction is evidence."""
    kind, error = r.get("time_kind"), r.get("time_error_pct")
    error = None if error != error else error  # NaN: a cell with no calibrated time
    if too_wrong({"time_kind": kind, "time_error_pct": error}):
        return (f"no prediction ({wrong_text({'time_error_pct': error})}); measured attention "
                f"{r['attention_time_ms']:.4g}, forward {r['forward_time_ms']:.4g}")
    floor = kind == "floor"
    out = []
    for what in ("attention", "forward"):
        predicted, measured = r[f"predicted_{what}_time_ms"], r[f"{what}_time_ms"]
        out.append(f"{what} {'at least ' if floor else ''}{predicted:.4g} vs {measured:.4g} "
                   f"({measured / predicted:.2f}x{' the floor' if floor else ''})")
    if kind == "calibrated":
        out[-1] += f"; expected error {error:.0f}%" if error is not None else \
            f"; {error_words({'time_error_why': r.get('time_error_why')})}"
    return ", ".join(out)
