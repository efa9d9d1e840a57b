"""The local executor: each group of cells in a worker subprocess (worker.py), or in this process. A worker that dies
in a cell leaves that cell as an `error` row (or `timeout`, when it was stopped for running past timeout_s), unless
it recorded the cell's own row first; a worker that dies in a cell or between two cells is replaced by a new one
that carries on with the rest. On CUDA this process makes no CUDA context: it reads free memory and the
device through NVML and probes availability in a short-lived subprocess, so the workers get the whole budget."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import backends, devices
from ..spec import CellSpec


class LocalExecutor:
    def __init__(self, workers: bool = True):
        self.workers = workers

    def device(self, requested: str) -> str:
        return devices.resolve(requested)

    def free_memory(self, device: str) -> int:
        return devices.free_memory_bytes(device)

    def environment(self, device: str) -> dict:
        from ..store import environment

        return {**environment(device), "executor": "local" if self.workers else "in-process"}

    def availability(self, asks: list[tuple]) -> list[tuple[bool, str]]:
        """(ok, reason) per (backend, device, dtype, head dims): here, or on CUDA in a subprocess of its own."""
        if not (self.workers and any(dev.startswith("cuda") for _, dev, _, _ in asks)):
            return [backends.availability(*a) for a in asks]
        return [tuple(r) for r in _subprocess("--probe", asks, "the availability probe")]

    def limits(self, device: str, dtypes: list[str]) -> dict:
        """The device's measured limits (measure/limits.py): here, or on CUDA in a subprocess of its own."""
        if self.workers and device.startswith("cuda"):
            return _subprocess("--limits", [device, dtypes], "the device limits' measurement")
        from ..measure.limits import device_limits

        return device_limits(device, dtypes)

    def calibrate(self, device: str, when: str) -> dict:
        """The machine's speed now (measure/calibrate.py): here, or on CUDA in a subprocess of its own."""
        if self.workers and device.startswith("cuda"):
            return _subprocess("--calibrate", [device, when], "the calibration")
        from ..measure.calibrate import calibrate

        return calibrate(device, when)

    def run(self, groups: list[list[CellSpec]], run, sweep, flight, extra: dict) -> None:
        from .sweep import run_group

        for group in groups:
            if self.workers:
                _run_in_workers(group, run, sweep, flight, extra)
            else:
                run_group(group, run, sweep.repeats, sweep.warmup, lambda event: _in_process(flight, event), extra,
                          sweep.trace)


def _subprocess(flag: str, payload, what: str):
    """A short-lived worker (worker.py FLAG) that makes the CUDA context this process must not: its JSON answer."""
    proc = subprocess.run([sys.executable, "-m", "profiler.execute.worker", flag], input=json.dumps(payload),
                          text=True, capture_output=True)
    if proc.returncode:
        tail = "; ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{what} exited with {exit_reason(proc.returncode)}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_process(flight, event: dict) -> None:
    if event["event"] == "start":
        flight.start(os.getpid(), event)
    elif event["event"] == "done":
        flight.end(os.getpid())


def _run_in_workers(group: list[CellSpec], run, sweep, flight, extra: dict) -> None:
    """Worker subprocesses for one group, until every cell of it is recorded. A worker that dies between two cells
    is replaced by a new one for the rest; one that dies in a cell leaves that cell `error` (or `timeout`), unless
    the cell's own row was recorded before the worker died, which is kept. A new worker that dies before starting
    any cell means the environment is broken: that raises."""
    from .sweep import failed_in_flight

    remaining, progressed = list(group), True
    while remaining:
        job = {"run": str(run.path), "repeats": sweep.repeats, "warmup": sweep.warmup, "trace": sweep.trace,
               "cells": [c.as_row() for c in remaining], "extra": {c.cell_id: extra.get(c.cell_id, {})
                                                                   for c in remaining}}
        log = run.path / "worker.log"  # the workers' stderr: library warnings, profiler chatter, crashes
        with open(log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "profiler.execute.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err)
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        in_flight, started = None, False
        finished: set[str] = set()
        try:
            for line in _lines(proc, lambda: flight.started(proc.pid), sweep.timeout_s):
                event = json.loads(line)
                if event["event"] == "start":
                    in_flight, started = event["cell_id"], True
                    flight.start(proc.pid, event)
                elif event["event"] == "done":
                    finished.add(event["cell_id"])
                    in_flight = None
                    flight.end(proc.pid)
        except TimeoutError:
            proc.kill()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        code = proc.wait()
        remaining = [c for c in remaining if c.cell_id not in finished]
        if in_flight is not None:
            spec = next(c for c in remaining if c.cell_id == in_flight)
            began = flight.started(proc.pid)
            if not run.recorded_since(spec.cell_id, began):  # its own row, if the worker recorded it, is kept
                timed_out = bool(sweep.timeout_s and began and time.time() - began >= sweep.timeout_s)
                words = _last_line(log) if code != -signal.SIGKILL else ""  # a SIGKILL leaves none
                row = failed_in_flight(spec, timed_out, sweep.timeout_s, f"{exit_reason(code)}{words}")
                run.record({**row, **extra.get(spec.cell_id, {})}, [])
            flight.end(proc.pid)
            remaining.remove(spec)
        elif remaining and not (started or progressed):
            raise RuntimeError(f"worker exited with {exit_reason(code)} before starting a cell{_last_line(log)}")
        progressed = started  # a worker that died between cells is replaced; two that die at once are not


def _lines(proc, started, timeout_s):
    """Lines of the worker's stdout, read unbuffered; TimeoutError when the cell in flight runs past timeout_s."""
    import select

    fd, buf = proc.stdout.fileno(), b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()
        t0 = started()
        wait = None if not timeout_s or t0 is None else max(0.0, t0 + timeout_s - time.time())
        if not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("USDT:")]
    return f"; last words in {log.name}: {lines[-1].strip()[:200]}" if lines else ""


def exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (killed: the OOM killer or a kill)" if name == "SIGKILL" else ""
        return f"signal {name}{hint}"
    return f"exit code {code}"
