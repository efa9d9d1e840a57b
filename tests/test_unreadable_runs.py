"""Every command that reads a run, on a run with a torn cells.parquet and on one with a torn manifest.json: one line
naming the file and what is wrong, exit 2, no traceback; `attnprof runs` still lists the good run beside them."""
import pytest

from profiler.cli import main
from profiler.store import Run

CELL = {"cell_id": "c1", "model": "tiny-sd15", "width": 64, "height": 64, "batch": 1, "dtype": "float32",
        "backend": "sdpa", "backend_options": "{}", "settings": "{}", "status": "ok", "attention_time_ms": 1.0,
        "attention_time_samples_ms": [1.0, 1.0, 1.0], "attention_peak_mem_bytes": 1.0}


@pytest.fixture
def results(tmp_path):
    """good, bad-cells (cells.parquet cut short) and bad-manifest (manifest.json cut short), each of one cell."""
    for name in ("good", "bad-cells", "bad-manifest"):
        run = Run.create(tmp_path, {"command": "test", "cells": [{"cell_id": "c1"}], "environment": {}},
                         run_id=name)
        run.record(CELL, [])
        run.compact()
    cells = tmp_path / "bad-cells" / "cells.parquet"
    cells.write_bytes(cells.read_bytes()[:40])
    manifest = tmp_path / "bad-manifest" / "manifest.json"
    manifest.write_text(manifest.read_text()[:30])
    return tmp_path


@pytest.mark.parametrize("run, file, cause", [("bad-cells", "cells.parquet", "ArrowInvalid"),
                                              ("bad-manifest", "manifest.json", "JSONDecodeError")])
@pytest.mark.parametrize("command", [["show", "{run}"], ["diff", "good", "{run}"], ["diff", "{run}", "good"],
                                     ["report", "{run}", "--html", "{out}"], ["replay", "{run}", "--quiet"]])
def test_a_command_on_an_unreadable_run_says_which_file_in_one_line(results, run, file, cause, command, capsys):
    argv = [a.format(run=run, out=results / "r.html") for a in command]
    assert main([*argv, "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnprof: error: "), err
    assert f"{results / run / file} cannot be read ({cause}: " in err
    assert f"move the run folder {results / run} out of the results folder" in err
    assert not (results / "r.html").exists()


def test_runs_lists_the_good_run_and_marks_the_unreadable_ones(results, capsys):
    assert main(["runs", "--results", str(results)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(lines) == {"good", "bad-cells", "bad-manifest"}
    assert "1: 1 ok" in lines["good"] and "unreadable" not in lines["good"]
    assert "unreadable: ArrowInvalid" in lines["bad-cells"] and "unreadable: JSONDecodeError" in lines["bad-manifest"]
    assert not any("nan" in line for line in lines.values())


def test_new_work_beside_an_unreadable_run_passes_it_over_with_one_warning(results, capsys):
    """A torn run in the results folder: plan --results, run into the folder, show and runs go on, each
    naming it once on stderr (no exit 2, no stub run left by a refusal)."""
    args = ["--model", "tiny-sd15", "--size", "64x64", "--dtype", "float32", "--device", "cpu"]
    assert main(["plan", *args, "--results", str(results)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: passed over bad-manifest") == 1 and "manifest.json cannot be read" in err
    before = {p.name for p in results.iterdir()}
    assert main(["run", *args, "--backend", "sdpa", "--repeats", "1", "--warmup", "0", "--in-process", "--quiet",
                 "--out", str(results)]) == 0
    made = {p.name for p in results.iterdir()} - before
    assert len(made) == 1  # the new run, whole
    new = made.pop()
    assert main(["show", new, "--results", str(results)]) == 0  # (latest: by name, the synthetic "good" run here)
    assert f"run {new}" in capsys.readouterr().out
    assert main(["runs", "--results", str(results)]) == 0
    assert "unreadable" in capsys.readouterr().out
