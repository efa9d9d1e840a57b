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
