"""Running a sweep: preflight (availability and memory budget, before any model is built), then group by group
(one model build per (model, dtype, device)), each cell recorded when it ends; resumable, failures kept as rows.
Where the groups run is the executor's business: worker subprocesses here (local.py) or Ray tasks (ray.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import backends, devices
from ..spec import CellSpec
from .grid import Sweep


def plans_of(cells: list[CellSpec]) -> dict[tuple, dict]:
    """The meta-device plan of each (model, width, height, batch, dtype) of the cells."""
    from ..plan import plan

    plans = {}
    for c in cells:
        key = (c.model, c.width, c.height, c.batch, c.dtype)
        if key not in plans:
            plans[key] = plan(c.model, c.width, c.height, c.batch, c.dtype)
    return plans


def predicted_cell_peaks(cells: list[CellSpec], plans: dict | None = None) -> dict[str, int]:
    """cell_id -> predicted bytes the cell needs (plan.predicted_need_bytes, with the fp32 reference copy)."""
    from ..plan import predicted_need_bytes

    plans = plans or plans_of(cells)
    return {c.cell_id: predicted_need_bytes(plans[(c.model, c.width, c.height, c.batch, c.dtype)], c.backend,
                                            c.options, reference_copy=True)[0] for c in cells}


def availability_of(cells: list[CellSpec], plans: dict, isolated: bool) -> dict[str, tuple[bool, str]]:
    """cell_id -> (ok, reason): each backend probed once per (device, dtype) at the head dims of the cell's model.
    isolated: probe in a short-lived subprocess, so that this process makes no CUDA context (a context costs a few
    hundred MiB that the workers would miss)."""
    head_dims: dict[str, set] = {}
    for (model, *_), p in plans.items():
        head_dims.setdefault(model, set()).update(r["head_dim"] for r in p["blocks"])
    ask = {c.cell_id: (c.backend, c.device, c.dtype, tuple(sorted(head_dims[c.model]))) for c in cells}
    asks = sorted(set(ask.values()))
    if isolated:
        from .local import exit_reason

        proc = subprocess.run([sys.executable, "-m", "profiler.execute.worker", "--probe"], input=json.dumps(asks),
                              text=True, capture_output=True)
        if proc.returncode:
            tail = "; ".join(proc.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"the availability probe exited with {exit_reason(proc.returncode)}: {tail}")
        answers = dict(zip(asks, map(tuple, json.loads(proc.stdout.strip().splitlines()[-1])), strict=True))
    else:
        answers = {a: backends.availability(*a) for a in asks}
    return {cid: answers[a] for cid, a in ask.items()}


def preflight(cells: list[CellSpec], budget: int, force: bool, isolated: bool = False) -> dict[str, dict]:
    """cell_id -> failure row for the cells that must not run: backend unavailable, or predicted over budget."""
    from ..fmt import human_bytes
    from ..measure.cell import failed_cell

    plans = plans_of(cells)
    peaks = predicted_cell_peaks(cells, plans)
    avail = availability_of(cells, plans, isolated)
    rows = {}
    for c in cells:
        ok, reason = avail[c.cell_id]
        if not ok:
            rows[c.cell_id] = failed_cell(c, "unavailable", reason)
        elif peaks[c.cell_id] > budget and not force:
            rows[c.cell_id] = failed_cell(
                c, "skipped", f"predicted peak {human_bytes(peaks[c.cell_id])} exceeds the memory budget "
                              f"{human_bytes(budget)} (use --force to run it anyway)",
                predicted_peak_bytes=peaks[c.cell_id])
    return rows


@dataclass
class Outcome:
    run_path: Path
    interrupted: bool = False


def execute(sweep: Sweep, *, resume: bool = False, retry_failed: bool = False, force: bool = False,
            workers: bool = True, progress: bool = True, command: str = "") -> Outcome:
    from ..store import Run, environment, now
    from .local import run_group_in_workers

    cells = sweep.cells()
    budget = sweep.memory_budget or devices.free_memory_bytes(cells[0].device)
    run = _find_resumable(sweep) if resume else None
    if run is None:
        run = Run.create(Path(sweep.out), {
            "command": command, "sweep": sweep.settings(), "memory_budget_bytes": budget,
            "cells": [c.as_row() for c in cells], "environment": environment(cells[0].device)})
    else:
        run.update_manifest(resumed_at=now(), ended_at=None, memory_budget_bytes=budget)
    done = run.done_cells()
    pending = [c for c in cells if c.cell_id not in done or (retry_failed and done[c.cell_id] != "ok")]
    pre = preflight(pending, budget, force, isolated=workers and cells[0].device.startswith("cuda"))
    bar = _progress(len(cells), len(cells) - len(pending), progress)
    interrupted = False
    try:
        for c in [c for c in pending if c.cell_id in pre]:
            run.record(pre[c.cell_id], [])
            bar.update(1)
        todo = [c for c in pending if c.cell_id not in pre]
        groups: dict[tuple, list[CellSpec]] = {}
        for c in todo:
            groups.setdefault((c.model, c.dtype, c.device), []).append(c)
        for group in groups.values():
            if workers:
                run_group_in_workers(group, run, sweep, bar)
            else:
                run_group(group, run, sweep.repeats, sweep.warmup, lambda e: on_event(e, bar))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        run.update_manifest(ended_at=now(), interrupted=interrupted)
    return Outcome(run.path, interrupted)


def _find_resumable(sweep: Sweep):
    from ..store import Run, list_runs

    for path in reversed(list_runs(Path(sweep.out))):
        run = Run.open(path)
        if _same_grid(run.manifest().get("sweep", {}), sweep.settings()):
            return run
    return None


def _same_grid(a: dict, b: dict) -> bool:
    keys = ("models", "sizes", "batch", "dtypes", "backends", "repeats", "warmup", "device")
    return all(a.get(k) == b.get(k) for k in keys)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="cell", disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} cells [{elapsed}<{remaining}]")


def on_event(event: dict, bar) -> None:
    if event["event"] == "start":
        bar.set_description_str(event["label"])
    elif event["event"] == "done":
        bar.update(1)


def run_group(cells: list[CellSpec], run, repeats: int, warmup: int, emit) -> None:
    """Run cells that share one (model, dtype, device) with one model build; record each as it ends."""
    from ..measure.cell import ModelCache, run_cell

    cache = ModelCache()
    for c in cells:
        emit({"event": "start", "cell_id": c.cell_id, "label": _label(c)})
        cell, blocks = run_cell(c, cache, repeats, warmup)
        run.record(cell, blocks)
        emit({"event": "done", "cell_id": c.cell_id, "status": cell["status"]})


def _label(c: CellSpec) -> str:
    return f"{c.model} {c.size} b{c.batch} {c.dtype} {c.backend}"
