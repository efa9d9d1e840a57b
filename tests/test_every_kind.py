"""One results folder holding a run of every kind a user makes (store.RUN_KINDS): a sweep in process and one through
workers, an `attnprof run` with two configs of one backend, a compiled run, a replay, a tune, make gpu-check's CPU
runs, a recorded generation, and an interrupted run; every command that reads runs, over all of it: no traceback, each run
used or passed over with its kind named."""
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.cli import main
from profiler.store import Run, list_runs
from tests.test_profile import gen

REPO = Path(__file__).resolve().parent.parent


def _copy_runs(source: Path, root: Path) -> list[str]:
    names = []
    for path in list_runs(source):
        shutil.copytree(path, root / path.name)
        names.append(path.name)
    return names


def _interrupted(root: Path, source: Path) -> str:
    """A copy of a finished run whose manifest plans one cell more than it recorded, closed as interrupted (what a
    Ctrl-C mid-sweep leaves)."""
    path = root / f"{source.name[:-4]}dead"
    shutil.copytree(source, path)
    m = json.loads((path / "manifest.json").read_text())
    never = {**m["cells"][0], "backend": "split", "cell_id": "feedfacecafe"}
    m.update(cells=[*m["cells"], never], interrupted=True)
    (path / "manifest.json").write_text(json.dumps(m))
    return path.name


def _stopped_record(root: Path, source: Path) -> str:
    """A copy of a recorded generation as attnprof record leaves one stopped by a Ctrl-C after that generation ended:
    its cell marked partial, the run interrupted, its script's backend (the loaded processors) left to finish."""
    import pandas as pd

    path = root / f"{source.name[:-4]}stop"
    shutil.copytree(source, path)
    for cell in (path / "cells").glob("*.parquet"):
        pd.read_parquet(cell).assign(partial=True).to_parquet(cell, index=False)
    m = json.loads((path / "manifest.json").read_text())
    m["record"] = {**m.get("record", {}), "script": str(path / "gen.py"), "args": [], "backends": [None]}
    m.update(interrupted=True)
    (path / "manifest.json").write_text(json.dumps(m))
    return path.name


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory, dashboard_results, mixed_results, traced_results, compiled_results,
               gpu_check_dry_run):
    from profiler import profile

    root = tmp_path_factory.mktemp("every") / "results"
    root.mkdir()
    kinds = {"sweep in process": _copy_runs(dashboard_results, root)[0]}
    kinds["sweep and runs"] = _copy_runs(mixed_results.root, root)
    kinds["through workers, traced"] = _copy_runs(traced_results[0], root)[0]
    kinds["compiled"] = _copy_runs(compiled_results, root)[0]
    kinds["interrupted"] = _interrupted(root, root / kinds["sweep in process"])
    kinds["gpu-check"] = _copy_runs(Path(gpu_check_dry_run["out"]) / "runs", root)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["replay", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--repeats", "2",
                     "--out", str(root), "--quiet"]) == 0
    kinds["replay"] = next(p.name for p in list_runs(root) if Run.open(p).kind.name == "replay")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["tune", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--backend", "naive",
                     "--backend", "sdpa", "--proof-rounds", "3", "--out", str(root), "--quiet"]) == 0
    kinds["tune"] = next(p.name for p in list_runs(root) if Run.open(p).kind.name == "tune")
    pipe = gen.tiny_pipeline()
    with profile(pipe, out=root) as prof:
        gen.generate(pipe, steps=3)
    kinds["record"] = prof.run_dir.name
    kinds["record, stopped"] = _stopped_record(root, prof.run_dir)
    return root, kinds


def _ok(argv: list[str], code: int = 0) -> str:
    """attnprof ARGV (its main, in this process: a traceback would fail the test), exit `code`; its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == code, argv
    return out.getvalue()


def test_every_kind_is_there(every_kind):
    root, kinds = every_kind
    found = {Run.open(p).kind.name for p in list_runs(root)}
    assert found == {"sweep", "replay", "record", "tune"} and len(list_runs(root)) >= 11
    commands = {Run.open(p).manifest().get("command", "") for p in list_runs(root)}
    assert any(c.startswith("gpu-check") for c in commands)


def test_runs_show_and_findings_read_every_run(every_kind):
    root, kinds = every_kind
    listed = _ok(["runs", "--results", str(root)])
    for path in list_runs(root):
        assert path.name in listed
        shown = _ok(["show", path.name, "--results", str(root)])
        assert f"run {path.name}" in shown or f"replay {path.name}" in shown
    assert "incomplete: 1 of" in listed  # the interrupted run, named as such
    assert "StableDiffusionPipeline (loaded, 3 steps at 64x64, batch 2) took" in \
        _ok(["show", kinds["record"], "--results", str(root)])
    assert "interrupted: no complete cell of loaded (attnprof record --resume finishes it)" in " ".join(listed.split())
    stopped = " ".join(_ok(["show", kinds["record, stopped"], "--results", str(root), "--wide"]).split())
    assert "(its cells partial: the generations that ended before the stop)" in stopped and "partial:" in stopped


def test_diff_takes_every_pair_with_the_first_run(every_kind):
    root, kinds = every_kind
    first = kinds["sweep in process"]
    for path in list_runs(root):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["diff", first, path.name, "--results", str(root)]) in (0, 1, 3), path.name
        assert "cells matched" in out.getvalue()


def test_the_time_model_leaves_out_what_it_cannot_fit_on_and_says_so(every_kind):
    root, kinds = every_kind
    planned = _ok(["plan", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--backend", "sdpa",
                   "--dtype", "float32", "--results", str(root)])
    replay, tune = kinds["replay"], kinds["tune"]
    passed = sorted([f"{replay}: replay: not forwards of a model timed whole",
                     f"{tune}: tune: not forwards of a model timed whole"])
    said = " ".join(planned.split())  # the footer wrapped at the terminal's width
    # each named (a run far off the others may be left out too: calibration.outlier, how far depends on the machine)
    assert re.search(r"left out \d runs \(", said) and all(p in said for p in passed), said
    from profiler.bench import time_model_error

    assert all(p in time_model_error(root) for p in passed)  # a recorded generation is calibration data
    from profiler.execute.grid import Sweep
    from profiler.measure.limits import device_limits
    from profiler.planner.calibration import predict_cells

    cells = Sweep(models=("tiny-sd15",), sizes=((64, 64),), dtypes=("float32",), device="cpu").cells()
    eta = predict_cells(cells, device_limits("cpu", ["float32"]), root)  # what a run or sweep says before it runs
    assert eta[cells[0].cell_id]["predicted_forward_time_ms"] > 0


def test_replay_takes_a_named_run_and_says_why_not_a_recorded_one(every_kind):
    root, kinds = every_kind
    done = subprocess.run([sys.executable, "-m", "profiler", "replay", kinds["record"], "--results", str(root),
                           "--out", str(root.parent / "replays"), "--device", "cpu", "--quiet"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # as a user meets it: one line, exit 2
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"attnprof: error: run {kinds['record']} is a record run (a user's own generation as it ran (attnprof record, "
        "profiler.profile)): its models are not named configs to rebuild; replay a run of attnprof run or sweep, or "
        "--model and --size"]
    _ok(["replay", kinds["sweep in process"], "--results", str(root), "--out", str(root.parent / "replays"),
         "--device", "cpu", "--repeats", "1", "--quiet"])


def test_the_report_and_the_dashboard_take_every_run(every_kind, tmp_path, monkeypatch):
    pytest.importorskip("streamlit")
    pytest.importorskip("vl_convert")
    from tests.test_dashboard_app import _app

    root, kinds = every_kind
    names = [p.name for p in list_runs(root)]
    _ok(["report", *names, "--results", str(root), "--html", str(tmp_path / "all.html")])
    assert (tmp_path / "all.html").stat().st_size > 10_000
    from dashboards import transforms as T

    index = T.load_index(root).set_index("run_id")  # a profile()'s run named in the Runs table, not blank
    assert index.loc[kinds["record"], ["kind", "models", "backends"]].tolist() == [
        "record", "StableDiffusionPipeline UNet2DConditionModel 7f3af43b", "loaded"]
    for page in ("Runs", "Compare", "Scaling", "Generation"):
        _app(root, monkeypatch, page=page)
    _app(root, monkeypatch, page="Generation", run=names)  # every run: the recorded generation among them drawn
    for kind in ("record", "replay", "tune", "interrupted", "compiled"):  # the sweeps' pages: tests/test_dashboard_app.py
        _app(root, monkeypatch, page="Run", run=[kinds[kind]])
