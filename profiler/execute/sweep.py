"""Running a sweep: preflight (availability and memory budget, before any model is built), then group by group
(one model build per (model, dtype, device)), each cell recorded when it ends; resumable, failures kept as rows.
Where the groups run is the executor's business: worker subprocesses here (local.py) or Ray tasks (ray.py)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..attention import backends
from .. import devices
from ..unet.models import model_files
from ..measure.limits import LIMIT_KEYS, cell_peaks
from ..spec import CellSpec
from .grid import Sweep
from . import HeldStops
from .groups import Executor, InFlight


class Shape(NamedTuple):
    """What one fake-tensor forward of the planner is traced for: the cells that share it share their prediction."""

    model: str
    width: int
    height: int
    batch: int
    dtype: str
    device: str  # the device type: cuda:1 as cuda
    settings: tuple  # the model's settings less compile: the planner predicts a compiled U-Net as eager

    @classmethod
    def of(cls, c: CellSpec) -> "Shape":
        eager = tuple(s for s in c.settings if s[0] != "compile")
        return cls(c.model, c.width, c.height, c.batch, c.dtype, c.device.split(":")[0], eager)


def predict(cells: list[CellSpec]) -> tuple[dict[str, dict], dict[str, tuple[int, ...]], dict[str, str]]:
    """Per cell, from one fake-tensor forward per shape (model, settings, size, batch, dtype) and device type for all the
    backends that share them, each with its own options (a backend asked with two sets of options takes a second
    forward): predicted_forward_peak_bytes (this model's weights, the inputs and the forward's transient,
    planner/forward.py) and predicted_need_bytes, what the preflight holds against the memory budget: the same
    forward peak, since nothing of ours stays on the device beside the model under test (the fp32 reference is
    computed and freed before it is built: measure/cell.py). And the head dims of each model, for the
    availability probe; and per cell why its backend cannot run a call of that forward (backends.refusal: an
    added-KV block it cannot stand in for, a kernel's batch x heads limit), '' where it runs them all."""
    from ..planner.forward import trace

    groups: dict[Shape, list[dict[str, tuple]]] = {}  # shape -> forwards, each {backend: its options}
    for c in cells:
        forwards = groups.setdefault(Shape.of(c), [])
        forward = next((f for f in forwards if f.get(c.backend, c.backend_options) == c.backend_options), None)
        if forward is None:
            forwards.append(forward := {})
        forward[c.backend] = c.backend_options
    traced, dims, refused = {}, {}, {}
    for s, forwards in groups.items():
        for i, forward in enumerate(forwards):  # the first also counts the ops that the time model reads
            t = trace(s.model, s.width, s.height, s.batch, s.dtype, s.device, sorted(forward),
                      {n: dict(o) for n, o in forward.items()}, settings=s.settings, ops=i == 0)
            dims.setdefault(s.model, set()).update(r["head_dim"] for r in t["rows"])
            for name, options in forward.items():
                peak = t["backends"].get(name, {}).get("predicted_forward_peak_bytes")
                traced[s, name, options] = {"predicted_forward_peak_bytes": peak, "predicted_need_bytes": peak}
                refused[s, name, options] = backends.refusal(name, t["rows"], dict(options))
    out = {c.cell_id: traced[Shape.of(c), c.backend, c.backend_options] for c in cells}
    why = {c.cell_id: refused[Shape.of(c), c.backend, c.backend_options] for c in cells}
    return out, {m: tuple(sorted(d)) for m, d in dims.items()}, why


def preflight(cells: list[CellSpec], budget: int, force: bool, availability) -> tuple[dict[str, dict], dict]:
    """(cell_id -> failure row for the cells that must not run: backend unavailable (asked of the executor, once per
    backend, device, dtype and the model's head dims; a processor map's, each backend it runs: backends.asks), or predicted over the memory budget; cell_id -> the
    predictions every cell row carries)."""
    from ..fmt import human_bytes
    from ..measure.cell import failed_cell

    with devices.nvtx_range("preflight: each cell's memory planned (fake tensors)"):
        predicted, dims, refused = predict(cells)
    ask = {c.cell_id: backends.asks(c.backend, c.options, c.device, c.dtype, dims[c.model]) for c in cells}
    every = sorted({a for asked in ask.values() for a in asked})
    answers = dict(zip(every, availability(every), strict=True))
    rows = {}
    for c in cells:  # a processor map's: the first of its backends that cannot run, else ok
        ok, reason = next((answers[a] for a in ask[c.cell_id] if not answers[a][0]), (True, ""))
        ok, reason = (False, refused[c.cell_id]) if ok and refused[c.cell_id] else (ok, reason)
        need = predicted[c.cell_id]["predicted_need_bytes"]
        if not ok:
            rows[c.cell_id] = failed_cell(c, "unavailable", reason, **predicted[c.cell_id])
        elif need is not None and need > budget and not force:
            rows[c.cell_id] = failed_cell(
                c, "skipped", f"predicted forward peak {human_bytes(need)} exceeds the memory budget "
                              f"{human_bytes(budget)} (use --force to run it anyway)",
                **predicted[c.cell_id])
    return rows, predicted


@dataclass
class Outcome:
    run_path: Path
    interrupted: bool = False


def execute(sweep: Sweep, *, resume: bool = False, retry_failed: bool = False, force: bool = False,
            workers: bool = True, progress: bool = True, command: str = "") -> Outcome:
    """Run the sweep's cells (or, with resume, those the latest run of the same grid lacks) and record each as it
    ends. retry_failed implies resume: it runs again the cells of that run that did not end ok. The executor is the
    sweep's: local worker subprocesses (in this process with workers=False), or Ray. One process runs a run at a
    time: a second one gets store.RunBusy naming the first."""
    from ..store import Run, now

    devices.keep_memory()  # this process measures the device's limits and, with workers=False, the cells
    executor = _executor(sweep, workers)
    device = executor.device(sweep.device)
    cells = sweep.cells(device)
    budget = sweep.memory_budget or executor.free_memory(device)
    run = _find_resumable(sweep) if resume or retry_failed else None
    resumed, job_id = run is not None, os.environ.get("ATTNPROF_JOB_ID")  # set in a queued job (attnprof submit)
    dtypes = sorted({c.dtype for c in cells})
    note = devices.dtype_note(device, dtypes)
    if note:
        print(f"attnprof: {note}", file=sys.stderr, flush=True)
    limits = _limits(run.manifest() if resumed else {}, executor, device, dtypes)
    for line in (limits.get("device_limits") or {}).get("refused") or []:
        print(f"attnprof: device limit refused: {line}", file=sys.stderr, flush=True)
    stops = HeldStops()
    stops.hold()  # a stop while the run is made and its lock taken is raised in the try below, which closes it
    try:
        if not resumed:
            run = Run.create(Path(sweep.out), {
                "command": command, "sweep": sweep.settings(), "memory_budget_bytes": budget,
                "job_ids": [job_id] if job_id else [],
                "cells": [c.as_row() for c in cells], "environment": executor.environment(device),
                "model_files": model_files(cells), **limits})
        with run.executor(command or "attnprof"):
            flight, interrupted = None, False
            try:  # from the lock on: whatever fails or stops it (a stop held since the run was made too), the
                # manifest says the run ended, and how
                stops.release()
                if resumed:
                    jobs = run.manifest().get("job_ids", []) + ([job_id] if job_id else [])
                    run.update_manifest(resumed_at=now(), ended_at=None, memory_budget_bytes=budget, job_ids=jobs,
                                        **limits)
                done = run.done_cells()
                pending = [c for c in cells if c.cell_id not in done or (retry_failed and done[c.cell_id] != "ok")]
                flight = InFlight(run, _progress(len(cells), len(cells) - len(pending), progress))
                _calibrate(run, executor, device, "start")
                _run_pending(pending, run, sweep, executor, flight, budget, force, limits, progress)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                if flight is not None:
                    flight.close()
                done = run.done_cells()  # any cell not recorded (a stop, a crash of ours) leaves the run interrupted
                interrupted = interrupted or any(c.cell_id not in done for c in cells)
                if not interrupted:
                    _calibrate(run, executor, device, "end")
                run.update_manifest(ended_at=now(), interrupted=interrupted)
                run.compact()
    finally:
        stops.release()  # the handlers back where the run was busy (RunBusy)
    return Outcome(run.path, interrupted)


def _executor(sweep: Sweep, workers: bool) -> Executor:
    """The sweep's executor: Ray, or local worker subprocesses (in this process with workers=False)."""
    if sweep.executor == "ray":
        from .ray import RayExecutor

        return RayExecutor(sweep.ray_address, sweep.out)
    from .local import LocalExecutor

    return LocalExecutor(workers)


def _run_pending(pending: list[CellSpec], run, sweep: Sweep, executor: Executor, flight: InFlight, budget: int,
                 force: bool, limits: dict, progress: bool) -> None:
    """The preflight's rows recorded, the predicted time said, then the rest group by group (one model build per
    (model, dtype, device)) on the executor, each cell with its extra (groups.py): its predictions, the device's
    limits for its dtype and its predicted times."""
    pre, predicted = preflight(pending, budget, force, executor.availability)
    times = _predicted_times([c for c in pending if c.cell_id not in pre], limits, sweep, progress, run,
                             len(pending))
    extra = {c.cell_id: {**predicted[c.cell_id], **cell_peaks(limits, c.dtype), **times.get(c.cell_id, {})}
             for c in pending}
    for c in [c for c in pending if c.cell_id in pre]:
        run.record(pre[c.cell_id], [])
        flight.bar.update(1)
    groups: dict[tuple, list[CellSpec]] = {}
    for c in pending:
        if c.cell_id not in pre:
            groups.setdefault((c.model, c.dtype, c.device), []).append(c)
    executor.run(list(groups.values()), run, sweep, flight, extra)


def _calibrate(run, executor, device: str, when: str) -> None:
    """A calibration of the machine's speed (measure/calibrate.py) added to the manifest's list: at the start of
    every session on the run (a resume adds its own) and at the end of one that finished."""
    found = executor.calibrate(device, when)
    run.update_manifest(calibration=[*run.manifest().get("calibration", []), found])


def _predicted_times(cells: list[CellSpec], limits: dict, sweep: Sweep, say: bool, run=None,
                     holds: int | None = None) -> dict[str, dict]:
    """Each cell's predicted time (planner/timing.py), and the sweep's total printed (stderr, beside the progress bar)
    before the first cell, with the cells the run holds (`holds`) and those it runs, and kept in the manifest
    (predicted_wall_s; predicted_wall_floor where a cell's time is the roofline floor) for the end's comparison:
    none where a cell has no time to print (its calibration's error over timing.MAX_ERROR_PCT)."""
    from ..planner.calibration import harness_overhead, predict_cells
    from ..planner.timing import predicted_wall_s, sweep_text, too_wrong

    times = predict_cells(cells, limits, Path(sweep.out))
    if times:
        overhead = harness_overhead(Path(sweep.out), limits["device_limits"]["key"])
        per_cell = forwards_per_cell(cells, times, sweep)
        if run is not None and overhead:  # a resumed run's wall time spans its attempts: nothing to set it against
            whole = "predicted_wall_s" not in run.manifest() and not any(map(too_wrong, times.values()))
            run.update_manifest(predicted_wall_s=predicted_wall_s(times, per_cell, overhead) if whole else None,
                                predicted_wall_floor=any(t["time_kind"] == "floor" for t in times.values()))
        if say:
            print(f"attnprof: {sweep_text(times, per_cell, overhead, holds)}", file=sys.stderr, flush=True)
    return times


def forwards_per_cell(cells: list[CellSpec], times: dict[str, dict], sweep: Sweep) -> float:
    """The forwards a cell costs, in forwards of its own predicted time (measure/passes.expected_forwards: on CUDA
    its passes' minimums by time count as forwards too), averaged over the cells by their predicted time."""
    from .. import devices
    from ..measure.passes import expected_forwards

    kernel = devices.get(cells[0].device).kernel_clock if cells else False
    weights = [times[c.cell_id]["predicted_forward_time_ms"] for c in cells if c.cell_id in times]
    counts = [expected_forwards(kernel, sweep.warmup, sweep.repeats, w) for w in weights]
    return sum(c * w for c, w in zip(counts, weights)) / sum(weights) if sum(weights) else counts[0] if counts else 0


def _limits(manifest: dict, executor, device: str, dtypes) -> dict:
    """The device's measured limits for the run's dtypes (measure/limits.py): a resumed run's own where its manifest
    has them all, else asked of the executor, which measures where the cells run (never a CUDA context here)."""
    have = manifest.get("device_peak_flops") or {}
    if manifest.get("device_peak_bytes_per_s") and all(d in have for d in dtypes):
        return {k: manifest[k] for k in LIMIT_KEYS if k in manifest}
    return executor.limits(device, list(dtypes))


def _find_resumable(sweep: Sweep):
    from ..store import readable_runs

    for run, manifest in reversed(readable_runs(Path(sweep.out))):
        if _same_grid(manifest.get("sweep", {}), sweep.settings()):
            return run
    return None


def _same_grid(a: dict, b: dict) -> bool:
    from .grid import GRID_KEYS

    keys = (*GRID_KEYS, "repeats", "warmup", "device", "also")
    return all(a.get(k) == b.get(k) for k in keys)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="cell", disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} cells [{elapsed}<{remaining}]")
