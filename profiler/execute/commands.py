"""The commands that run a sweep (attnprof run, sweep, profile): the sweep from the command line's parsed values, run
with its overrides, then its cells' table, findings and where the run is; the exit code says whether a cell ended
ok."""
from __future__ import annotations

import sys
from pathlib import Path

from ..spec import InputError, parse_bytes, parse_options
from . import NO_CELL_OK
from .grid import Sweep, load, maps_elsewhere, with_overrides


def run_sweep(model, size, batch, dtype, backend, option, device, repeats, warmup, out, timeout_s, memory_budget,
              given) -> Sweep:
    """attnprof run's sweep: one model, its sizes and backends (a map file: tuned, with its map), checked."""
    from .. import devices
    from ..attention import backends
    from ..unet import models
    from ..unet.workload import check_settings

    entries = []
    for name in backend or ["sdpa"]:
        name, options = backends.cell_backend(name, parse_options(option))  # a map file: tuned, its map
        entries.append((name, tuple(sorted(options.items()))))
    sizes, batch, dtype_ = devices.given_shape(size, batch, dtype, devices.parse(device, "--device"))
    models.resolve(model)
    maps_elsewhere(backend or [], (model,), sizes, "attnprof run")
    for key, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if value < least:
            raise InputError(f"--{key} {value} is too small: use {least} or more")
    settings = check_settings(model, given)
    return Sweep(models=(model,), sizes=tuple(sizes), batch=(batch,), dtypes=(dtype_,) if dtype else (),
                 backends=tuple(entries), repeats=repeats, warmup=warmup, device=devices.parse(device, "--device"),
                 out=out, timeout_s=timeout_s, model_settings=tuple((n, (v,)) for n, v in settings),
                 memory_budget=parse_bytes(memory_budget, "--memory-budget") if memory_budget else None)


def run(model, size, batch, dtype, backend, option, device, repeats, warmup, out, timeout_s, memory_budget, given,
        trace, ray, in_process, force, quiet, resume) -> int:
    """attnprof run: the sweep of one model (run_sweep), run."""
    return execute(run_sweep(model, size, batch, dtype, backend, option, device, repeats, warmup, out, timeout_s,
                             memory_budget, given), out, trace, ray, in_process, force, quiet, resume)


def sweep(config, out, trace, ray, in_process, force, quiet, resume, retry_failed) -> int:
    """attnprof sweep: a sweep config, run."""
    return execute(load(config), out, trace, ray, in_process, force, quiet, resume, retry_failed)


def profile(out, trace, ray, in_process, force, quiet, resume, retry_failed) -> int:
    """attnprof profile: the built-in default sweep for this machine (a GPU's, else the CPU's), run."""
    import torch

    from ..env import configs

    config = configs() / "sweeps" / ("default.yaml" if torch.cuda.is_available() else "cpu-default.yaml")
    print(f"attnprof profile: the built-in default sweep for this machine, {config.relative_to(Path.cwd())}"
          if config.is_relative_to(Path.cwd()) else f"attnprof profile: {config}", flush=True)
    return execute(load(config), out, trace, ray, in_process, force, quiet, resume, retry_failed)


def execute(sweep, out, trace, ray, in_process, force, quiet, resume=False, retry_failed=False) -> int:
    """The sweep run with the command line's --out, --trace and --ray over its own settings; what came out printed."""
    from ..fmt import typed
    from ..report.findings import findings, format_findings
    from ..report.show import status_table
    from ..store import Run
    from .sweep import execute as run_cells

    where = {} if ray is None else {"executor": "ray", "ray_address": ray or None}
    if where and in_process:
        raise InputError("--ray and --in-process exclude each other: choose where the cells run")
    sweep = with_overrides(with_overrides(sweep, out=out, trace=trace or None), **where)
    outcome = run_cells(sweep, resume=resume, retry_failed=retry_failed, force=force, workers=not in_process,
                        progress=not quiet, command=typed())
    run = Run.open(outcome.run_path)
    print(status_table(run))
    _print_versus(run)
    found = findings(*run.read(), run.manifest())
    if found:
        print(f"\nfindings:\n{format_findings(found)}")
    print(f"\nresults: {outcome.run_path}")
    print(f"  summary:   attnprof show {outcome.run_path.name} --results {outcome.run_path.parent}")
    print(f"  dashboard: make dashboard  (or attnprof dashboard --results {outcome.run_path.parent})")
    if outcome.interrupted:
        print(f"interrupted: the cells recorded so far are kept; run again with --resume to finish: "
              f"{resume_command(sys.argv[1:])}", file=sys.stderr)
        return 130
    cells = run.cells()
    if not len(cells) or not (cells["status"] == "ok").any():
        print(f"attnprof: no cell ended ok: see the errors with attnprof show {run.id} --results {run.path.parent}",
              file=sys.stderr, flush=True)
        return NO_CELL_OK
    return 0


def resume_command(argv: list[str]) -> str:
    """The command line that finishes an interrupted run, sweep or profile: the one given, with --resume."""
    import shlex

    return shlex.join(["attnprof", *argv, *([] if "--resume" in argv else ["--resume"])])


def _print_versus(run) -> None:
    from ..planner.timing import format_versus, format_wall

    text = "\n".join(t for t in (format_versus(run.cells()), format_wall(run.manifest())) if t)
    if text:
        print(f"\n{text}")
