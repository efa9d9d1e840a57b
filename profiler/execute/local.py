"""The local executor: each group of cells in a worker subprocess (worker.py). A worker that dies leaves its cell in
flight as an `error` row (or `timeout`, when it was stopped for running past timeout_s) and a new worker carries on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..spec import CellSpec

def run_group_in_workers(group: list[CellSpec], run, sweep, bar) -> None:
    """Worker subprocesses for one group. A worker that dies leaves its cell in flight as an `error` row (or
    `timeout`, when the parent killed it for running past timeout_s), and a new worker carries on with the rest."""
    from ..measure.cell import failed_cell
    from ..store import write_json
    from .sweep import on_event

    remaining = list(group)
    while remaining:
        job = {"run": str(run.path), "repeats": sweep.repeats, "warmup": sweep.warmup,
               "cells": [c.as_row() for c in remaining]}
        log = run.path / "worker.log"  # the workers' stderr: library warnings, profiler chatter, crashes
        with open(log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "profiler.execute.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err)
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        in_flight, started = None, None
        finished: set[str] = set()
        try:
            for line in _lines(proc, lambda: started, sweep.timeout_s):
                event = json.loads(line)
                on_event(event, bar)
                if event["event"] == "start":
                    in_flight, started = event["cell_id"], time.time()
                    write_json(run.path / "progress.json", {"cell_id": in_flight, "label": event["label"],
                                                            "worker_pid": proc.pid, "started": started})
                elif event["event"] == "done":
                    finished.add(event["cell_id"])
                    in_flight = started = None
        except TimeoutError:
            proc.kill()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        code = proc.wait()
        (run.path / "progress.json").unlink(missing_ok=True)
        remaining = [c for c in remaining if c.cell_id not in finished]
        if in_flight is not None:
            spec = next(c for c in remaining if c.cell_id == in_flight)
            if started is not None and sweep.timeout_s and time.time() - started >= sweep.timeout_s:
                row = failed_cell(spec, "timeout", f"cell ran past timeout_s={sweep.timeout_s:g} and was stopped")
            else:
                words = _last_line(log) if code != -signal.SIGKILL else ""  # a SIGKILL leaves none
                row = failed_cell(spec, "error", f"worker died: {exit_reason(code)}{words}")
            run.record(row, [])
            bar.update(1)
            remaining.remove(spec)
        elif code != 0 and remaining:
            raise RuntimeError(f"worker exited with {exit_reason(code)} before starting a cell{_last_line(log)}")


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
