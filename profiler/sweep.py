"""Sweeps: the cartesian grid of a YAML config (or of `attnprof run`'s arguments), validated whole before any model
is built, run group by group (one model build per (model, dtype, device)) in worker subprocesses, each cell recorded
when it ends, resumable, failures kept as rows."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from . import backends, devices, models
from .spec import CellSpec, InputError, parse_batch, parse_dtype, parse_size

KEYS = {"models": "list of model names", "sizes": "list of WxH strings", "batch": "list of batch sizes",
        "dtypes": "list of dtype names", "backends": "list of backend names or {name: {option: value}}",
        "repeats": "timed forwards per cell", "warmup": "warm-up forwards per cell",
        "device": "auto, cpu, cuda or cuda:N", "out": "results folder",
        "memory_budget": "bytes or a string such as 20GiB", "timeout_s": "seconds per cell"}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


@dataclass(frozen=True)
class Sweep:
    models: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...] = ((512, 512),)
    batch: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("float16",)
    backends: tuple[tuple[str, tuple], ...] = (("sdpa", ()),)
    repeats: int = 3
    warmup: int = 1
    device: str = "auto"
    out: str = "results"
    memory_budget: int | None = None
    timeout_s: float | None = None
    source: str = field(default="command line", compare=False)

    def resolved_device(self) -> str:
        return devices.resolve(self.device)

    def cells(self) -> list[CellSpec]:
        device = self.resolved_device()
        return [CellSpec(m, w, h, b, dt, name, device, opts)
                for m in self.models for dt in self.dtypes for (w, h) in self.sizes for b in self.batch
                for name, opts in self.backends]

    def settings(self) -> dict:
        return {"models": list(self.models), "sizes": [f"{w}x{h}" for w, h in self.sizes], "batch": list(self.batch),
                "dtypes": list(self.dtypes), "backends": [[n, dict(o)] for n, o in self.backends],
                "repeats": self.repeats, "warmup": self.warmup, "device": self.device,
                "memory_budget": self.memory_budget, "timeout_s": self.timeout_s, "source": self.source}


def parse_bytes(value, where: str) -> int:
    if isinstance(value, bool):
        raise InputError(f"{where}: {value!r} is not a size: write bytes or a string such as 20GiB")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{where}: {value!r} is not a size: write bytes or a string such as 20GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _as_list(doc: dict, key: str, where: str) -> list:
    value = doc[key]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: key '{key}' must be a non-empty {KEYS[key]}, not {value!r}")
    return value


def _checked(where: str, key: str, fn, value):
    try:
        return fn(value)
    except InputError as e:
        raise InputError(f"{where}: key '{key}': {e}") from None


def _backend_entry(entry, where: str) -> tuple[str, tuple]:
    if isinstance(entry, str):
        name, options = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, options = next(iter(entry.items()))
        if not isinstance(options, dict):
            raise InputError(f"{where}: key 'backends': options of {name!r} must be a mapping, e.g. "
                             f"{{{name}: {{slice_size: 4}}}}")
    else:
        raise InputError(f"{where}: key 'backends': {entry!r} is not a name or {{name: {{option: value}}}}")
    options = _checked(where, "backends", lambda o: backends.check_options(name, o), options)
    return name, tuple(sorted(options.items()))


def _positive_int(value, where: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{where}: key '{key}' must be a whole number >= {minimum}, not {value!r}")
    return value


def load(path: str | Path) -> Sweep:
    """Read and validate a sweep YAML: every key, name and size, before any model is built."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise InputError(f"sweep config {path} does not exist: see configs/sweeps/ for examples")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a mapping of keys ({', '.join(KEYS)})")
    unknown = [k for k in doc if k not in KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key '{unknown[0]}': the keys are {', '.join(KEYS)}")
    if "models" not in doc:
        raise InputError(f"{where}: key 'models' is missing: list one or more of {', '.join(models.known_models())}")
    kw = {"source": where}
    kw["models"] = tuple(str(m) for m in _as_list(doc, "models", where))
    for m in kw["models"]:
        _checked(where, "models", models.resolve, m)
    if "sizes" in doc:
        sizes = _as_list(doc, "sizes", where)
        if not all(isinstance(s, str) for s in sizes):
            raise InputError(f"{where}: key 'sizes' must be a list of WxH strings such as \"512x512\", not {sizes!r}")
        kw["sizes"] = tuple(_checked(where, "sizes", parse_size, s) for s in sizes)
    if "batch" in doc:
        batch = _as_list(doc, "batch", where)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in batch):
            raise InputError(f"{where}: key 'batch' must be a list of whole numbers such as [1, 2], not {batch!r}")
        kw["batch"] = tuple(_checked(where, "batch", parse_batch, b) for b in batch)
    if "dtypes" in doc:
        kw["dtypes"] = tuple(_checked(where, "dtypes", parse_dtype, d) for d in _as_list(doc, "dtypes", where))
    if "backends" in doc:
        kw["backends"] = tuple(_backend_entry(b, where) for b in _as_list(doc, "backends", where))
    for key, minimum in (("repeats", 1), ("warmup", 0)):
        if key in doc:
            kw[key] = _positive_int(doc[key], where, key, minimum)
    if "device" in doc:
        kw["device"] = devices.parse(doc["device"], where)
    if "out" in doc:
        if not isinstance(doc["out"], str) or not doc["out"]:
            raise InputError(f"{where}: key 'out' must be a folder path, not {doc['out']!r}")
        kw["out"] = doc["out"]
    if doc.get("memory_budget") is not None:
        kw["memory_budget"] = parse_bytes(doc["memory_budget"], f"{where}: key 'memory_budget'")
    if doc.get("timeout_s") is not None:
        t = doc["timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise InputError(f"{where}: key 'timeout_s' must be a positive number of seconds, not {t!r}")
        kw["timeout_s"] = float(t)
    return Sweep(**kw)


def plans_of(cells: list[CellSpec]) -> dict[tuple, dict]:
    """The meta-device plan of each (model, width, height, batch, dtype) of the cells."""
    from .plan import plan

    plans = {}
    for c in cells:
        key = (c.model, c.width, c.height, c.batch, c.dtype)
        if key not in plans:
            plans[key] = plan(c.model, c.width, c.height, c.batch, c.dtype)
    return plans


def predicted_cell_peaks(cells: list[CellSpec], plans: dict | None = None) -> dict[str, int]:
    """cell_id -> predicted bytes the cell needs (plan.predicted_need_bytes, with the fp32 reference copy)."""
    from .plan import predicted_need_bytes

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
        proc = subprocess.run([sys.executable, "-m", "profiler.worker", "--probe"], input=json.dumps(asks),
                              text=True, capture_output=True)
        if proc.returncode:
            tail = "; ".join(proc.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"the availability probe exited with {_exit_reason(proc.returncode)}: {tail}")
        answers = dict(zip(asks, map(tuple, json.loads(proc.stdout.strip().splitlines()[-1])), strict=True))
    else:
        answers = {a: backends.availability(*a) for a in asks}
    return {cid: answers[a] for cid, a in ask.items()}


def preflight(cells: list[CellSpec], budget: int, force: bool, isolated: bool = False) -> dict[str, dict]:
    """cell_id -> failure row for the cells that must not run: backend unavailable, or predicted over budget."""
    from .fmt import human_bytes
    from .runner import failed_cell

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
    from .store import Run, environment, now

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
                _run_group_in_workers(group, run, sweep, bar)
            else:
                run_group(group, run, sweep.repeats, sweep.warmup, lambda e: _on_event(e, bar))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        run.update_manifest(ended_at=now(), interrupted=interrupted)
    return Outcome(run.path, interrupted)


def _find_resumable(sweep: Sweep):
    from .store import Run, list_runs

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


def _on_event(event: dict, bar) -> None:
    if event["event"] == "start":
        bar.set_description_str(event["label"])
    elif event["event"] == "done":
        bar.update(1)


def run_group(cells: list[CellSpec], run, repeats: int, warmup: int, emit) -> None:
    """Run cells that share one (model, dtype, device) with one model build; record each as it ends."""
    from .runner import ModelCache, run_cell

    cache = ModelCache()
    for c in cells:
        emit({"event": "start", "cell_id": c.cell_id, "label": _label(c)})
        cell, blocks = run_cell(c, cache, repeats, warmup)
        run.record(cell, blocks)
        emit({"event": "done", "cell_id": c.cell_id, "status": cell["status"]})


def _label(c: CellSpec) -> str:
    return f"{c.model} {c.size} b{c.batch} {c.dtype} {c.backend}"


def _run_group_in_workers(group: list[CellSpec], run, sweep: Sweep, bar) -> None:
    """Worker subprocesses for one group. A worker that dies leaves its cell in flight as an `error` row (or
    `timeout`, when the parent killed it for running past timeout_s), and a new worker carries on with the rest."""
    from .runner import failed_cell
    from .store import write_json

    remaining = list(group)
    while remaining:
        job = {"run": str(run.path), "repeats": sweep.repeats, "warmup": sweep.warmup,
               "cells": [c.as_row() for c in remaining]}
        log = run.path / "worker.log"  # the workers' stderr: library warnings, profiler chatter, crashes
        with open(log, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "profiler.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err)
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        in_flight, started = None, None
        finished: set[str] = set()
        try:
            for line in _lines(proc, lambda: started, sweep.timeout_s):
                event = json.loads(line)
                _on_event(event, bar)
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
                row = failed_cell(spec, "error", f"worker died: {_exit_reason(code)}{words}")
            run.record(row, [])
            bar.update(1)
            remaining.remove(spec)
        elif code != 0 and remaining:
            raise RuntimeError(f"worker exited with {_exit_reason(code)} before starting a cell{_last_line(log)}")


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


def _exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (killed: the OOM killer or a kill)" if name == "SIGKILL" else ""
        return f"signal {name}{hint}"
    return f"exit code {code}"


def with_overrides(sweep: Sweep, **changes) -> Sweep:
    return replace(sweep, **{k: v for k, v in changes.items() if v is not None})
