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
    worker's pid and host) and the progress bar shows the latest."""

    def __init__(self, run, bar):
        self.run, self.bar, self.cells = run, bar, {}

    def start(self, worker, event: dict) -> None:
        self.cells[worker] = {"cell_id": event["cell_id"], "label": event["label"], "worker_pid": event["pid"],
                              "host": event["host"], "started": time.time()}
        self.bar.set_description_str(event["label"])
        self._write()

    def end(self, worker) -> None:
        self.cells.pop(worker, None)
        self.bar.update(1)
        self._write()

    def started(self, worker) -> float | None:
        return self.cells.get(worker, {}).get("started")

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


def group_events(cells: list[CellSpec], repeats: int, warmup: int, extra: dict | None = None, trace: bool = False):
    """Run cells that share one (model, dtype, device) with one model build: a start event before each cell, a done
    event with its rows (and with trace, its trace files: name -> bytes) after it, and an end event with the group's
    seconds. Every executor runs groups so. extra: each cell's, by cell_id."""
    from ..measure.cell import ModelCache, run_cell

    t0, cache, host = time.perf_counter(), ModelCache(), socket.gethostname()
    cache.expect(cells)  # the group's fp32 references come first, with one model freed before the first cell's
    for i, c in enumerate(cells):
        cache.keep_only(cells[i:])  # a part no cell left needs (a ControlNet) leaves the device before this cell
        yield {"event": "start", "cell_id": c.cell_id, "label": label(c), "pid": os.getpid(), "host": host}
        mine = (extra or {}).get(c.cell_id, {})
        with tempfile.TemporaryDirectory(prefix="attnprof-trace-") if trace else contextlib.nullcontext() as tmp:
            cell, blocks = run_cell(c, cache, repeats, warmup, mine, Path(tmp) if tmp else None)
            files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())} if tmp else {}
        cell = with_extra({**cell, "warmup": warmup, "repeats": repeats}, blocks, mine)  # what the time model admits
        yield {"event": "done", "cell_id": c.cell_id, "status": cell["status"], "cell": cell, "blocks": blocks,
               "files": files}
    yield {"event": "end", "seconds": time.perf_counter() - t0}  # the group's time, model build included


def run_group(cells: list[CellSpec], run, repeats: int, warmup: int, emit, extra: dict | None = None,
              trace: bool = False) -> None:
    """group_events with each cell recorded where it ran (in this process, or in a local worker)."""
    for event in group_events(cells, repeats, warmup, extra, trace):
        if event["event"] == "done":
            run.record(event.pop("cell"), event.pop("blocks"), event.pop("files"))
        emit(event)


def label(c: CellSpec) -> str:
    return f"{c.model} {c.size} b{c.batch} {c.dtype} {backends.label(c.backend, c.backend_options)}"


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

    return {**cell, **attach(cell, blocks, extra)}
