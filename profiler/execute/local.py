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
import tempfile
import time
from pathlib import Path

from ..attention import backends
from .. import devices
from ..spec import CellSpec
from . import ExecutorError


class LocalExecutor:
    def __init__(self, workers: bool = True):
        self.workers = workers

    def device(self, requested: str) -> str:
        return devices.resolve(requested)

    def free_memory(self, device: str) -> int:
        return devices.free_memory_bytes(device)

    def environment(self, device: str) -> dict:
        from ..env import environment

        return {**environment(device), "executor": "local" if self.workers else "in-process"}

    def availability(self, asks: list[tuple]) -> list[tuple[bool, str]]:
        """(ok, reason) per (backend, device, dtype, head dims): here, or on CUDA in subprocesses (probe_apart)."""
        if not (self.workers and any(dev.startswith("cuda") for _, dev, _, _ in asks)):
            return [backends.availability(*a) for a in asks]
        return probe_apart(asks)

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
        from .groups import run_group

        for group in groups:
            if self.workers:
                _run_in_workers(group, run, sweep, flight, extra)
            else:
                run_group(group, run, sweep.repeats, sweep.warmup, lambda event: _in_process(flight, event), extra,
                          sweep.trace)


def _subprocess(flag: str, payload, what: str):
    """A short-lived worker (worker.py FLAG) that makes the CUDA context this process must not: its JSON answer."""
    answer = _answers([_start(flag, payload)], [what])[0]
    if isinstance(answer, ExecutorError):
        raise answer
    return answer


def _start(flag: str, payload) -> subprocess.Popen:
    """A worker subprocess started on its job; its stdout and stderr go to files, read when it ends."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "profiler.execute.worker", flag], stdin=subprocess.PIPE,
                            stdout=out, stderr=err)
    proc.stdin.write(json.dumps(payload).encode())
    proc.stdin.close()
    proc.outputs = (out, err)
    return proc


def _answers(procs: list[subprocess.Popen], whats: list[str]) -> list:
    """Each subprocess's JSON answer (its last line on stdout), or for one that failed an ExecutorError saying
    how (returned, not raised: the others' answers stand)."""
    answers = []
    for proc, what in zip(procs, whats):
        code = proc.wait()
        stdout, stderr = (f.seek(0) or f.read().decode(errors="replace") for f in proc.outputs)
        for f in proc.outputs:
            f.close()
        lines = stdout.strip().splitlines()
        if code or not lines:
            tail = "; ".join(stderr.strip().splitlines()[-3:])
            answers.append(ExecutorError(f"{what} exited with {exit_reason(code)}: {tail}"))
        else:
            answers.append(json.loads(lines[-1]))
    return answers


def _isolation(name: str) -> str:
    """Which asks share one probe subprocess: the backends of torch and diffusers alone (naive, chunked, SDPA's
    kernels, diffusers' native ones) together; every other backend (an extension, a compiler, a plugin) apart."""
    b = backends.BACKENDS[name]
    native = b.family in (backends.MATERIALISED, backends.CHUNKED) or b.uses_sdpa
    return "torch" if native and not b.needs.package else name


def probe_apart(asks: list[tuple]) -> list[tuple[bool, str]]:
    """(ok, reason) per ask, probed in subprocesses that run side by side, so that no probe can change another's
    answer: the torch-native backends in one, every other backend in one of its own (a sticky CUDA error or a crash
    stays with its backend). Where the shared one dies, its backends are probed again one each: only the one that
    kills its process is unavailable, with how it died."""
    groups: dict[str, list[int]] = {}
    for i, ask in enumerate(asks):
        groups.setdefault(_isolation(ask[0]), []).append(i)
    answers: dict[int, tuple] = {}
    while groups:
        keys = list(groups)
        results = _answers([_start("--probe", [asks[i] for i in groups[k]]) for k in keys],
                           [f"the availability probe of {k}" for k in keys])
        retry = {}
        for key, result in zip(keys, results):
            members = groups[key]
            if not isinstance(result, ExecutorError):
                answers.update(zip(members, map(tuple, result)))
            elif len({asks[i][0] for i in members}) > 1:  # probed again, one backend a subprocess
                for i in members:
                    retry.setdefault(asks[i][0], []).append(i)
            else:
                answers.update((i, (False, f"its availability probe died: {result}")) for i in members)
        groups = retry
    return [answers[i] for i in range(len(asks))]


def _in_process(flight, event: dict) -> None:
    if event["event"] == "start":
        flight.start(os.getpid(), event)
    elif event["event"] == "done":
        flight.end(os.getpid(), event["cell_id"])


def _run_in_workers(group: list[CellSpec], run, sweep, flight, extra: dict) -> None:
    """Worker subprocesses for one group, until every cell of it is recorded. A worker that dies between two cells
    is replaced by a new one for the rest; one that dies while one cell runs leaves that cell `error` (or `timeout`),
    unless the cell's own row was recorded before the worker died, which is kept. Where it dies while several cells
    of a shape run together, those run again each on its own (the one that kills its worker is found so). A new
    worker that dies before starting any cell means the environment is broken: that raises."""
    remaining, progressed, alone = list(group), True, set()
    while remaining:
        job = {"run": str(run.path), "repeats": sweep.repeats, "warmup": sweep.warmup, "trace": sweep.trace,
               "cells": [c.as_row() for c in remaining], "alone": sorted(alone),
               "extra": {c.cell_id: extra.get(c.cell_id, {}) for c in remaining}}
        log = run.path / "worker.log"  # the workers' stderr: library warnings, profiler chatter, crashes
        with open(log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "profiler.execute.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err)
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        started = False
        finished: set[str] = set()
        try:
            for line in _lines(proc, lambda: flight.deadline(proc.pid, sweep.timeout_s)):
                event = _event(line, log)
                if event is None:
                    continue
                if event["event"] == "start":
                    started = True
                    flight.start(proc.pid, event)
                elif event["event"] == "done":
                    finished.add(event["cell_id"])
                    flight.end(proc.pid, event["cell_id"])
        except TimeoutError:
            proc.kill()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        code = proc.wait()
        remaining = [c for c in remaining if c.cell_id not in finished]
        remaining, again = _after_worker(proc.pid, code, remaining, run, sweep, flight, extra, log)
        alone |= again
        if remaining and not (started or progressed) and not again:
            raise ExecutorError(f"a sweep worker exited with {exit_reason(code)} before starting a cell"
                                f"{_last_line(log)} (its log: {log})")
        progressed = started  # a worker that died between cells is replaced; two that die at once are not


def _after_worker(pid: int, code: int, remaining: list, run, sweep, flight, extra: dict, log: Path):
    """The cells a worker that ended still had in flight: those it recorded are kept; several that ran together run
    again each on its own (returned); one alone gets its failure's row. (the cells left, the ones to run alone)"""
    from .groups import failed_in_flight, with_extra

    in_flight, began = flight.in_flight(pid), flight.started(pid)
    for cell_id in [c for c in in_flight if run.recorded_since(c, began)]:  # its own row, recorded, is kept
        in_flight.remove(cell_id)
        flight.end(pid, cell_id)
        remaining = [c for c in remaining if c.cell_id != cell_id]
    if len(in_flight) > 1:  # several ran together: each again on its own
        for cell_id in in_flight:
            flight.end(pid, cell_id, counted=False)
        return remaining, set(in_flight)
    if in_flight:
        deadline = flight.deadline(pid, sweep.timeout_s)
        timed_out = bool(deadline and time.time() >= deadline)
        words = _last_line(log) if code != -signal.SIGKILL else ""  # a SIGKILL leaves none
        spec = next(c for c in remaining if c.cell_id == in_flight[0])
        row = failed_in_flight(spec, timed_out, sweep.timeout_s, f"{exit_reason(code)}{words}")
        run.record(with_extra(row, [], extra.get(spec.cell_id, {})), [])
        flight.end(pid, spec.cell_id)
        remaining = [c for c in remaining if c is not spec]
    return remaining, set()


def _event(line: str, log: Path) -> dict | None:
    """One event of the worker's stream; a line that is not one (the worker writes its events on a descriptor of
    its own, so none should come) goes to the log, not into a crash of the sweep."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if isinstance(event, dict) and "event" in event:
        return event
    with open(log, "a") as f:
        f.write(f"not an event on the worker's stream: {line[:500]}\n")
    return None


def _lines(proc, deadline):
    """Lines of the worker's stdout, read unbuffered; TimeoutError when the cells in flight run past their
    deadline (deadline(): when, or None where none runs or none is set)."""
    import select

    fd, buf = proc.stdout.fileno(), b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()
        end = deadline()
        wait = None if end is None else max(0.0, end - time.time())
        if not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk


def _last_line(log: Path) -> str:
    """The worker's last words in its log: faulthandler's 'Fatal Python error: ...' where a crash left one (its
    trace follows it in the log, and a list of extension modules after that), else the last line."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("USDT:")]
    fatal = [ln for ln in lines if ln.startswith("Fatal Python error")]
    return f"; last words in {log.name}: {(fatal or lines)[-1].strip()[:200]}" if lines else ""


def exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (killed: the OOM killer or a kill)" if name == "SIGKILL" else ""
        return f"signal {name}{hint}"
    return f"exit code {code}"
