"""The store: one pair of files per cell, written atomically under the run's lock; readers see whole cells only;
concurrent writers lose nothing; compaction; runs of the earlier single-file layout stay readable; one executor."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from profiler.spec import InputError
from profiler.store import Run, RunBusy, add_to_cache, find_run, list_runs, read_cache

REPO = Path(__file__).resolve().parent.parent


def _cell(cid: str, **extra) -> dict:
    return {"cell_id": cid, "status": "ok", "time_ms": 1.5, **extra}


def _blocks(cid: str, n: int, value: float = 1.0) -> list[dict]:
    return [{"cell_id": cid, "call_index": i, "time_samples_ms": [value, 2.0]} for i in range(n)]


def test_round_trip_a_cell_recorded_again_replaces_its_rows(tmp_path):
    run = Run.create(tmp_path, {"command": "test", "cells": [{"cell_id": "c2"}, {"cell_id": "c1"}]}, run_id="r1")
    run.record(_cell("c1"), _blocks("c1", 3))
    run.record(_cell("c1", time_ms=2.5), _blocks("c1", 2, 9.0))  # again: replaces, does not add
    run.record({"cell_id": "c2", "status": "oom", "error": "out of memory"}, [])
    again = Run.open(tmp_path / "r1")
    cells = again.cells()
    assert cells["cell_id"].tolist() == ["c2", "c1"]  # the grid's order
    assert cells.set_index("cell_id")["time_ms"].to_dict()["c1"] == 2.5
    assert cells.set_index("cell_id")["error"].fillna("-").to_dict() == {"c2": "out of memory", "c1": "-"}
    b = again.blocks()
    assert len(b) == 2 and [list(x) for x in b["time_samples_ms"]] == [[9.0, 2.0], [9.0, 2.0]]
    assert again.done_cells() == {"c2": "oom", "c1": "ok"}
    assert [p.name for p in list_runs(tmp_path)] == ["r1"] and find_run(tmp_path, "latest").id == "r1"
    assert sorted(p.name for p in (run.path / "blocks").iterdir()) == [f"c1.{cells.iloc[1]['blocks_version']}.parquet"]
    assert not list(run.path.rglob("*.tmp"))  # no temporary files left behind


def test_blocks_without_their_cell_row_are_left_out_and_compaction_drops_them(tmp_path):
    """A kill between a cell's two writes leaves block rows without the cell row that names them."""
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    run.record(_cell("c1"), _blocks("c1", 3))
    pd.DataFrame(_blocks("c1", 5)).to_parquet(run.path / "blocks" / "c1.deadbeef0000.parquet")  # a killed re-record
    pd.DataFrame(_blocks("c9", 4)).to_parquet(run.path / "blocks" / "c9.0123456789ab.parquet")  # a killed first one
    assert run.blocks()["cell_id"].tolist() == ["c1"] * 3
    run.compact()
    assert run.blocks()["cell_id"].tolist() == ["c1"] * 3 and not list((run.path / "blocks").iterdir())


def test_compaction_folds_the_files_and_keeps_every_row(tmp_path):
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    for i in range(5):
        run.record(_cell(f"c{i}"), _blocks(f"c{i}", i + 1))
    run.record({"cell_id": "c5", "status": "error", "error": "boom"}, [])
    before = run.cells(), run.blocks()
    run.compact()
    assert not list((run.path / "cells").iterdir()) and not list((run.path / "blocks").iterdir())
    assert (run.path / "cells.parquet").is_file() and (run.path / "blocks.parquet").is_file()
    pd.testing.assert_frame_equal(run.cells(), before[0])
    pd.testing.assert_frame_equal(run.blocks(), before[1])
    run.record(_cell("c2", time_ms=7.0), _blocks("c2", 1))  # recorded again after compaction: the new rows win
    assert run.cells().set_index("cell_id").loc["c2", "time_ms"] == 7.0 and len(run.cells()) == 6
    assert run.blocks().groupby("cell_id").size().to_dict() == {"c0": 1, "c1": 2, "c2": 1, "c3": 4, "c4": 5}
    run.compact()
    assert run.blocks().groupby("cell_id").size().to_dict() == {"c0": 1, "c1": 2, "c2": 1, "c3": 4, "c4": 5}


def test_a_run_in_the_earlier_single_file_layout_stays_readable_and_resumable(tmp_path):
    path = tmp_path / "20261129-120000-abcd"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"run_id": path.name, "cells": [{"cell_id": "a"},
                                                                                   {"cell_id": "b"}]}))
    pd.DataFrame([{"run_id": path.name, "cell_id": "a", "status": "ok", "time_ms": 3.0}]).to_parquet(
        path / "cells.parquet", index=False)
    pd.DataFrame([{"run_id": path.name, "cell_id": "a", "call_index": i} for i in range(4)]).to_parquet(
        path / "blocks.parquet", index=False)
    run = Run.open(path)
    assert run.cells()["cell_id"].tolist() == ["a"] and len(run.blocks()) == 4
    run.record(_cell("b"), _blocks("b", 2))  # resumed: the new cell in its own files
    assert run.cells()["cell_id"].tolist() == ["a", "b"]
    assert run.blocks().groupby("cell_id").size().to_dict() == {"a": 4, "b": 2}
    run.compact()
    assert run.blocks().groupby("cell_id").size().to_dict() == {"a": 4, "b": 2}


WRITER = """
import sys
from profiler.store import Run
run, who, n = Run.open(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(n):
    cid = f"shared{i % 10}" if i % 3 == 0 else f"{who}{i}"
    run.record({"cell_id": cid, "status": "ok", "writer": who}, [{"cell_id": cid, "call_index": k} for k in range(7)])
"""


def test_two_processes_recording_into_one_run_lose_nothing_and_readers_see_whole_cells(tmp_path):
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(run.path), who, str(n)], cwd=REPO)
             for who in ("a", "b")]
    partial_reads = 0
    while any(p.poll() is None for p in procs):
        cells, blocks = run.read()  # one consistent view of both
        if len(cells):
            sizes = blocks.groupby("cell_id").size()
            assert set(sizes.index) == set(cells["cell_id"]) and (sizes == 7).all()  # whole cells only
            partial_reads += 1
        time.sleep(0.01)
    assert all(p.wait() == 0 for p in procs)
    cells = run.cells()
    expected = {f"shared{i}" for i in range(10)} | {f"{w}{i}" for w in "ab" for i in range(n) if i % 3}
    assert set(cells["cell_id"]) == expected and cells["cell_id"].is_unique
    assert run.blocks().groupby("cell_id").size().eq(7).all() and len(run.blocks()) == 7 * len(expected)
    assert partial_reads > 0  # the reader did read while both wrote


def test_one_executor_at_a_time_the_second_is_told_who_holds_the_run(tmp_path):
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    with run.executor("attnprof sweep a.yaml --resume"):
        with pytest.raises(RunBusy, match=r"run r1 is being run by pid \d+ on .* \(attnprof sweep a.yaml --resume\): "
                                          r"wait for it to end, or stop it and run again with --resume"):
            with Run.open(run.path).executor("attnprof sweep a.yaml --resume"):
                pass
    with run.executor("again"):  # released on exit
        pass
    assert not (run.path / "executor.json").exists()


def test_a_holder_file_left_by_a_killed_process_is_not_named_as_the_holder(tmp_path):
    """A resume that is killed leaves its executor.json; the next one takes the lock and writes its own just after.
    A third that finds the lock held in between names the new holder (read again until it names a live process),
    never the dead one, and else "another process"."""
    import os
    import socket
    import threading

    from profiler.store import EXECUTOR_LOCK, _flock

    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = run.path / "executor.json"
    holder.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then",
                                  "command": "attnprof sweep a.yaml"}))
    with _flock(run.path / EXECUTOR_LOCK, blocking=False) as got:  # the lock taken, the holder not written yet
        assert got
        late = threading.Timer(0.3, lambda: holder.write_text(json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "since": "now", "command": "sweep b.yaml --resume"})))
        late.start()
        with pytest.raises(RunBusy, match=rf"run r1 is being run by pid {os.getpid()} on .* \(sweep b.yaml "
                                          r"--resume\): wait for it to end, or stop it and run again with --resume"):
            with Run.open(run.path).executor("attnprof sweep a.yaml --resume"):
                pass
        late.join()
        holder.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then",
                                      "command": "attnprof sweep a.yaml"}))
        with pytest.raises(RunBusy, match=r"run r1 is being run by another process: wait"):
            with Run.open(run.path).executor("attnprof sweep a.yaml --resume"):
                pass


def test_each_file_is_flushed_before_it_is_moved_into_place_and_the_move_after(tmp_path, monkeypatch):
    import os

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a), str(b))) or replace(a, b))
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    events.clear()
    run.record(_cell("c1"), _blocks("c1", 2))
    moves = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert len(moves) == 2  # the block rows, then the cell row
    for i in moves:
        tmp, dest = events[i][1], events[i][2]
        assert events[i - 1] == ("fsync", tmp)  # the file's bytes are on disk before it takes the name
        assert events[i + 1] == ("fsync", str(Path(dest).parent))  # and the new name is, once the folder is flushed


def test_a_lock_that_cannot_be_taken_for_writing_is_an_error_not_a_lock_free_write(tmp_path):
    """Reading needs no write access; writing without the lock would let two writers lose rows, so it is refused in
    one line."""
    from profiler.spec import InputError

    run = Run.create(tmp_path, {"command": "test", "cells": [{"cell_id": "c1"}]}, run_id="r1")
    run.record(_cell("c1"), _blocks("c1", 1))
    (run.path / ".lock").unlink()
    (run.path / ".lock").mkdir()  # something that cannot be opened for writing (root ignores permissions)
    with pytest.raises(InputError, match="cannot lock .*/r1/.lock to write the run"):
        run.record(_cell("c2"), [])
    assert run.cells()["cell_id"].tolist() == ["c1"]  # still readable, and nothing was written
    assert not (run.path / "cells" / "c2.parquet").exists()


def test_a_run_is_its_folder_whatever_id_its_files_carry(tmp_path):
    """A run copied or renamed (gathered from two machines) reads as its folder: its rows' run_id is the folder's
    name, so two copies of one run are two runs."""
    import shutil

    run = Run.create(tmp_path, {"command": "test", "cells": [{"cell_id": "c1"}]}, run_id="r1")
    run.record(_cell("c1"), _blocks("c1", 2))
    run.compact()
    shutil.copytree(run.path, tmp_path / "r1-h100copy")
    copy = find_run(tmp_path, "r1-h100copy")
    assert copy.manifest()["run_id"] == "r1" and copy.id == "r1-h100copy"
    cells, blocks = copy.read()
    assert set(cells["run_id"]) == {"r1-h100copy"} and set(blocks["run_id"]) == {"r1-h100copy"}
    assert set(Run.open(run.path).cells()["run_id"]) == {"r1"}


def test_a_stop_while_a_run_is_created_leaves_no_run_folder_without_its_manifest(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which the sweep turns into it) during the manifest's write: no folder is left behind, not
    a bare run folder that every reader would call unreadable; a second create of the same id then works."""
    from profiler import store

    real = store.write_json

    def stopped(path, data):
        real(path, data)
        raise KeyboardInterrupt  # after the manifest is written, before the folder has its name

    monkeypatch.setattr(store, "write_json", stopped)
    with pytest.raises(KeyboardInterrupt):
        Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    assert list(tmp_path.iterdir()) == [] and list_runs(tmp_path) == []
    monkeypatch.setattr(store, "write_json", real)
    run = Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    assert list_runs(tmp_path) == [run.path] and run.manifest()["ended_at"] is None
    with pytest.raises(InputError, match="cannot write the results folder"):
        Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")  # that id is taken


def test_a_run_still_being_made_is_not_listed(tmp_path):
    """Run.create writes the manifest in a hidden staging folder, then renames it into place: a reader listing the
    folder in between must not see the staging folder as a run (it is gone a moment later)."""
    Run.create(tmp_path, {"command": "test", "cells": []}, run_id="r1")
    staging = tmp_path / ".r2.new"
    staging.mkdir()
    (staging / "manifest.json").write_text(json.dumps({"run_id": "r2"}))
    assert [p.name for p in list_runs(tmp_path)] == ["r1"]


def test_a_cache_file_keeps_its_other_keys_and_one_that_cannot_be_written_is_no_error(tmp_path):
    """The device limits' and the time model's caches (store.add_to_cache): a key added beside the others; a file
    missing, torn or not an object reads as empty; a folder that cannot be made leaves the cache unwritten, no error
    (the figures are measured or fitted again next time)."""
    path = tmp_path / "cache" / "c.json"
    assert read_cache(path) == {}
    add_to_cache(path, "a", {"x": 1})
    add_to_cache(path, "b", 2)
    assert read_cache(path) == {"a": {"x": 1}, "b": 2}
    for text in ("[1, 2]", "{torn"):
        path.write_text(text)
        assert read_cache(path) == {}
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    add_to_cache(blocked / "c.json", "a", 1)  # its folder would be a file
    assert read_cache(blocked / "c.json") == {}


def test_runs_made_within_one_second_sort_as_they_were_made_and_an_id_taken_is_never_reused(tmp_path, monkeypatch):
    """'latest' is the run made last, also among runs made in the same second (the dashboard's Generation page, show
    latest and diff pick it); an id that another run took in the same 15 us is passed over for a new one."""
    from profiler import store

    made = [Run.create(tmp_path, {"kind": "sweep"}).id for _ in range(30)]
    assert [p.name for p in list_runs(tmp_path)] == made and find_run(tmp_path, "latest").id == made[-1]
    ids = iter([made[0], made[0], "20991231-235959-00000"])  # taken twice, then free
    monkeypatch.setattr(store, "new_run_id", lambda: next(ids))
    assert Run.create(tmp_path, {"kind": "sweep"}).id == "20991231-235959-00000"
    with pytest.raises(store.InputError, match="a run of that id exists"):  # an id the caller names: never replaced
        Run.create(tmp_path, {"kind": "sweep"}, run_id=made[1])
