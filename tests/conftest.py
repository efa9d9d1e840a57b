import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from profiler.unet import models

# The device limits (profiler/measure/limits.py) are measured once per test session, into a cache of its own that
# the xdist workers (started with this process's environment: they keep it), the sweep workers and subprocesses the
# tests start share; never the user's ~/.cache/attnprof. Removed when the session ends.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["ATTNPROF_CACHE"] = tempfile.mkdtemp(prefix="attnprof-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ATTNPROF_CACHE"], True)
# One torch thread here and in every process a test starts (workers, probes, Ray tasks): the tiny models' ops are a
# thread handoff each, and two threads on two cores that another process also uses spin on each other (a 2-thread
# calibration took 288 ms a round beside one busy process, against 24 ms on one thread). No test compares threads.
os.environ["OMP_NUM_THREADS"] = "1"
# show fits its tables to $COLUMNS (profiler/fmt.terminal_width): one width whatever runs the suite (xdist's workers
# are given 80, a terminal its own), the 120 of output into a file.
os.environ["COLUMNS"] = "120"
# Ctrl-C as a terminal has it: a suite started from a background job of a non-interactive shell (`make test &` in a
# script) inherits SIGINT ignored, and so would every process the tests start, so that the tests of Ctrl-C would
# see it ignored (three failed so, here). The xdist workers started from this process inherit the handler too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# pytest rewrites the test modules' asserts as it imports them, and keeps the rewritten modules only where Python may
# write bytecode: where PYTHONDONTWRITEBYTECODE is set (as on the project's machines) every run's xdist workers
# rewrote all of them again, about 3 s of CPU a worker (pytest --collect-only: 8.6-9.1 s, 5.6-5.9 s with them kept; a
# fresh clone's first run still rewrites them once). The processes the tests start keep the variable; make bytecode
# compiles what they import of ours.
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def tiny_sd15():
    return models.build("tiny-sd15", weights="random", dtype="float32")


@pytest.fixture(scope="session")
def tiny_sdxl():
    return models.build("tiny-sdxl", weights="random", dtype="float32")


@pytest.fixture
def faults(monkeypatch):
    """The injected-failure backends of tests/faults.py, here and in the workers this test starts."""
    from tests import faults as module

    module.register_all()
    monkeypatch.setenv("ATTNPROF_PLUGINS", "tests.faults")
    module.raised.clear()
    yield module
    module.unregister_all()


# Whole runs end to end (servers, a browser, Ray, sweeps through worker subprocesses, a wheel installed): make test
# runs them; make test-fast (the inner loop) leaves them out.
E2E_MODULES = {"test_service_e2e", "test_ray", "test_dashboard_e2e", "test_runs_compared_e2e", "test_sweep_run",
               "test_faults", "test_wheel", "test_gpu_check", "test_messages", "test_charts", "test_mixed_runs",
               "test_dashboard_app", "test_pipeline", "test_record", "test_every_kind", "test_tune_e2e"}


# The in-process modules whose measured runs and full-size traces take the longest: make test runs them, make
# test-fast (the inner loop, under 4 minutes here) not
WHOLE_ONLY = {"test_run", "test_family", "test_kernel_time", "test_kernels", "test_generation", "test_reference",
              "test_measure", "test_checkpoint"}


def pytest_itemcollected(item):
    name = item.module.__name__.rsplit(".", 1)[-1]
    if name in E2E_MODULES:
        item.add_marker(pytest.mark.e2e)
    if name in WHOLE_ONLY:
        item.add_marker(pytest.mark.whole)


# The modules whose tests start Ray (a local Ray, attnprof serve's heads): their teardowns run `ray stop`, which ends
# every Ray of the machine, so that they run one after the other on one worker, as one unit.
RAY_MODULES = ("test_ray", "test_service_e2e")
# The longest units first, each given to the worker that is free (longest processing time first), so that the suite
# ends on short modules with both workers busy to the end. While the Ray unit runs (mostly waiting on its jobs), the
# other worker takes the modules that compute in its own process; those that wait on subprocesses of their own come
# after, when each worker's subprocesses keep the cores busy (sweep_run beside the Ray unit left a core idle two thirds
# of 30 s). runs_compared, which mostly waits (its runs' injected waits), comes after faults, beside modules that
# compute, not beside sweep_run's timeout (there, 40 s with a core two thirds idle); the wheel's build before the
# short modules, not alone at the end. From an idle `make test` (2 cores): the Ray unit 212 s, sweep_run 133 s, the
# rest 83 s down to about 10 s; then as collected.
LONGEST_FIRST = ("ray", "test_forward", "test_every_kind", "test_dashboard_app", "test_pipeline", "test_mixed_runs",
                 "test_run", "test_gpu_check", "test_sweep_run", "test_record", "test_dashboard_e2e", "test_cli",
                 "test_profile", "test_tune_e2e", "test_faults", "test_runs_compared_e2e", "test_fused", "test_checkpoint",
                 "test_wheel")


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


def _unit(nodeid: str) -> str:
    return "ray" if _module(nodeid) in RAY_MODULES else _module(nodeid)


def pytest_collection_modifyitems(items):
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: the rest in collection order


def pytest_xdist_make_scheduler(config, log):
    """make test's two xdist workers: each test module whole on one worker (its module fixtures made once), as
    --dist loadfile, but for the Ray modules, which make one unit (pytest-xdist's loadgroup does not group under
    pytest 9); the units handed out in collection order (LONGEST_FIRST), not xdist's most-tests-first."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if _unit(nodeid) == "ray" else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return ByModule(config, log)


def made_once(tmp_path_factory, name: str, build):
    """A session fixture's product made once for the whole run rather than once per xdist worker: the first worker
    that asks builds it (build(folder) -> what the fixture returns, as JSON) under the run's shared temporary root,
    holding a lock; the other waits for the lock and reads it. Only for products that tests read and never change."""
    import fcntl
    import json
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
        return json.loads(done.read_text())


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _sigint_kept():
    """A test that leaves SIGINT's handler changed, or SIGTERM ignored, fails here: a later test's Ctrl-C would
    behave otherwise, and so would every subprocess it starts (an ignored signal is inherited). SIGTERM's handler
    may change: attnprof's main makes it end a sweep as Ctrl-C does (execute.stop_on_sigterm)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGINT, before)
    if after[1] == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert after[0] == before and after[1] != signal.SIG_IGN, f"the test left SIGINT / SIGTERM as {after}"


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium (Debian's, driven by Playwright) for the whole suite; each test opens its own page."""
    from tests.test_dashboard_e2e import CHROMIUM, CHROMIUM_ARGS, sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="session")
def dashboard_results(tmp_path_factory):
    """A results folder with one run written by the real profiler, for the dashboard's tests: tiny-sd15 at 64x64 and
    128x128, float32 on the CPU, in process, three repeats (what a diff verdict needs); naive, sdpa and subquad
    measured, xformers unavailable (CUDA only), and naive at 128x128 skipped by a memory budget set between its
    predicted need and subquad's."""
    return Path(made_once(tmp_path_factory, "dashboard", _dashboard_run))


def _dashboard_run(folder: Path) -> str:
    from dataclasses import replace

    from profiler.execute.grid import Sweep
    from profiler.execute.sweep import execute, predict

    root = folder / "results"
    sweep = Sweep(models=("tiny-sd15",), sizes=((64, 64), (128, 128)), dtypes=("float32",),
                  backends=(("naive", ()), ("sdpa", ()), ("subquad", ()), ("xformers", ())), repeats=3, warmup=0,
                  device="cpu", out=str(root))
    cells = [c for c in sweep.cells() if c.width == 128]
    predicted = predict(cells)[0]
    need = {c.backend: predicted[c.cell_id]["predicted_need_bytes"] for c in cells}
    assert need["naive"] > need["subquad"] > need["sdpa"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timings do not matter here, and two threads on a busy machine spin for minutes
    try:
        execute(replace(sweep, memory_budget=(need["naive"] + need["subquad"]) // 2), workers=False, progress=False)
    finally:
        torch.set_num_threads(threads)
    return str(root)


MIXED_SWEEP = """\
models: [tiny-sd15, tiny-sdxl]
sizes: [64x64]
dtypes: [float32]
backends: [sdpa, {sliced: {slice_size: 1}}, {sliced: {slice_size: 4}}]
repeats: 1
warmup: 0
device: cpu
"""
BF16_RUN = ["run", "--model", "tiny-sd15", "--size", "64x64", "--size", "128x128", "--dtype", "bfloat16",
            "--backend", "sliced", "--option", "slice_size=4", "--device", "cpu", "--repeats", "1", "--warmup", "0",
            "--in-process", "--quiet"]


@pytest.fixture(scope="session")
def mixed_results(tmp_path_factory):
    """Three real one-repeat runs, made through the command line as a user makes them (issue 20): `mixed`, a sweep
    holding two models and one backend with two sets of options (its closing output in `sweep_output`); `bf16` and
    `again`, one bfloat16 grid run twice. Together their cells vary in run, model, dtype and backend options."""
    import types

    made = made_once(tmp_path_factory, "mixed", _mixed_runs)
    return types.SimpleNamespace(**{**made, "root": Path(made["root"])})


def _mixed_runs(folder: Path) -> dict:
    import contextlib
    import io

    from profiler.cli import main
    from profiler.store import list_runs

    root = folder / "results"
    config = folder / "mixed.yaml"
    config.write_text(MIXED_SWEEP + f"out: {root}\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timings do not matter here
    outputs = []
    try:
        for argv in (["sweep", str(config), "--in-process", "--quiet"], [*BF16_RUN, "--out", str(root)],
                     [*BF16_RUN, "--out", str(root)]):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert main(argv) == 0
            outputs.append(out.getvalue())
    finally:
        torch.set_num_threads(threads)
    mixed, bf16, again = (next(line for line in o.splitlines() if line.startswith("results:")).split("/")[-1]
                          for o in outputs)
    assert sorted((mixed, bf16, again)) == sorted(p.name for p in list_runs(root))
    return {"root": str(root), "mixed": mixed, "bf16": bf16, "again": again, "sweep_output": outputs[0]}


@pytest.fixture(scope="session")
def compiled_results(tmp_path_factory) -> Path:
    """A results folder with one run of tiny-sd15 at 64x64, sdpa, float32 on the CPU, eager and compiled
    (compile: regional), three repeats, in process: tests/test_compiled.py's, and a kind of run that every reader
    meets (tests/test_every_kind.py)."""
    return Path(made_once(tmp_path_factory, "compiled", _compiled_run))


def _compiled_run(folder: Path) -> str:
    from profiler.execute.grid import Sweep
    from profiler.execute.sweep import execute

    root = folder / "results"
    sweep = Sweep(models=("tiny-sd15",), sizes=((64, 64),), dtypes=("float32",), backends=(("sdpa", ()),),
                  model_settings=(("compile", ("none", "regional")),), repeats=3, warmup=1, device="cpu",
                  out=str(root))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timings do not matter here, and two threads on a busy machine spin
    try:
        execute(sweep, workers=False, progress=False)
    finally:
        torch.set_num_threads(threads)
    return str(root)


@pytest.fixture(scope="session")
def gpu_check_dry_run(tmp_path_factory) -> dict:
    """make gpu-check's CPU dry run as the issue gives it (`python -m profiler.gpu_check --device cpu --models
    tiny-sd15 --sizes 64 --out D --budget-s 60`), made once for the suite: its folder, output, exit code, wall time
    from its start, and whether any process of it outlived it. tests/test_gpu_check.py judges it; its runs are a kind
    of run every reader meets (tests/test_every_kind.py)."""
    return made_once(tmp_path_factory, "gpu-check-dry-run", _gpu_check_dry_run)


def _gpu_check_dry_run(folder: Path) -> dict:
    import time

    from tests.procs import alive, start_marked

    budget, t0 = 60, time.monotonic()
    proc, token = start_marked(["profiler.gpu_check", "--device", "cpu", "--models", "tiny-sd15", "--sizes", "64",
                                "--out", str(folder / "gc"), "--budget-s", str(budget)])
    out, err = proc.communicate(timeout=budget + 60)
    wall = time.monotonic() - t0
    time.sleep(1)
    return {"out": str(folder / "gc"), "stdout": out, "stderr": err, "code": proc.returncode, "wall_s": wall,
            "budget_s": budget, "alive": alive(token)}


@pytest.fixture(scope="session")
def traced_results(tmp_path_factory):
    """A results folder with one run of `attnprof run ... --trace` (worker subprocesses, as the CLI runs by default):
    tiny-sd15 at 64x64, float32 on the CPU, naive and sdpa; and what the command printed."""
    root, printed = made_once(tmp_path_factory, "traced", _traced_run)
    return Path(root), printed


def _traced_run(folder: Path) -> list:
    import contextlib
    import io

    from profiler.cli import main

    root = folder / "results"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", "--model", "tiny-sd15", "--size", "64x64", "--dtype", "float32", "--device", "cpu",
                     "--backend", "naive", "--backend", "sdpa", "--repeats", "1", "--warmup", "0", "--trace",
                     "--quiet", "--out", str(root)])
    assert code == 0, printed.getvalue()
    return [str(root), printed.getvalue()]


@pytest.fixture(scope="session")
def record_results(tmp_path_factory) -> dict:
    """Two runs of kind record, of docs/examples/generate.py's tiny SD 1.5 pipeline (its real CLIP text encoder, VAE
    and U-Net topology) on the CPU, each stored as attnprof record stores a script's pipeline calls (its child
    process: each call profiled, store_cell of them merged): `loaded`, two pipeline calls (generations 0 and 1) of 3
    steps at 64x64 with the processors it loads; `sliced`, one of 2 steps at 64x96 with the sliced backend. Made once
    for the suite: {"root", "loaded", "sliced"} (the run ids)."""
    made = made_once(tmp_path_factory, "record", _record_runs)
    return {**made, "root": Path(made["root"])}


def _record_runs(folder: Path) -> dict:
    import importlib.util

    from profiler import profile
    from profiler.record.cells import merged, store_cell
    from profiler.store import Run, now

    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "docs" / "examples" /
                                                  "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    root, ids = folder / "results", {}
    pipe = gen.tiny_pipeline()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timings do not matter here
    try:
        for name, backend, calls in (("loaded", None, [dict(steps=3), dict(steps=3, seed=1)]),
                                     ("sliced", "sliced", [dict(steps=2, width=96)])):
            profiles = []
            for kwargs in calls:
                with profile(pipe, out=None, backend=backend) as prof:
                    gen.generate(pipe, **kwargs)
                profiles.append(prof)
            run = Run.create(root, {"kind": "record", "command": "attnprof record -- generate.py", "cells": [],
                                    "ended_at": None})
            cell = store_cell(run, merged(profiles), backend)
            run.update_manifest(ended_at=now(), interrupted=False, notes=profiles[0].notes,
                                cells=[{k: cell[k] for k in ("model", "width", "height", "batch", "dtype", "backend",
                                                             "device", "backend_options", "settings", "cell_id")}])
            ids[name] = run.id
    finally:
        torch.set_num_threads(threads)
    return {"root": str(root), **ids}
