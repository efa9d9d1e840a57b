"""Sweeps through Ray on this CPU machine (a local Ray with 2 CPUs): the same cells and statuses as the local
executor, a killed Ray worker's cell `error` while the others end ok, timeouts, where each cell ran."""
import os
import signal
import threading
import time
from dataclasses import replace

import pytest

from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute
from profiler.spec import InputError
from profiler.store import Run, list_runs
from tests.test_sweep_run import _wait_for, in_flight

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module, its workers loading the test faults (tests/faults.py)."""
    from profiler.execute.ray import connect

    old = os.environ.get("ATTNPROF_PLUGINS")
    os.environ["ATTNPROF_PLUGINS"] = "tests.faults"
    connect(None, num_cpus=2)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("ATTNPROF_PLUGINS", None)
    else:
        os.environ["ATTNPROF_PLUGINS"] = old


def _sweep(tmp_path, **kw) -> Sweep:
    base = Sweep(models=("tiny-sd15",), sizes=((64, 64), (128, 128)), dtypes=("float32",), device="cpu", repeats=1,
                 warmup=0, backends=(("naive", ()), ("sdpa", ()), ("fault-text-oom", ()), ("xformers", ())),
                 out=str(tmp_path / "results"))
    return replace(base, **kw)


def test_a_sweep_through_ray_records_the_cells_the_local_executor_does(tmp_path, local_ray, faults):
    local = Run.open(execute(_sweep(tmp_path, out=str(tmp_path / "local")), workers=False,  # in this process: the
                             progress=False).run_path).cells()  # same cells and statuses, no worker to start
    through_ray = Run.open(execute(_sweep(tmp_path, executor="ray", trace=True), progress=False).run_path)
    cells = through_ray.cells()
    assert cells["cell_id"].tolist() == local["cell_id"].tolist()
    assert cells["status"].tolist() == local["status"].tolist()
    assert set(cells["status"]) == {"ok", "oom", "unavailable"}
    ran = cells[cells["status"].isin(["ok", "oom"])]
    assert ran["host"].notna().all() and ran["device_name"].notna().all()  # where each cell ran
    assert set(ran["torch_threads"]) == {1}  # a CPU task holds one CPU: Ray gives its worker one thread
    assert through_ray.manifest()["environment"]["executor"] == "ray"
    assert through_ray.blocks().groupby("cell_id").size().eq(32).all()
    assert not (through_ray.path / "progress.json").exists()
    manifest = through_ray.manifest()  # the device's limits, measured by a Ray task (as on a GPU: not the driver)
    assert manifest["device_peak_flops"]["float32"] > 0 and manifest["device_peak_bytes_per_s"] > 0
    ok = cells[cells["status"] == "ok"]  # each ok cell's trace, sent back by its task and stored by the driver
    assert [list(f) for f in ok["trace_files"]] == [[f"traces/{c}.trace.json"] for c in ok["cell_id"]]
    assert all((through_ray.path / f[0]).stat().st_size > 1000 for f in ok["trace_files"])


def test_killing_the_ray_worker_of_a_cell_leaves_it_error_and_the_rest_ok(tmp_path, local_ray):
    sweep = _sweep(tmp_path, executor="ray", sizes=((64, 64), (128, 128), (192, 192)), repeats=3,
                   backends=(("naive", ()), ("sdpa", ())))
    victim = next(c for c in sweep.cells() if c.backend == "naive" and c.width == 128)
    thread = threading.Thread(target=execute, args=(sweep,), kwargs={"progress": False})
    thread.start()
    run_dir = _wait_for(lambda: list_runs(tmp_path / "results"))[0]
    # killed while its shape's cells run together, they run again each alone; killed again then, it is the one
    os.kill(_wait_for(lambda: in_flight(run_dir, victim.cell_id))["worker_pid"], signal.SIGKILL)
    os.kill(_wait_for(lambda: in_flight(run_dir, victim.cell_id, alone=True))["worker_pid"], signal.SIGKILL)
    thread.join(timeout=300)
    cells = Run.open(run_dir).cells().set_index("cell_id")
    assert len(cells) == 6 and cells.loc[victim.cell_id, "status"] == "error"
    assert cells.loc[victim.cell_id, "error"].startswith("worker died: Ray: WorkerCrashedError")
    assert set(cells.drop(victim.cell_id)["status"]) == {"ok"}


def test_a_cell_past_timeout_s_is_stopped_on_ray_and_the_rest_go_on(tmp_path, local_ray, faults):
    """fault-slow-big (tests/faults.py) is 0.3 s late on each of tiny-sd15's 10 calls of 256 tokens at 128x128 (the
    first level's 2 down and 3 up transformer blocks, self and cross each): 3 s of waits a forward, its cell past
    timeout_s=15 whatever the machine's load; at 64x64 (no call over 64 tokens) it is SDPA, a second of work. (A
    real backend at 512x512 against 8 s had the 64x64 cell time out too on a loaded machine.)"""
    sweep = _sweep(tmp_path, executor="ray", sizes=((128, 128), (64, 64)), backends=(("fault-slow-big", ()),),
                   repeats=5, timeout_s=15)
    t0 = time.time()
    cells = Run.open(execute(sweep, progress=False).run_path).cells().set_index("width")
    assert cells.loc[128, "status"] == "timeout" and "timeout_s=15" in cells.loc[128, "error"]
    assert cells.loc[64, "status"] == "ok"
    assert time.time() - t0 < 120


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a local Ray here has GPUs")
def test_a_cuda_sweep_on_a_cluster_without_gpus_is_refused_before_anything_runs(tmp_path, local_ray):
    with pytest.raises(InputError, match="the Ray cluster has no GPU: use device cpu or auto"):
        execute(_sweep(tmp_path, executor="ray", device="cuda"), progress=False)
    with pytest.raises(InputError, match="give cuda \\(or auto\\): Ray gives each task its GPU"):
        execute(_sweep(tmp_path, executor="ray", device="cuda:1"), progress=False)
    assert not (tmp_path / "results").exists()
