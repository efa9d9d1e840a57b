"""attnprof record: an unmodified script profiled as it runs.

    attnprof record [--out DIR] [--backend NAME]... [--trace] -- [python] SCRIPT.py [ARGS...]

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
import re
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..spec import InputError

RUN_ENV = "ATTNPROF_RECORD_RUN"
ASK_ENV = "ATTNPROF_RECORD_ASK"  # the child's pipes to attnprof record: its first pipeline call asks, record answers


GRACE_S = 10.0  # after a Ctrl-C, how long the script has to end by itself before it is stopped
INTERPRETER = re.compile(r"python[\d.]*")  # python, python3, python3.12: what a word before the script may be


def interpreted(script: str | None, args: list[str]) -> tuple[str | None, list[str]]:
    """The script and its arguments as typed after `--`, an interpreter word before them dropped (`-- python x.py`,
    as py-spy's and nsys's users type it: python, python3, python3.12, any path to one, this process's own): the
    script runs under attnprof's interpreter either way. The interpreter's own options (-m, -u, ...) are bad
    input."""
    if script is None or not (INTERPRETER.fullmatch(Path(script).name) or _same_file(script, sys.executable)):
        return script, args
    if not args or args[0].startswith("-"):
        given = f"{script}'s option {args[0]} is not taken" if args else f"{script} needs the script after it"
        raise InputError(f"record: {given}: give the script's path after it, e.g. attnprof record -- {script} "
                         "generate.py --steps 30")
    return args[0], args[1:]


def record_command(script: str | None, args: list[str], backend: list[str] | None, out: str, trace: bool,
                   quiet: bool, resume: str | None) -> int:
    """attnprof record: the script recorded (or an interrupted record run finished), the run's summary printed; the
    script's exit status."""
    from ..fmt import progress, terminal_width
    from ..report.show import format_run, left_backends, resume_record
    from ..store import Run

    if resume and script:
        raise InputError("--resume finishes a run with its own script and arguments: give no script after it")
    if not resume and not script:
        raise InputError("record needs the script to run: attnprof record -- generate.py --steps 30")
    script, rest = interpreted(script, args)
    say = None if quiet else progress("record", quiet)
    if say:
        _options_after(rest, say)
    code, path = record(script, rest, backend or [], Path(out), trace, say, resume)
    if path is None:
        return code
    run = Run.open(path)
    print(format_run(run, terminal_width()))
    if code == 130 and left_backends(run.manifest(), run.cells()):
        print(f"attnprof record: interrupted: the cells recorded so far are kept; finish it with: "
              f"{resume_record(run)}", file=sys.stderr)
    elif code == 130:
        print("attnprof record: interrupted after every backend's cells were stored: the run is whole",
              file=sys.stderr)
    return code


def _options_after(args: list[str], say) -> None:
    """A word after the script that is one of record's own options goes to the script, as the convention says;
    said once, since the user may have meant it for record."""
    own = [a for a in args if a.split("=")[0] in ("--out", "--backend", "--trace", "--quiet", "--resume")]
    if own:
        say(f"{', '.join(own)} after the script go{'es' if len(own) == 1 else ''} to the script, not to record: "
            "put record's options before the script (attnprof record --out DIR -- SCRIPT.py ARGS)")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def record(script: str | None, args: list[str], backends_: list[str], out: Path, trace: bool = False,
           say=None, resume: str | None = None) -> tuple[int, Path | None]:
    """Run the script once per backend (or once as it is), each in a child process that records its cells into one
    run under out: a new one, or with resume (a run id) that interrupted run, for the backends it has no complete
    cell of. The machine's speed is taken where a generation will be stored: as the child's first pipeline call
    begins (on the device it runs on), and after the child ended where it stored a cell; a script that makes no
    pipeline call costs none. (the script's exit status, the first non-zero of its runs, 130 when stopped; the run's
    folder, None where the script made no pipeline call: nothing is stored then)."""
    import torch

    from .. import devices
    from ..attention import backends
    from ..execute.local import LocalExecutor

    quiet, say = say is None, say or (lambda line: None)
    run, script, args, backends_ = _the_run(script, args, backends_, out, resume)
    for name in backends_:
        if name:
            backends.check_backend_name(name)
    code, stopped, executor = 0, _Stop(), LocalExecutor(workers=True)  # on CUDA each calibration in a subprocess
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the run's device until a generation names its own
    devices.keep_memory()  # this process is ours: it times the machine as a sweep's do
    try:
        for backend in backends_:
            say(" ".join(["running", script, *args]) + (f" with backend {backend}" if backend else
                                                        " with the processors it loads"))
            argv = [sys.executable, "-m", "profiler.record.script", *(["--backend", backend] if backend else []),
                    *(["--trace"] if trace else []), *(["--quiet"] if quiet else []), "--", script, *args]
            cells, start = len(run.cells()), {}
            done = stopped.child(argv, {**os.environ, RUN_ENV: str(run.path)},
                                 lambda where: start.update(device=where, at=executor.calibrate(where, "start")))
            if len(run.cells()) > cells:
                ran = pipeline_device(run, start.get("device", device))  # the device the generation ran on
                end = executor.calibrate(ran, "end")
                pair = [start["at"], end] if start.get("device") == ran else [end]  # another device's: no pair
                run.update_manifest(calibration=[*run.manifest().get("calibration", []), *pair])
                device = ran
            code = code or done
    except KeyboardInterrupt:
        stopped.stopping()
    finally:
        stopped.hold()  # from here a Ctrl-C: one line; after a first, the script stopped now; the manifest written
        try:
            stopped.wait()
            result = _finish(run, code, stopped.asked, device, say)
        finally:
            stopped.release()
    return result


def pipeline_device(run, default: str) -> str:
    """The device the last recorded generation ran on (its cell's pipeline_device: cuda:1 where the user's pipeline
    was there), so that the machine's speed is read where the generation ran, not on device 0; else default."""
    cells = run.cells()
    ran = cells["pipeline_device"].dropna() if len(cells) and "pipeline_device" in cells else []
    return str(ran.iloc[-1]) if len(ran) else default


def _the_run(script: str | None, args: list[str], backends_: list[str], out: Path, resume: str | None):
    """(the run to record into, the script, its arguments, the backends to run: None for the loaded processors):
    a new run, or an interrupted one to finish (its own script, arguments and the backends it has no cell of)."""
    from ..report.show import left_backends
    from ..store import Run, find_run, now

    if resume:
        run = find_run(out, resume)
        m = run.manifest()
        facts = m.get("record") if run.kind.name == "record" else None
        if not facts or "script" not in facts:
            raise InputError(f"run {run.id} is not a run of attnprof record: --resume finishes one of those")
        left = left_backends(m, run.cells())
        if not left:
            raise InputError(f"run {run.id} has a complete cell for every backend it was given: nothing to finish")
        if not Path(facts["script"]).is_file():
            raise InputError(f"run {run.id}'s script {facts['script']} is not there any more: put it back there to "
                             "finish the run, or record it anew")
        run.update_manifest(resumed_at=now(), ended_at=None)
        return run, facts["script"], facts["args"], left
    path = Path(script)
    if not path.is_file():
        raise InputError(f"record: {script} is not a file: give the script to run, e.g. attnprof record -- "
                         "generate.py --steps 30")
    command = " ".join(["attnprof record", *(f"--backend {b}" for b in backends_), "--", script, *args])
    run = Run.create(out, {"kind": "record", "command": command, "cells": [], "ended_at": None,
                           "record": {"script": str(path.resolve()), "args": args,  # --resume from anywhere
                                      "backends": backends_ or [None]}})
    return run, str(path), args, backends_ or [None]


def _finish(run, code: int, stopped: bool, device: str, say) -> tuple[int, Path | None]:
    """The run's manifest as it ended: interrupted where the script failed, or where it was stopped before every
    backend had a complete cell; its cells listed; a run whose script made no pipeline call (and was not stopped)
    removed, since it holds nothing."""
    import shutil

    from ..env import environment
    from ..store import now

    from ..report.show import left_backends

    cells, m = run.cells(), run.manifest()
    if not len(cells) and not stopped and not m.get("resumed_at"):
        shutil.rmtree(run.path, ignore_errors=True)
        say(next((n for n in m.get("notes") or [] if n.startswith("nothing stored")),
                 "the script made no diffusers pipeline call: nothing stored (and no calibration taken)"))
        return code, None
    left = left_backends(m, cells)  # a stop after every backend's cell was stored leaves nothing to finish
    run.update_manifest(ended_at=now(), interrupted=code != 0 or (stopped and bool(left)),
                        environment=m.get("environment") or {**environment(device), "executor": "record"},
                        cells=[{k: c[k] for k in ("model", "width", "height", "batch", "dtype", "backend", "device",
                                                  "backend_options", "settings", "cell_id")}
                               for c in cells.to_dict("records")] if len(cells) else [])
    return (130 if stopped else code), run.path


class _Stop:
    """A Ctrl-C during a record: the first raises KeyboardInterrupt where it lands (the script, in the same process
    group, gets its own and ends as it would; it is given GRACE_S, then SIGINT of its own, then killed); each one
    after, while the run is finished, prints one line and stops the script now. A Ctrl-C while a run that was not
    stopped is finished (every script ended) says so and changes nothing."""

    def __init__(self):
        self.proc, self.asked, self.old = None, False, None

    def child(self, argv: list[str], env: dict, on_start) -> int:
        """The script's run in a child process: its exit status. As its first pipeline call begins the child asks
        (a line on a pipe: its device) and waits: on_start(device) runs here first (the start calibration)."""
        import select

        ask_r, ask_w = os.pipe()
        go_r, go_w = os.pipe()
        try:
            self.proc = subprocess.Popen(argv, env={**env, ASK_ENV: f"{ask_w},{go_r}"}, pass_fds=(ask_w, go_r))
        finally:
            os.close(ask_w)
            os.close(go_r)
        with os.fdopen(ask_r, "rb", buffering=0) as asks, os.fdopen(go_w, "wb", buffering=0) as go:
            while self.proc.poll() is None:
                if select.select([asks], [], [], 0.25)[0]:
                    line = asks.readline().decode().strip()
                    if not line:  # the child closed its end: it is ending
                        break
                    on_start(line)
                    try:
                        go.write(b"go\n")
                    except BrokenPipeError:  # it ended meanwhile
                        pass
        return self.proc.wait()

    def stopping(self) -> None:
        """The first Ctrl-C: the next ones held from now, then one line said."""
        self.asked = True
        self.hold()
        ending = self.proc is not None and self.proc.poll() is None
        print("attnprof record: interrupted: " + ("waiting for the script to end (Ctrl-C again stops it now)" if
                                                  ending else "the run is kept as it stands"),
              file=sys.stderr, flush=True)

    def hold(self) -> None:
        if self.old is None and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._again if self.asked else self._finishing)

    def _again(self, signum, frame) -> None:
        print("attnprof record: interrupted again: stopping the script now; the run is kept, marked interrupted",
              file=sys.stderr, flush=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def _finishing(self, signum, frame) -> None:
        print("attnprof record: every run of the script has ended: writing the run's manifest, a moment",
              file=sys.stderr, flush=True)

    def wait(self) -> None:
        """The script's process ended: by itself within GRACE_S, else on a SIGINT of its own, else killed."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for step in (lambda: None, lambda: self.proc.send_signal(signal.SIGINT), self.proc.kill):
            step()
            try:
                self.proc.wait(GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def release(self) -> None:
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            self.old = None


class _Watch:
    """The pipeline calls of this process, each profiled: the __call__ of every pipeline class the script builds is
    wrapped (once per class; a pipeline called inside another's call is part of the outer one)."""

    def __init__(self, backend: str | None, trace: bool, results: Path | None = None, quiet: bool = True):
        self.backend, self.trace, self.profiles, self.results, self.quiet = backend, trace, [], results, quiet
        self.local, self.wrapped, self.asked = threading.local(), {}, False

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
                watch.started(pipe)
                eta = watch.predicted(pipe, args, kwargs)
                with profile(pipe, out=None, backend=watch.backend, trace=watch.trace) as prof:
                    result = original(pipe, *args, **kwargs)
                watch.profiles.append(prof)
                if eta and not watch.quiet:
                    print(f"attnprof record: the generation took {prof.wall_s:.2f} s, {_eta_text(eta, False)} "
                          f"({prof.wall_s * 1e3 / eta['total_ms']:.2f}x{' that floor' if _floor(eta) else ''})",
                          file=sys.stderr)
                return result
            finally:
                watch.local.active = False

        owner.__call__ = __call__

    def predicted(self, pipe, args: tuple, kwargs: dict) -> dict | None:
        """The time model's prediction of the generation about to run (planner/generation.py), said on stderr as far
        as its evidence goes (_eta_text); None where its pipeline is not one the planner knows, or where its
        calibration's expected error is over timing.MAX_ERROR_PCT (said so). A prediction never stops the script."""
        from ..planner import calibration
        from ..planner.generation import pipeline_spec, predict_generation
        from ..planner.timing import over_text, too_wrong

        try:
            spec = pipeline_spec(pipe, args, kwargs, self.backend)
            device = pipe.unet.device.type
            where = calibration.target(device, spec.dtype, None, str(self.results), kept=False) if spec else None
            if not where:
                return None
            g = predict_generation(spec, *where, device)
        except Exception as e:  # noqa: BLE001 - the user's script runs whatever the model makes of it
            self._say(f"no prediction for this generation ({type(e).__name__}: {e})")
            return None
        unet = _denoise(g)
        what = f"{spec.pipeline}, {spec.width}x{spec.height}, {spec.steps} steps, {spec.backend}"
        if too_wrong(unet):
            self._say(f"no prediction for this generation ({what}): the calibration's "
                      f"{over_text(unet['time_error_pct'])} ({_short(unet['source'])})")
            return None
        self._say(f"{_eta_text(g)} for this generation ({what}; the U-Net's time from: {_short(unet['source'])})")
        return g

    def started(self, pipe) -> None:
        """The first pipeline call of this process begins: attnprof record ($ASK_ENV: its pipes) is told the device
        it runs on and takes the machine's speed there (the start calibration) before the call goes on."""
        pipes, self.asked = (None if self.asked else os.environ.get(ASK_ENV)), True
        if not pipes:
            return
        from .session import _device, components

        ask, go = (int(fd) for fd in pipes.split(","))
        os.write(ask, f"{_device(pipe, components(pipe))}\n".encode())
        os.read(go, 16)  # record's answer (or its end: nothing to wait for)

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(f"attnprof record: {line}", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        from diffusers import DiffusionPipeline

        DiffusionPipeline.register_modules = self.register
        for owner, original in self.wrapped.items():
            owner.__call__ = original


def _denoise(g: dict) -> dict:
    return next(x for x in g["parts"] if x["part"] == "denoise")


def _floor(g: dict) -> bool:
    return _denoise(g)["time_kind"] == "floor"


def _eta_text(g: dict, error: bool = True) -> str:
    """'predicted 2.57 s (expected error 8%, leave-one-out)' (error=False: without the error), or 'at least 0.01 s
    predicted (the roofline floor, a lower bound)' where the U-Net's time is its floor (no stored run of this device
    to calibrate on; error=False: 'at least 0.01 s predicted'): the U-Net's evidence, in timing.said_time's words."""
    from ..planner.timing import said_time

    seconds, unet = f"{g['total_ms'] / 1e3:.2f} s", _denoise(g)
    if _floor(g):
        return said_time(seconds, unet, floor_note=False) + " predicted" + \
            (" (the roofline floor, a lower bound)" if error else "")
    return f"predicted {said_time(seconds, unet) if error and unet['time_kind'] == 'calibrated' else seconds}"


def _short(source: str) -> str:
    """A time source without the runs it left out or weighted down (attnprof show and plan name them)."""
    return source.split("; left out")[0].split("; weighted down")[0]


def child(argv: list[str]) -> int:
    """One run of the script in this process: the script with its pipeline calls profiled, its cells recorded into
    the run that $ATTNPROF_RECORD_RUN names (a Ctrl-C: the generations that ended before it, each cell marked
    partial; no Ctrl-C lands while they are stored, which would leave a cell half-written). The script's exit
    status (130 where a Ctrl-C stopped it)."""
    from ..store import Run

    backend = argv[argv.index("--backend") + 1] if "--backend" in argv else None
    trace, quiet = "--trace" in argv[:argv.index("--")], "--quiet" in argv[:argv.index("--")]
    script, args = argv[argv.index("--") + 1], argv[argv.index("--") + 2:]
    run = Run.open(Path(os.environ[RUN_ENV]))
    for fd in os.environ.get(ASK_ENV, "").split(",") if os.environ.get(ASK_ENV) else []:
        os.set_inheritable(int(fd), False)  # the script's own subprocesses never hold record's pipes
    code, stopped = 0, False
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with _Watch(backend, trace, run.path.parent, quiet) as watch:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:  # a Ctrl-C: attnprof record says so; a generation cut short is not stored
            code, stopped = 130, True
    held = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _store(run, watch.profiles, backend, stopped)
    finally:
        signal.signal(signal.SIGINT, held)
    return code


def _store(run, profiles: list, backend: str | None, partial: bool) -> None:
    """The script's generations as cells of the run (cells.cells_of: a cell per pipeline, size and batch), partial
    where the script was stopped; its notes in the manifest."""
    from .cells import UNSIZED, cells_of, store_cell

    if not profiles:
        return
    parts = cells_of(profiles)
    for part in parts:
        store_cell(run, part, backend, partial)
    run.update_manifest(notes=sorted({*run.manifest().get("notes", []), *(n for p in profiles for n in p.notes),
                                      *([] if parts else [UNSIZED])}))


if __name__ == "__main__":
    try:
        sys.exit(child(sys.argv[1:]))
    except KeyboardInterrupt:  # one that lands outside the script (this process starting, the cell being stored)
        sys.exit(130)
