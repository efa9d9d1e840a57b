"""The Ray executor: the sweep's groups as Ray tasks on the GPUs (or CPUs) of one box or many hosts.

- Groups of one (model, dtype, device) are cut into chunks so that every GPU has work (round robin within a group,
  so that chunks cost about the same); each chunk is one task holding one GPU (num_gpus=1; on a CPU-only cluster,
  one CPU) that builds its model once and streams a start event and then the rows of each cell as it ends (a Ray
  generator task). This process, the driver, records them: results reach the run folder from any host, with no
  shared disk. The code travels to the workers as Ray's working_dir (the repository without .venv, .git, results).
- A task that dies (worker killed, node lost) leaves its cell in flight as `error` with Ray's reason, and the rest
  of its chunk goes on in a new task; a cell past timeout_s has its task cancelled and ends `timeout`. Tasks are
  never retried by Ray (max_retries=0): no cell is measured twice.
- Availability, free memory and the environment are asked of a task on a GPU (or CPU) of the cluster, before any
  model is built.
"""
from __future__ import annotations

import os
import time

import ray

from ..devices import NVTX_ENV
from ..unet.checkpoint import PICKLE_ENV
from ..env import REPO
from ..spec import CellSpec, InputError
from . import ExecutorError, stop_on_sigterm

EXCLUDES = ["results", "test-output", ".whl", "*.parquet", "**/__pycache__"]  # Ray leaves out .git and .venv


def connect(address: str | None = None, excludes: tuple[str, ...] = (), num_cpus: int | None = None) -> None:
    """Join the Ray cluster at address ('auto': the one this machine runs), or with None the one this machine runs
    if any, else start a local one. Token authentication stays on: Ray turns it on for the local clusters it starts
    and for clients where a token exists (~/.ray/auth_token); `attnprof serve` starts its head with it."""
    if ray.is_initialized():
        return
    env_vars = {"ATTNPROF_PLUGINS": os.environ.get("ATTNPROF_PLUGINS", ""), "PYTHONUNBUFFERED": "1",
                PICKLE_ENV: os.environ.get(PICKLE_ENV, ""),  # --allow-pickle's leave, for the cells' workers
                NVTX_ENV: os.environ.get(NVTX_ENV, "")}  # and --nvtx's
    runtime_env = {"working_dir": str(REPO), "excludes": EXCLUDES + list(excludes), "env_vars": env_vars}
    if os.environ.get("ATTNPROF_JOB_ID"):  # a queued job: its runtime env (code, config, plugins) is the tasks' too
        runtime_env = None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=True,
                 runtime_env=runtime_env, **({"num_cpus": num_cpus} if num_cpus else {}))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise InputError(f"cannot reach the Ray cluster at {address or 'this machine'} "
                         f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}): start one with "
                         "ray start --head, or leave out the address for a local one") from None
    stop_on_sigterm()  # Ray's driver would exit on SIGTERM: ours ends the sweep as Ctrl-C does


def _resources(device: str) -> dict:
    return {"num_gpus": 1} if device == "cuda" else {"num_cpus": 1}


@ray.remote(max_retries=0)
def _survey(device: str) -> dict:
    """On a worker: the device's free memory (before this task touches it) and the environment."""
    from .. import devices
    from ..env import environment

    return {"free": devices.free_memory_bytes(device), "environment": environment(device)}


@ray.remote(max_retries=0)
def _availability(asks: list) -> list:
    from ..attention.backends import availability

    return [availability(name, dev, dtype, tuple(dims)) for name, dev, dtype, dims in asks]


@ray.remote(max_retries=0)
def _limits(device: str, dtypes: list[str]) -> dict:
    from .. import devices
    from ..measure.limits import device_limits

    devices.keep_memory()  # as the cells' processes (devices.keep_memory)
    return device_limits(device, dtypes)


@ray.remote(max_retries=0)
def _calibrate(device: str, when: str) -> dict:
    from ..measure.calibrate import calibrate

    return calibrate(device, when)


@ray.remote(max_retries=0)
def _group(rows: list[dict], repeats: int, warmup: int, extra: dict, trace: bool, alone: list):
    """A Ray generator task: one chunk of cells with one model build, as group_events yields them (with trace,
    each done event carries the cell's trace files: the driver stores them, so no disk need be shared)."""
    from .groups import group_events

    yield from group_events([CellSpec.from_row(r) for r in rows], repeats, warmup, extra, trace, set(alone))


def split(groups: list[list[CellSpec]], slots: int) -> list[list[CellSpec]]:
    """Cut the groups into chunks, about one per slot in proportion to their sizes, round robin within a group by
    shape (groups.shape_sets): the backends of one shape stay in one chunk, timed together in one worker."""
    from .groups import shape_sets

    total = sum(len(g) for g in groups)
    chunks = []
    for g in groups:
        shapes = shape_sets(g)
        k = max(1, min(len(shapes), round(slots * len(g) / total))) if total else 1
        chunks += [[c for shape in shapes[i::k] for c in shape] for i in range(k)]
    return chunks


class RayExecutor:
    def __init__(self, address: str | None, out: str | None = None):
        excludes = ()
        if out and os.path.abspath(out).startswith(str(REPO) + os.sep):  # never upload the results themselves
            excludes = (os.path.relpath(os.path.abspath(out), REPO),)
        connect(address, excludes)
        self.address = address
        self._survey = None

    def device(self, requested: str) -> str:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if requested.startswith("cuda:"):
            raise InputError(f"device {requested!r} with Ray: give cuda (or auto): Ray gives each task its GPU")
        if requested == "cuda" and not gpus:
            raise InputError("device 'cuda': the Ray cluster has no GPU: use device cpu or auto")
        return ("cuda" if gpus else "cpu") if requested == "auto" else requested

    def survey(self, device: str) -> dict:
        if self._survey is None:
            self._survey = ray.get(_survey.options(**_resources(device)).remote(device))
        return self._survey

    def free_memory(self, device: str) -> int:
        return self.survey(device)["free"]

    def environment(self, device: str) -> dict:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        res = ray.cluster_resources()
        return {**self.survey(device)["environment"], "executor": "ray", "ray_address": self.address,
                "ray_version": ray.__version__, "ray_nodes": len(nodes), "ray_gpus": int(res.get("GPU", 0)),
                "ray_cpus": int(res.get("CPU", 0))}

    def limits(self, device: str, dtypes: list[str]) -> dict:
        """Measured on a GPU (or CPU) of the cluster, as its cells run: on a cluster of mixed devices, one of them."""
        return ray.get(_limits.options(**_resources(device)).remote(device, dtypes))

    def calibrate(self, device: str, when: str) -> dict:
        """The speed of a GPU (or CPU) of the cluster now, as its cells run (measure/calibrate.py)."""
        return ray.get(_calibrate.options(**_resources(device)).remote(device, when))

    def availability(self, asks: list[tuple]) -> list[tuple[bool, str]]:
        if not asks:
            return []
        return [tuple(r) for r in ray.get(_availability.options(**_resources(asks[0][1])).remote(asks))]

    def slots(self, device: str) -> int:
        res = ray.cluster_resources()
        return max(1, int(res.get("GPU", 0) if device == "cuda" else res.get("CPU", 1)))

    def run(self, groups: list[list[CellSpec]], run, sweep, flight, extra: dict) -> None:
        if groups:
            run_chunks(split(groups, self.slots(groups[0][0].device)), run, sweep, flight, extra)


def run_chunks(chunks: list[list[CellSpec]], run, sweep, flight, extra: dict | None = None) -> list[float]:
    """Run the chunks as Ray tasks, recording each cell as it ends; returns the seconds each task spent on its
    chunk, model build included (for the bench)."""
    tasks = _Tasks(run, sweep, flight, extra or {})
    for chunk in chunks:
        tasks.submit(chunk)
    try:
        while tasks.active:
            ready, _ = ray.wait(list(tasks.active), num_returns=1, timeout=1.0)
            for gen in ready:
                tasks.step(gen)
            tasks.stop_overdue()
    except BaseException:
        for gen in tasks.active:
            ray.cancel(gen, force=True)
        raise
    return tasks.seconds


class _Tasks:
    """The running tasks: each a generator with its cells not yet recorded and the cell in flight."""

    def __init__(self, run, sweep, flight, extra: dict):
        self.run, self.sweep, self.flight, self.extra = run, sweep, flight, extra
        self.active: dict = {}
        self.seconds: list[float] = []

    def submit(self, cells: list[CellSpec], retry: int = 0, alone=()) -> None:
        gen = _group.options(**_resources(cells[0].device)).remote(
            [c.as_row() for c in cells], self.sweep.repeats, self.sweep.warmup,
            {c.cell_id: self.extra.get(c.cell_id, {}) for c in cells}, self.sweep.trace, sorted(alone))
        self.active[gen] = {"cells": list(cells), "cancelled": False, "retry": retry, "alone": set(alone)}

    def step(self, gen) -> None:
        from .groups import failed_in_flight, with_extra

        state = self.active[gen]
        try:
            event = ray.get(next(gen))
        except StopIteration:
            del self.active[gen]
            return
        except ray.exceptions.RayError as e:  # the worker died, its node was lost, or a timeout cancelled it
            del self.active[gen]
            reason = f"Ray: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            in_flight = self.flight.in_flight(id(gen))
            died = [c for c in state["cells"] if c.cell_id in in_flight]
            if len(died) > 1:  # several ran together: each again on its own (groups.shape_sets' alone)
                for spec in died:
                    self.flight.end(id(gen), spec.cell_id, counted=False)
                self.submit(state["cells"], alone=state["alone"] | set(in_flight))
                return
            rest = [c for c in state["cells"] if c.cell_id not in in_flight]
            for spec in died:
                row = failed_in_flight(spec, state["cancelled"], self.sweep.timeout_s, reason)
                self.run.record(with_extra(row, [], self.extra.get(spec.cell_id, {})), [])
                self.flight.end(id(gen), spec.cell_id)
            if not died and state["retry"]:
                raise ExecutorError(f"a Ray task failed twice before starting a cell: {reason}") from None
            if rest:
                self.submit(rest, retry=0 if died else 1, alone=state["alone"])
            return
        if event["event"] == "start":
            self.flight.start(id(gen), event)
        elif event["event"] == "end":
            self.seconds.append(event["seconds"])
        else:
            self.run.record(event["cell"], event["blocks"], event["files"])
            state["cells"] = [c for c in state["cells"] if c.cell_id != event["cell_id"]]
            self.flight.end(id(gen), event["cell_id"])

    def stop_overdue(self) -> None:
        """Cancel (killing its worker) each task whose cell has run past timeout_s."""
        if not self.sweep.timeout_s:
            return
        for gen, state in self.active.items():
            deadline = self.flight.deadline(id(gen), self.sweep.timeout_s)
            if deadline and not state["cancelled"] and time.time() >= deadline:
                ray.cancel(gen, force=True)
                state["cancelled"] = True
