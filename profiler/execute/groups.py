"""What every executor is and runs: the interface sweep.py asks of it (Executor), a group of cells that share one
model build (group_events: a start event before each cell, a done event with its rows after it), recorded where it
ran (run_group), the row of a cell whose worker died (failed_in_flight), each cell's extra merged into its row
(with_extra), and the cells in flight for the progress bar and progress.json (InFlight). Below sweep.py and the
executors (local.py, ray.py, worker.py), which import it; it imports none of them.

A cell's extra (`extra`, keyed by cell_id where a sweep holds them all): what the sweep knows of the cell before it
runs, carried into its row: the predictions (predicted_forward_peak_bytes, predicted_need_bytes), the device's limits
for its dtype (measure/limits.cell_peaks) and its predicted times (planner/timing.py)."""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Protocol

from ..attention import backends
from ..spec import CellSpec


class Executor(Protocol):
    """Where a sweep's cells run: local.LocalExecutor (worker subprocesses, or this process) or ray.RayExecutor.
    Everything sweep.execute asks before the first cell is asked of it, so that it is answered where the cells run
    (on CUDA, never by a CUDA context in the sweep's own process)."""

    def device(self, requested: str) -> str:
        """The device the cells run on, for the one asked (auto, cpu, cuda, cuda:N)."""

    def free_memory(self, device: str) -> int:
        """The device's free memory now: the memory budget where the sweep names none."""

    def environment(self, device: str) -> dict:
        """The run manifest's environment (env.environment), with the executor's own fields."""

    def availability(self, asks: list[tuple]) -> list[tuple[bool, str]]:
        """(ok, reason) per (backend, device, dtype, head dims)."""

    def limits(self, device: str, dtypes: list[str]) -> dict:
        """The device's measured limits (measure/limits.py)."""

    def calibrate(self, device: str, when: str) -> dict:
        """The machine's speed now (measure/calibrate.py)."""

    def run(self, groups: list[list[CellSpec]], run, sweep, flight: InFlight, extra: dict[str, dict]) -> None:
        """Run the groups (each one model build), every cell recorded in the run as it ends, with its extra."""


class InFlight:
    """The cells running now, by worker, for every executor: progress.json in the run folder lists them (with the
    worker's pid and host) and the progress bar shows the latest. A worker runs the cells of one shape together
    (measure/cell.measure_set): its start event names them all (cell_ids), and each ends on its own."""

    def __init__(self, run, bar):
        self.run, self.bar, self.cells = run, bar, {}

    def start(self, worker, event: dict) -> None:
        ids = list(event.get("cell_ids") or [event["cell_id"]])
        self.cells[worker] = {"cell_id": ids[0], "cell_ids": ids, "cells": len(ids), "label": event["label"],
                              "worker_pid": event["pid"], "host": event["host"], "started": time.time()}
        self.bar.set_description_str(event["label"])
        self._write()

    def end(self, worker, cell_id: str | None = None, counted: bool = True) -> None:
        """A cell of the worker's ended (recorded; counted False: given back, to run again); the worker's entry goes
        once none of its cells is left."""
        entry = self.cells.get(worker)
        if entry and cell_id in entry["cell_ids"]:
            entry["cell_ids"].remove(cell_id)
        if entry is not None and (cell_id is None or not entry["cell_ids"]):
            self.cells.pop(worker)
        if counted:
            self.bar.update(1)
        self._write()

    def started(self, worker) -> float | None:
        return self.cells.get(worker, {}).get("started")

    def in_flight(self, worker) -> list[str]:
        """The worker's cells not yet ended."""
        return list(self.cells.get(worker, {}).get("cell_ids", []))

    def deadline(self, worker, timeout_s: float | None) -> float | None:
        """When the worker's cells run past timeout_s each: timeout_s times the cells it runs together."""
        entry = self.cells.get(worker)
        return None if not timeout_s or entry is None else entry["started"] + timeout_s * entry["cells"]

    def _write(self) -> None:
        from ..store import write_json

        if self.cells:
            write_json(self.run.path / "progress.json", {"in_flight": list(self.cells.values())})
        else:
            (self.run.path / "progress.json").unlink(missing_ok=True)

    def close(self) -> None:
        self.cells.clear()
        self._write()
        self.bar.close()


def shape_sets(cells: list[CellSpec], alone=()) -> list[list[CellSpec]]:
    """The cells by shape (all but the backend and its options), in the order their shapes first come: the cells
    that measure/cell.measure_set times together, their backends interleaved. A cell named in `alone` is a set of
    its own (one of several whose worker died while they ran together: run alone, the one that kills it is found)."""
    sets: dict[tuple, list[CellSpec]] = {}
    for c in cells:
        key = (c.cell_id,) if c.cell_id in alone else (c.model, c.settings, c.width, c.height, c.batch, c.dtype,
                                                       c.device)
        sets.setdefault(key, []).append(c)
    return list(sets.values())


def group_events(cells: list[CellSpec], repeats: int, warmup: int, extra: dict | None = None, trace: bool = False,
                 alone=()):
    """Run cells that share one (model, dtype, device) with one model build, shape by shape (shape_sets): a start
    event naming the shape's cells (cell_ids) before they run together, a done event per cell with its rows (and
    with trace, its trace files: name -> bytes) after them, and an end event with the group's seconds. Every
    executor runs groups so. extra: each cell's, by cell_id; alone: cells each timed on its own."""
    from ..measure.cell import ModelCache, run_set

    t0, cache, host = time.perf_counter(), ModelCache(), socket.gethostname()
    cache.expect(cells)  # the group's fp32 references come first, with one model freed before the first cell's
    done = 0
    for shape in shape_sets(cells, alone):
        cache.keep_only(cells[done:])  # a part no cell left needs (a ControlNet) leaves the device before these
        ids = [c.cell_id for c in shape]
        yield {"event": "start", "cell_id": ids[0], "cell_ids": ids, "label": label(shape[0], len(shape)),
               "pid": os.getpid(), "host": host}
        mine = {c.cell_id: (extra or {}).get(c.cell_id, {}) for c in shape}
        with tempfile.TemporaryDirectory(prefix="attnprof-trace-") if trace else contextlib.nullcontext() as tmp:
            rows = run_set(shape, cache, repeats, warmup, mine, Path(tmp) if tmp else None, full=trace is True)
            files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())} if tmp else {}
        for c, (cell, blocks) in zip(shape, rows):
            cell = with_extra({**cell, "warmup": warmup, "repeats": repeats}, blocks, mine[c.cell_id])  # what the
            # time model admits (planner/kernels.py)
            yield {"event": "done", "cell_id": c.cell_id, "status": cell["status"], "cell": cell, "blocks": blocks,
                   "files": {k: v for k, v in files.items() if k.startswith(c.cell_id)}}
        done += len(shape)
    yield {"event": "end", "seconds": time.perf_counter() - t0}  # the group's time, model build included


def run_group(cells: list[CellSpec], run, repeats: int, warmup: int, emit, extra: dict | None = None,
              trace: bool = False, alone=()) -> None:
    """group_events with each cell recorded where it ran (in this process, or in a local worker)."""
    for event in group_events(cells, repeats, warmup, extra, trace, alone):
        if event["event"] == "done":
            run.record(event.pop("cell"), event.pop("blocks"), event.pop("files"))
        emit(event)


def label(c: CellSpec, together: int = 1) -> str:
    """What a progress bar says of a cell, or of `together` cells of its shape timed together."""
    what = backends.label(c.backend, c.backend_options) if together == 1 else f"{together} backends"
    return f"{c.model} {c.size} b{c.batch} {c.dtype} {what}"


def failed_in_flight(spec: CellSpec, timed_out: bool, timeout_s: float | None, reason: str) -> dict:
    """The row of a cell whose worker died (or was stopped past timeout_s) while it ran."""
    from ..measure.cell import failed_cell

    if timed_out:
        return failed_cell(spec, "timeout", f"cell ran past timeout_s={timeout_s:g} and was stopped")
    return failed_cell(spec, "error", f"worker died: {reason}")


def with_extra(cell: dict, blocks: list[dict], extra: dict) -> dict:
    """The cell's row with its extra merged in, as every writer of a cell row merges it (the group that measured the
    cell, the executor whose worker died in it): the predicted call times go onto the block rows of a measured cell
    (plan/timing.attach), never into the cell row."""
    from ..planner.timing import attach

    merged = attach(cell, blocks, extra)
    if "time_source" in merged:  # the prediction's source; the cell's own time_source is its clock's
        merged["predicted_time_source"] = merged.pop("time_source")
    return {**cell, **merged}
