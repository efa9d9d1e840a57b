"""Sweeps end to end through worker subprocesses: failures kept as rows, resumable after SIGKILL."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from profiler.store import Run, list_runs
from profiler.execute.grid import load
from profiler.execute.sweep import execute

REPO = Path(__file__).resolve().parent.parent


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text + f"out: {tmp_path / 'results'}\n")
    return path


def _wait_for(predicate, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def in_flight(run_dir: Path, cell_id: str, alone: bool = False) -> dict | None:
    """The entry of progress.json for the cell while it runs (alone: while it runs on its own, not with the other
    backends of its shape): its worker's pid and host."""
    try:
        progress = json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return next((c for c in progress["in_flight"] if cell_id in c.get("cell_ids", [c["cell_id"]])
                 and (not alone or c.get("cell_ids") == [cell_id])), None)


def test_failures_are_rows_of_the_right_status(tmp_path):
    path = _write(tmp_path, """models: [tiny-sd15]
sizes: [64x64, 256x256, 512x512]
dtypes: [float32]
backends: [naive, sdpa, xformers]
repeats: 1
warmup: 0
device: cpu
memory_budget: 300MiB
""")
    sweep = load(path)
    victim = next(c for c in sweep.cells() if c.backend == "naive" and c.width == 256)
    proc = subprocess.Popen([sys.executable, "-m", "profiler", "sweep", str(path), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = _wait_for(lambda: list_runs(tmp_path / "results"))[0]

    # killed while its shape's cells run together, they run again each alone; killed again then, it is the one
    os.kill(_wait_for(lambda: in_flight(run_dir, victim.cell_id))["worker_pid"], signal.SIGKILL)
    os.kill(_wait_for(lambda: in_flight(run_dir, victim.cell_id, alone=True))["worker_pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    cells = Run.open(run_dir).cells().set_index("cell_id")
    status = cells["status"].to_dict()
    assert status.pop(victim.cell_id) == "error"
    assert "worker died: signal SIGKILL" in cells.loc[victim.cell_id, "error"]
    by_spec = {(c.backend, c.width): status[c.cell_id] for c in sweep.cells() if c.cell_id in status}
    assert by_spec == {("naive", 64): "ok", ("naive", 512): "skipped", ("sdpa", 64): "ok", ("sdpa", 256): "ok",
                       ("sdpa", 512): "ok", ("xformers", 64): "unavailable", ("xformers", 256): "unavailable",
                       ("xformers", 512): "unavailable"}
    skipped = cells[cells["status"] == "skipped"].iloc[0]
    assert "exceeds the memory budget 300.0 MiB" in skipped["error"] and skipped["predicted_need_bytes"] > 300 * 2**20
    assert "pip install xformers" in cells[cells["status"] == "unavailable"].iloc[0]["error"]
    blocks = Run.open(run_dir).blocks()
    assert blocks.groupby("cell_id").size().to_dict() == {cid: 32 for cid, s in cells["status"].items() if s == "ok"}
    assert "naive" in out and "unavailable" in out  # the closing status table


def test_retry_failed_reruns_exactly_the_cells_that_did_not_end_ok_and_force_runs_skipped(tmp_path, faults):
    """A first pass leaves ok, oom (an injected failure), skipped (over the budget) and unavailable cells. --resume
    --retry-failed runs again exactly the four that are not ok and leaves the ok ones alone; with --force the skipped
    cell runs and ends ok."""
    path = _write(tmp_path, """models: [tiny-sd15]
sizes: [64x64, 128x128]
dtypes: [float32]
backends: [sdpa, naive, fault-text-oom, xformers]
repeats: 1
warmup: 0
device: cpu
memory_budget: 14MiB
""")
    first = Run.open(execute(load(path), workers=False, progress=False).run_path).cells().set_index("cell_id")
    sweep = load(path)
    spec = {c.cell_id: (c.backend, c.width) for c in sweep.cells()}
    status = {spec[cid]: s for cid, s in first["status"].items()}
    assert status == {("sdpa", 64): "ok", ("sdpa", 128): "ok", ("naive", 64): "ok", ("naive", 128): "skipped",
                      ("fault-text-oom", 64): "ok", ("fault-text-oom", 128): "oom",  # 64x64 has no block over 64
                      ("xformers", 64): "unavailable", ("xformers", 128): "unavailable"}
    not_ok = set(first.index[first["status"] != "ok"])

    execute(sweep, resume=True, retry_failed=True, force=True, workers=False, progress=False)  # in this process:
    # which cells run again is the sweep's choice, whatever runs them
    second = Run.open(list_runs(tmp_path / "results")[0]).cells().set_index("cell_id")
    assert len(list_runs(tmp_path / "results")) == 1 and second.index.is_unique and len(second) == 8
    rerun = set(second.index[second["recorded_at"] != first.loc[second.index, "recorded_at"]])
    assert rerun == not_ok
    assert {spec[cid]: s for cid, s in second["status"].items() if cid in not_ok} == {
        ("naive", 128): "ok", ("fault-text-oom", 128): "oom", ("xformers", 64): "unavailable",
        ("xformers", 128): "unavailable"}  # --force ran the skipped cell


def test_resume_continues_the_run_of_the_same_grid_only(tmp_path):
    grid_a = _write(tmp_path, "models: [tiny-sd15]\nsizes: [64x64]\ndtypes: [float32]\nbackends: [sdpa]\n"
                              "repeats: 1\nwarmup: 0\ndevice: cpu\n")
    run_a = execute(load(grid_a), workers=False, progress=False).run_path
    grid_b = tmp_path / "other.yaml"
    grid_b.write_text(grid_a.read_text().replace("[sdpa]", "[naive]"))
    run_b = execute(load(grid_b), resume=True, workers=False, progress=False).run_path  # nothing of grid b yet
    assert run_b != run_a and len(list_runs(tmp_path / "results")) == 2
    assert Run.open(run_b).cells()["backend"].tolist() == ["naive"]
    cells_a = Run.open(run_a).cells()
    assert execute(load(grid_a), resume=True, workers=False, progress=False).run_path == run_a  # not the latest
    assert Run.open(run_a).cells()["recorded_at"].tolist() == cells_a["recorded_at"].tolist()  # nothing to redo


def test_a_cell_over_timeout_s_is_stopped_and_the_sweep_goes_on(tmp_path, faults):
    """fault-slow (SDPA, 0.3 s late on each of tiny-sd15's 32 calls: about 67 s over its 7 forwards) is stopped at
    timeout_s; the sdpa cell after it runs. 20 s: a 64x64 cell's worker start, build and reference took over 10 s on
    a loaded 2-core machine. (A slow cell made of a real backend at a large size ran within the limit when the
    machine was idle.)"""
    path = _write(tmp_path, """models: [tiny-sd15]
sizes: [64x64]
dtypes: [float32]
backends: [fault-slow, sdpa]
repeats: 5
warmup: 1
device: cpu
timeout_s: 20
""")
    t0 = time.time()
    outcome = execute(load(path), progress=False)
    cells = Run.open(outcome.run_path).cells().set_index("backend")
    assert cells.loc["fault-slow", "status"] == "timeout" and "timeout_s=20" in cells.loc["fault-slow", "error"]
    assert cells.loc["sdpa", "status"] == "ok"
    assert time.time() - t0 < 120  # the slow cell alone would take over a minute
    assert (outcome.run_path / "worker.log").is_file()


def test_ctrl_c_leaves_a_consistent_run_that_show_reads(tmp_path):
    path = _write(tmp_path, """models: [tiny-sd15]
sizes: [64x64, 128x128, 256x256]
dtypes: [float32]
backends: [sdpa, naive]
repeats: 2
warmup: 0
device: cpu
""")
    proc = subprocess.Popen([sys.executable, "-m", "profiler", "sweep", str(path), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    run_dir = _wait_for(lambda: list_runs(tmp_path / "results"))[0]
    _wait_for(lambda: len(Run.open(run_dir).cells()) >= 1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "run again with --resume" in err, err
    run = Run.open(run_dir)
    assert run.manifest()["interrupted"] is True
    cells = run.cells()
    assert 1 <= len(cells) < 6 and cells["cell_id"].is_unique
    assert set(run.blocks()["cell_id"]) <= set(cells["cell_id"])
    show = subprocess.run([sys.executable, "-m", "profiler", "show", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True)
    assert show.returncode == 0 and "tiny-sd15" in show.stdout


def test_sigkill_of_the_whole_sweep_then_two_resumes_at_once_record_each_cell_once(tmp_path):
    """The sweep's whole process group killed after two cells, then two resumes started at once: the second finds
    the run held and says by whom (exit 2); the first records the missing cells once, the killed sweep's rows and
    blocks left as they were."""
    path = _write(tmp_path, """models: [tiny-sd15]
sizes: [64x64, 128x128, 192x192]
dtypes: [float32]
backends: [sdpa, naive]
repeats: 1
warmup: 0
device: cpu
""")
    first = subprocess.Popen([sys.executable, "-m", "profiler", "sweep", str(path), "--quiet"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = _wait_for(lambda: list_runs(tmp_path / "results"))[0]
    _wait_for(lambda: len(Run.open(run_dir).cells()) >= 2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    finished = Run.open(run_dir).cells().set_index("cell_id")
    assert 2 <= len(finished) < 6
    finished_blocks = Run.open(run_dir).blocks()  # still readable after the kill
    started = time.time()
    both = [subprocess.Popen([sys.executable, "-m", "profiler", "sweep", str(path), "--resume", "--quiet"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = sorted((p.wait(timeout=300), p.stderr.read()) for p in both)
    assert [code for code, _ in results] == [0, 2], results
    busy = results[1][1].strip().splitlines()
    assert len(busy) == 1 and f"run {run_dir.name} is being run by pid" in busy[0] and "--resume" in busy[0]
    cells = Run.open(run_dir).cells().set_index("cell_id")
    assert len(cells) == 6 and cells.index.is_unique and set(cells["status"]) == {"ok"}
    kept = cells.loc[finished.index]  # the cells finished before the kill: their rows untouched
    assert kept["wall_s"].tolist() == finished["wall_s"].tolist()
    assert kept["recorded_at"].tolist() == finished["recorded_at"].tolist()
    new = cells.drop(finished.index)  # only the missing ones ran
    assert len(new) == 6 - len(finished) and (pd.to_datetime(new["recorded_at"]).map(lambda t: t.timestamp())
                                              >= started).all()
    blocks = Run.open(run_dir).blocks()
    assert not blocks.duplicated(["cell_id", "call_index"]).any() and len(blocks) == 6 * 32
    again = blocks[blocks["cell_id"].isin(finished.index)].sort_values(["cell_id", "call_index"])
    assert again["time_ms"].tolist() == finished_blocks.sort_values(["cell_id", "call_index"])["time_ms"].tolist()
    assert Run.open(run_dir).manifest()["ended_at"] is not None


def test_sigint_to_the_parent_alone_stops_the_run_and_its_worker(tmp_path, faults):
    """`kill -INT PID` of a run started as a background job of a script (SIGINT inherited ignored): the run ends
    as interrupted, its worker with it, the cell in flight not recorded as a worker death. Within 60 s: the cell
    alone is 192 s of waits (fault-slow: 0.3 s on each of 32 calls, 20 forwards), whatever the machine's load (the
    bound was 10 s, which a loaded machine's worker start and teardown can pass)."""
    import secrets

    from tests.procs import alive

    token = secrets.token_hex(8)
    argv = ["profiler", "run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "fault-slow", "--dtype",
            "float32", "--device", "cpu", "--repeats", "20", "--warmup", "0", "--quiet", "--out",
            str(tmp_path / "results")]
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "ATTNPROF_TEST_TOKEN": token}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` leaves it
    run_dir = _wait_for(lambda: list_runs(tmp_path / "results"))[0]
    _wait_for(lambda: (run_dir / "worker.log").exists() and len(alive(token)) >= 2)
    time.sleep(2)  # the worker in its cell
    t0 = time.time()
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    assert time.time() - t0 < 60 and proc.returncode == 130
    _wait_for(lambda: not alive(token), timeout=30)
    run = Run.open(run_dir)
    assert run.manifest()["interrupted"] is True
    cells = run.cells()
    assert not len(cells) or "worker died" not in " ".join(cells["error"].astype(str))
