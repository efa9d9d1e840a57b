"""Injected failures on the CPU (tests/faults.py): every form of allocation failure ends `oom` with the size asked
for, in process and in a worker, and the next cell of the same worker ends ok; a failed reference forward is tried
once per (model, size, batch) and its error reaches every cell that needed it."""
import pytest

from profiler.measure import cell as runner
from profiler.store import Run
from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute


def _sweep(tmp_path, backends, sizes=((128, 128),)) -> Sweep:
    return Sweep(models=("tiny-sd15",), sizes=sizes, dtypes=("float32",), device="cpu", repeats=1, warmup=0,
                 backends=tuple((b, ()) for b in backends), out=str(tmp_path / "results"))


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "worker"])
def test_allocation_failures_end_oom_with_the_size_and_the_next_cell_runs(tmp_path, faults, workers):
    sweep = _sweep(tmp_path, ["fault-torch-oom", "fault-text-oom", "sdpa"])
    outcome = execute(sweep, workers=workers, progress=False)
    cells = Run.open(outcome.run_path).cells().set_index("backend")
    assert cells["status"].to_dict() == {"fault-torch-oom": "oom", "fault-text-oom": "oom", "sdpa": "ok"}
    assert cells.loc["fault-torch-oom", "error"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                                            "3.16 GiB")
    assert cells.loc["fault-text-oom", "error"] == "RuntimeError: CUDA out of memory. Tried to allocate 3.16 GiB"
    assert "worker died" not in " ".join(cells["error"])  # one worker went on from cell to cell
    assert Run.open(outcome.run_path).blocks()["backend"].unique().tolist() == ["sdpa"]


def test_a_failed_reference_is_tried_once_per_shape_and_reaches_every_cell(tmp_path, monkeypatch, faults):
    monkeypatch.setattr(runner, "REFERENCE_BACKEND", "fault-error")
    sweep = _sweep(tmp_path, ["sdpa", "naive", "subquad"], sizes=((128, 128), (192, 192)))
    cells = Run.open(execute(sweep, workers=False, progress=False).run_path).cells()
    assert faults.raised == ["RuntimeError: kernel exploded"] * 2  # one try per size, not one per cell
    assert set(cells["status"]) == {"error"} and len(cells) == 6
    assert all(e.startswith("the fault-error/float32 reference forward failed: RuntimeError: kernel exploded")
               for e in cells["error"])


def test_a_reference_that_runs_out_of_memory_makes_its_cells_oom(tmp_path, monkeypatch, faults):
    monkeypatch.setattr(runner, "REFERENCE_BACKEND", "fault-text-oom")
    cells = Run.open(execute(_sweep(tmp_path, ["sdpa", "naive"]), workers=False, progress=False).run_path).cells()
    assert set(cells["status"]) == {"oom"}
    assert all("Tried to allocate 3.16 GiB" in e for e in cells["error"])


@pytest.mark.parametrize("when", ["after-done", "after-record"])
def test_a_worker_that_dies_between_cells_or_before_reporting_one_is_replaced(tmp_path, monkeypatch, faults, when):
    """after-done: the worker dies between two cells (its row recorded and reported): a new worker runs the rest.
    after-record: it dies after recording its row, before reporting it: that ok row is kept, not overwritten by a
    crash verdict. Either way every cell ends ok, and the run is not marked interrupted."""
    monkeypatch.setenv("ATTNPROF_FAULT_EXIT", f"{when}:naive")
    sweep = _sweep(tmp_path, ["naive", "sdpa", "subquad"], sizes=((64, 64),))
    run = Run.open(execute(sweep, workers=True, progress=False).run_path)
    assert (run.path / ".fault-exit-done").exists()  # the worker did die
    cells = run.cells()
    assert cells.set_index("backend")["status"].to_dict() == {"naive": "ok", "sdpa": "ok", "subquad": "ok"}
    assert run.blocks().groupby("backend").size().to_dict() == {"naive": 32, "sdpa": 32, "subquad": 32}
    assert run.manifest()["interrupted"] is False


def test_a_sweep_that_ends_before_all_its_cells_did_is_interrupted(tmp_path, monkeypatch, faults):
    """A worker environment that cannot even start a cell stops the sweep: the manifest says interrupted."""
    monkeypatch.setenv("ATTNPROF_PLUGINS", "tests.faults,no_such_module_here")
    sweep = _sweep(tmp_path, ["naive", "sdpa"], sizes=((64, 64),))
    with pytest.raises(RuntimeError, match="before starting a cell.*no_such_module_here"):
        execute(sweep, workers=True, progress=False)
    run = Run.open(next((tmp_path / "results").iterdir()))
    assert run.manifest()["interrupted"] is True and len(run.cells()) == 0


def test_a_probe_that_kills_its_process_makes_only_its_own_backend_unavailable(faults):
    """The CUDA path's probes (local.probe_apart), tried with CPU asks: fault-die-probe SIGKILLs its probe
    subprocess; sdpa (probed with the torch-native backends) and fault-fd1 (apart) still answer, and the dead one
    says how it died."""
    from profiler.execute import local

    asks = [("naive", "cpu", "float32", (40,)), ("fault-die-probe", "cpu", "float32", (40,)),
            ("sdpa", "cpu", "float32", (40,)), ("fault-fd1", "cpu", "float32", (40,))]
    answers = local.probe_apart(asks)
    assert [ok for ok, _ in answers] == [True, False, True, True]
    assert "its availability probe died" in answers[1][1] and "SIGKILL" in answers[1][1]
    assert local._isolation("sdpa-flash") == local._isolation("naive") == "torch"
    assert local._isolation("xformers") == "xformers" and local._isolation("flex") == "flex"


def test_a_worker_writing_to_fd_1_does_not_end_the_sweep(tmp_path, faults):
    """Native writes to file descriptor 1 in a worker go to its log, not into the JSON event stream."""
    outcome = execute(_sweep(tmp_path, ["fault-fd1", "sdpa"], sizes=((64, 64),)), workers=True, progress=False)
    run = Run.open(outcome.run_path)
    assert run.cells().set_index("backend")["status"].to_dict() == {"fault-fd1": "ok", "sdpa": "ok"}
    log = (run.path / "worker.log").read_text()
    assert "native chatter on fd 1" in log and "not an event" not in log  # the worker kept it off its stream


def test_a_failed_subprocess_is_one_line_and_the_manifest_says_the_run_ended(tmp_path, monkeypatch, capsys):
    """attnprof run when the availability probe's subprocess dies: one line, exit 1, no traceback; the run's
    manifest is closed (ended_at set), not left open."""
    from profiler import cli
    from profiler.execute import ExecutorError, local
    from profiler.store import list_runs

    def dead(self, asks):
        raise ExecutorError("the availability probe of torch exited with signal SIGSEGV: Fatal Python error")

    monkeypatch.setattr(local.LocalExecutor, "availability", dead)
    code = cli.main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "sdpa", "--device", "cpu",
                     "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("attnprof: error: the availability probe of torch exited with signal "
                                            "SIGSEGV: Fatal Python error")
    manifest = Run.open(list_runs(tmp_path)[-1]).manifest()
    assert manifest["ended_at"] and manifest["interrupted"] is True


def test_a_controlnet_leaves_the_device_when_the_cells_that_run_it_are_done(monkeypatch):
    """In one group, the ControlNet part is freed before the first cell that does not need it starts."""
    import gc
    import weakref

    from profiler.execute.groups import group_events
    from profiler.spec import CellSpec
    from profiler.unet.workload import Workload

    built, make = {}, Workload.make_part
    monkeypatch.setattr(Workload, "make_part", lambda self, which, *a, **k: built.setdefault(
        (which, a[2]), weakref.ref(part := make(self, which, *a, **k))) and part)
    with_cn = CellSpec("tiny-sd15", 64, 64, 1, "float32", "sdpa", "cpu", settings=(("controlnet", True),))
    plain = CellSpec("tiny-sd15", 64, 64, 1, "float32", "sdpa", "cpu")
    alive = []
    for event in group_events([with_cn, plain], 1, 0):
        gc.collect()
        part = built.get(("controlnet", "float32"))
        alive.append((event["event"], part is not None and part() is not None))
        assert event.get("status", "ok") == "ok", event["cell"]["error"]
    assert alive == [("start", False), ("done", True), ("start", False), ("done", False), ("end", False)]
    assert ("controlnet", "float32") in built


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_stop_just_after_the_run_is_made_leaves_it_closed_as_interrupted(tmp_path, monkeypatch, signum):
    """Ctrl-C or a kill in the moment between the run folder's appearance and the sweep's try (its lock being
    taken): the stop is held until the try begins, so the run ends as interrupted with its manifest closed, and the
    signal handlers are the caller's again afterwards."""
    import os
    import signal

    from profiler.execute import stop_on_sigterm

    stop_on_sigterm()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    made = Run.create

    def create_then_stop(*args, **kwargs):
        run = made(*args, **kwargs)
        os.kill(os.getpid(), getattr(signal, signum))  # lands before Run.create has returned
        return run

    monkeypatch.setattr(Run, "create", staticmethod(create_then_stop))
    outcome = execute(_sweep(tmp_path, ["sdpa"], sizes=((64, 64),)), workers=False, progress=False)
    manifest = Run.open(outcome.run_path).manifest()
    assert outcome.interrupted and manifest["interrupted"] is True and manifest["ended_at"]
    assert Run.open(outcome.run_path).cells().empty
    assert {s: signal.getsignal(s) for s in before} == before
