"""attnprof record: an unmodified script profiled as it runs.

    attnprof record [--out DIR] [--backend NAME]... [--trace] -- SCRIPT.py [ARGS...]

The script runs as `python SCRIPT.py ARGS` would (its own __main__, argv, output and exit status), once per backend
given (none: once, with the processors it loads), each time in a process of its own. Every call of a diffusers
pipeline in it is profiled (session.profile); all of one process's calls make one cell of the one run, whose
calibrations (the machine's speed, measure/calibrate.py) this process takes before and after each, so that `attnprof
diff` judges two such runs by the same rule as any other. Not the script's process: its memory is the user's, left
as it is (devices.keep_memory), where a calibration's tables got new pages at the start and not at the end: of one
pair's 16 start and end calibrations, the start the slower in 15 (6.9 to 18.0 ms against 6.7 to 13.5), and every
record run read as a machine that moved 1.47 to 1.91x. To find the pipeline calls of a script it cannot change, the
child wraps the `__call__` of each pipeline class the script builds (seen as its __init__ registers its modules),
in its own process only (as session.profile wraps its own pipeline's for its block).
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
import threading
from pathlib import Path

from ..spec import InputError

RUN_ENV = "ATTNPROF_RECORD_RUN"


def record(script: str, args: list[str], backends_: list[str], out: Path, trace: bool = False,
           say=None) -> tuple[int, Path]:
    """Run the script once per backend (or once as it is), each in a child process that records its cell into one
    new run under out. (the script's exit status, the first non-zero of its runs; the run's folder)."""
    import torch

    from .. import devices
    from ..attention import backends
    from ..execute.local import LocalExecutor
    from ..store import Run, now

    quiet, say = say is None, say or (lambda line: None)
    path = Path(script)
    if not path.is_file():
        raise InputError(f"record: {script} is not a file: give the script to run, e.g. attnprof record -- "
                         "generate.py --steps 30")
    for name in backends_:
        backends.check_backend_name(name)
    run = Run.create(out, {"kind": "record", "command": " ".join(["attnprof record", *(f"--backend {b}" for b in
                                                                                        backends_), "--", script,
                                                                   *args]),
                           "record": {"script": str(path), "args": args, "backends": backends_ or [None]},
                           "cells": [], "ended_at": None})
    code, executor = 0, LocalExecutor(workers=True)  # on CUDA each calibration in a subprocess: no context here
    device = "cuda" if torch.cuda.is_available() else "cpu"
    devices.keep_memory()  # this process is ours: it times the machine as a sweep's do
    try:
        for backend in backends_ or [None]:
            say(f"running {script} {' '.join(args)}" + (f" with backend {backend}" if backend else
                                                        " with the processors it loads"))
            argv = [sys.executable, "-m", "profiler.record.script", *(["--backend", backend] if backend else []),
                    *(["--trace"] if trace else []), *(["--quiet"] if quiet else []), "--", str(path), *args]
            cells, start = len(run.cells()), executor.calibrate(device, "start")
            done = subprocess.run(argv, env={**os.environ, RUN_ENV: str(run.path)})
            end = executor.calibrate(device, "end")
            if len(run.cells()) > cells:
                run.update_manifest(calibration=[*run.manifest().get("calibration", []), start, end])
            code = code or done.returncode
    finally:
        cells = run.cells()
        run.update_manifest(ended_at=now(), interrupted=code != 0,
                            cells=[{k: c[k] for k in ("model", "width", "height", "batch", "dtype", "backend", "device",
                                                      "backend_options", "settings", "cell_id")}
                                   for c in cells.to_dict("records")] if len(cells) else [])
    if not len(cells):
        say(f"the script made no diffusers pipeline call: run {run.id} holds no cell")
    return code, run.path


class _Watch:
    """The pipeline calls of this process, each profiled: the __call__ of every pipeline class the script builds is
    wrapped (once per class; a pipeline called inside another's call is part of the outer one)."""

    def __init__(self, backend: str | None, trace: bool, results: Path | None = None, quiet: bool = True):
        self.backend, self.trace, self.profiles, self.results, self.quiet = backend, trace, [], results, quiet
        self.local, self.wrapped = threading.local(), {}

    def __enter__(self) -> "_Watch":
        from diffusers import DiffusionPipeline

        register, watch = DiffusionPipeline.register_modules, self

        def register_modules(pipe, **kwargs):
            register(pipe, **kwargs)
            watch.wrap(type(pipe))

        self.register = register
        DiffusionPipeline.register_modules = register_modules
        return self

    def wrap(self, cls) -> None:
        owner = next((k for k in cls.__mro__ if "__call__" in vars(k)), None)
        if owner is None or owner in self.wrapped:
            return
        original, watch = owner.__call__, self
        self.wrapped[owner] = original

        def __call__(pipe, *args, **kwargs):
            if getattr(watch.local, "active", False):
                return original(pipe, *args, **kwargs)
            from .session import profile

            watch.local.active = True
            try:
                eta = watch.predicted(pipe, args, kwargs)
                with profile(pipe, out=None, backend=watch.backend, trace=watch.trace) as prof:
                    result = original(pipe, *args, **kwargs)
                watch.profiles.append(prof)
                if eta and not watch.quiet:
                    print(f"attnprof record: the generation took {prof.wall_s:.2f} s, predicted {eta[0] / 1e3:.2f} s "
                          f"({prof.wall_s * 1e3 / eta[0]:.2f}x)", file=sys.stderr)
                return result
            finally:
                watch.local.active = False

        owner.__call__ = __call__

    def predicted(self, pipe, args: tuple, kwargs: dict) -> tuple[float, str] | None:
        """The time model's prediction of the generation about to run, said on stderr: (ms, source), or None where
        its pipeline is not one the planner knows. A prediction never stops the script."""
        from ..planner import calibration
        from ..planner.generation import pipeline_spec, predict_generation

        try:
            spec = pipeline_spec(pipe, args, kwargs, self.backend)
            device = pipe.unet.device.type
            where = calibration.target(device, spec.dtype, None, str(self.results), kept=False) if spec else None
            if not where:
                return None
            g = predict_generation(spec, *where, device)
        except Exception as e:  # noqa: BLE001 - the user's script runs whatever the model makes of it
            if not self.quiet:
                print(f"attnprof record: no prediction for this generation ({type(e).__name__}: {e})",
                      file=sys.stderr)
            return None
        source = g["parts"][-2]["source"] if len(g["parts"]) > 1 else ""
        if not self.quiet:
            print(f"attnprof record: predicted {g['total_ms'] / 1e3:.2f} s for this generation ({spec.pipeline}, "
                  f"{spec.width}x{spec.height}, {spec.steps} steps, {spec.backend}; the U-Net's time from: "
                  f"{_short(g['parts'][[x['part'] for x in g['parts']].index('denoise')]['source'])})",
                  file=sys.stderr)
        return g["total_ms"], source

    def __exit__(self, *exc) -> None:
        from diffusers import DiffusionPipeline

        DiffusionPipeline.register_modules = self.register
        for owner, original in self.wrapped.items():
            owner.__call__ = original


def _short(source: str) -> str:
    """A time source without the runs it left out or weighted down (attnprof show and plan name them)."""
    return source.split("; left out")[0].split("; weighted down")[0]


def child(argv: list[str]) -> int:
    """One run of the script in this process: the script with its pipeline calls profiled, its cell recorded into
    the run that $ATTNPROF_RECORD_RUN names. The script's exit status."""
    from ..store import Run
    from .session import merged, store_cell

    backend = argv[argv.index("--backend") + 1] if "--backend" in argv else None
    trace, quiet = "--trace" in argv[:argv.index("--")], "--quiet" in argv[:argv.index("--")]
    script, args = argv[argv.index("--") + 1], argv[argv.index("--") + 2:]
    run = Run.open(Path(os.environ[RUN_ENV]))
    code = 0
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with _Watch(backend, trace, run.path.parent, quiet) as watch:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    if watch.profiles:
        store_cell(run, merged(watch.profiles), backend)
        run.update_manifest(notes=sorted({*run.manifest().get("notes", []), *(n for p in watch.profiles
                                                                              for n in p.notes)}))
    return code


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
