"""attnprof record on an unmodified script (docs/examples/generate.py imports no profiler): one run, one cell per
backend, the script's exit status; two such runs diffed cell by cell by the same noise rule as any other, with the
verdicts made independent of the machine's load (tests/faults.py: fault-scaled's calls are fixed waits, the
calibrations injected)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from profiler.store import Run, list_runs

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "docs" / "examples" / "generate.py"
STEADY = {**{k: v for k, v in os.environ.items() if k != "ATTNPROF_FAULT_FACTOR"}, "ATTNPROF_PLUGINS": "tests.faults",
          "ATTNPROF_FAULT_STEADY": "1", "OMP_NUM_THREADS": "1"}


def attnprof(*args, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profiler", *args], cwd=cwd, capture_output=True, text=True,
                          env={**(env or os.environ), "PYTHONPATH": str(REPO)}, timeout=600)


def test_record_runs_the_script_once_per_backend_into_one_run(tmp_path):
    done = attnprof("record", "--out", str(tmp_path), "--backend", "sdpa", "--backend", "sliced", "--", str(SCRIPT),
                    "--steps", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("generated 1 image(s) of 64x64 in 3 steps") == 2  # the script's own output, each run's
    (path,) = list_runs(tmp_path)
    run = Run.open(path)
    cells, blocks = run.read()
    assert run.kind.name == "record" and sorted(cells["backend"]) == ["sdpa", "sliced"]
    assert set(cells["steps"]) == {3} and all(len(s) == 3 for s in cells["attention_time_samples_ms"])
    assert set(cells["processors"]) == {"AttnProcessor2_0 x34", "SlicedAttnProcessor x34"}
    assert len(blocks) == 2 * (32 + 1 + 2) and (blocks["time_samples_ms"].map(len) == blocks["component"].map(
        {"unet": 3, "vae": 1, "text_encoder": 2})).all()  # CLIP's 2 layers, in the prompt's and the negative's
    assert blocks["faulted_bytes"].notna().all() and (blocks["faulted_bytes"] >= 0).all()  # the CPU counts them
    for cid in cells["cell_id"]:
        calls = run.read_frame(f"calls-{cid}")
        assert calls.groupby("component").size().to_dict() == {"unet": 96, "vae": 1, "text_encoder": 4}
    m = run.manifest()
    assert [c["when"] for c in m["calibration"]] == ["start", "end"] * 2 and m["ended_at"] and not m["interrupted"]
    assert "StableDiffusionPipeline (sliced, 3 steps at 64x64, batch 2) took" in done.stdout
    # a first run here: no stored run of either backend to calibrate on, so each time is the roofline floor
    assert done.stderr.count("s predicted (the roofline floor, a lower bound) for this generation (tiny-sd15, "
                             "64x64, 3 steps, ") == 2 and done.stderr.count("that floor)") == 2


def test_a_scripts_pipelines_and_sizes_are_cells_of_their_own(tmp_path):
    """A script that runs a txt2img pipeline at 64x64 and 48x48 and then an InstructPix2Pix one (another U-Net, as
    an SDXL refiner beside its base) at 64x64: three cells, each with its own calls and forwards, named apart by
    show."""
    script = tmp_path / "two.py"
    script.write_text("import importlib.util\n"
                      f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r})\n"
                      "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
                      "pipe = g.tiny_pipeline()\n"
                      "g.generate(pipe, steps=2)\ng.generate(pipe, steps=3, size=48)\n"
                      "g.generate(g.tiny_pipeline('pix2pix'), steps=2)\n")
    done = attnprof("record", "--out", str(tmp_path), "--quiet", "--", str(script), env=STEADY)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = list_runs(tmp_path)
    run = Run.open(path)
    cells = run.cells()
    got = sorted((c["pipeline"], c["size"], c["steps"], len(c["forward_time_samples_ms"]))
                 for c in cells.to_dict("records"))
    assert got == [("StableDiffusionInstructPix2PixPipeline", "64x64", 2, 2), ("StableDiffusionPipeline", "48x48", 3, 3),
                   ("StableDiffusionPipeline", "64x64", 2, 2)]
    assert cells["cell_id"].nunique() == 3 and cells["denoiser"].nunique() == 2  # the U-Nets' configs apart
    for c in cells.to_dict("records"):
        calls = run.read_frame(f"calls-{c['cell_id']}")
        unet = calls[calls["component"] == "unet"]
        assert len(unet) == 32 * c["steps"] and set(unet["batch"]) == {3 if "Pix2Pix" in c["pipeline"] else 2}
    facts = run.manifest()["record"]["cells"]
    assert {k: (v["pipeline"], v["width"]) for k, v in facts.items()} == {
        c["cell_id"]: (c["pipeline"], c["width"]) for c in cells.to_dict("records")}
    shown = attnprof("show", path.name, "--results", str(tmp_path), "--wide")
    assert "StableDiffusionPipeline (loaded, 3 steps at 48x48, batch 2) took" in shown.stdout
    assert "StableDiffusionInstructPix2PixPipeline (loaded, 2 steps at 64x64, batch 3) took" in shown.stdout


def test_the_exit_status_is_the_scripts(tmp_path):
    """A script that generates and then exits 3: record exits 3 with its cell stored, whole though a SIGINT landed
    in its process as it stored it, the machine's speed taken as its pipeline call began and after it ended; one that
    never calls a pipeline: its own status, nothing stored, no calibration taken, and a line that says so;
    record's own option after the script goes to the script, with a line that says so."""
    script = tmp_path / "exits.py"
    script.write_text("import sys, importlib.util\n"
                      f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r})\n"
                      "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
                      "if '--generate' in sys.argv: g.generate(g.tiny_pipeline(), steps=3)\n"
                      "sys.exit(3)\n")
    taken = tmp_path / "calibrations.txt"  # a line per calibration (tests/faults.py)
    env = {**STEADY, "ATTNPROF_FAULT_CALIBRATIONS": str(taken), "ATTNPROF_FAULT_SIGINT_STORE": "1"}
    done = attnprof("record", "--out", str(tmp_path / "a"), "--", str(script), "--generate", env=env)
    assert done.returncode == 3, done.stderr[-2000:]  # a SIGINT as its process stored the cell: ignored (not 130)
    (path,) = list_runs(tmp_path / "a")
    run = Run.open(path)
    assert len(run.cells()) == 1 and run.manifest()["interrupted"] is True
    calls = run.read_frame(f"calls-{run.cells()['cell_id'].iloc[0]}")  # the cell whole: its calls, its facts
    assert len(calls) == 3 * 32 + 1 + 4 and list(run.manifest()["record"]["cells"]) == list(run.cells()["cell_id"])
    assert taken.read_text().split("\n")[:-1] == ["start cpu", "end cpu"]  # taken as its first pipeline call began
    taken.unlink()
    done = attnprof("record", "--out", str(tmp_path / "b"), "--", str(script), "--out", "x", env=env)
    assert done.returncode == 3 and "the script made no diffusers pipeline call: nothing stored (and no " \
        "calibration taken)" in done.stderr and not taken.exists()  # no pipeline call: no calibration
    assert not list_runs(tmp_path / "b") and f"running {script} --out x with the processors" in done.stderr
    assert "attnprof record: --out after the script goes to the script, not to record: put record's options " \
           "before the script (attnprof record --out DIR -- SCRIPT.py ARGS)" in done.stderr  # said, then passed on
    done = attnprof("record", "--out", str(tmp_path / "c"), "--", str(tmp_path / "missing.py"))
    assert done.returncode == 2 and done.stderr.strip().endswith("is not a file: give the script to run, e.g. "
                                                                 "attnprof record -- generate.py --steps 30")


def test_a_python_word_before_the_script_is_taken(tmp_path, capsys):
    """`attnprof record -- python x.py` (as py-spy's and nsys's users type it; python3, or this interpreter's path,
    alike) runs the script with its arguments: here one that makes no pipeline call and exits 3, so nothing is stored
    and no calibration taken; the interpreter's own option (-m) is one line and exit 2."""
    from profiler.cli import main

    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1:])\nsys.exit(3)\n")
    for word in ("python", sys.executable):
        done = attnprof("record", "--out", str(tmp_path), "--", word, str(script), "--steps", "1")
        assert done.returncode == 3 and "hello ['--steps', '1']" in done.stdout, done.stderr[-2000:]
        assert f"running {script} --steps 1 with the processors it loads" in done.stderr
    assert main(["record", "--out", str(tmp_path), "--", "python3", "-m", "gen"]) == 2
    assert capsys.readouterr().err == "attnprof: error: record: python3's option -m is not taken: give the script's " \
        "path after it, e.g. attnprof record -- python3 generate.py --steps 30\n"


def test_two_records_of_the_same_code_are_diffed_cell_by_cell(tmp_path):
    """Two records of the script with fault-scaled (each call a 120 ms wait: a call's own work, a few ms on a busy
    machine, stays under 3% of it) on a machine held steady: the cell matched, its time judged within noise (exit 0);
    a third with the backend twice as slow: a regression (exit 1); a fourth whose forwards swing (every other one 5x
    as long): not judged, too noisy (exit 3), though its median is 3x faster."""
    runs = []
    for factor in ("3", "3", "6"):  # at 40 ms (factor 1) a busy machine's 3.5 ms a call read as a 7% regression
        done = attnprof("record", "--out", str(tmp_path), "--backend", "fault-scaled", "--quiet", "--", str(SCRIPT),
                        "--steps", "3", env={**STEADY, "ATTNPROF_FAULT_FACTOR": factor})
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(list_runs(tmp_path)[-1].name)
    a, b, c = runs
    # the machine timed by attnprof's own process (its memory kept), never the script's: there a calibration's tables
    # got new pages at the start and none at the end, and every run read as a machine that moved
    calibrations = [x for r in runs for x in Run.open(tmp_path / r).manifest()["calibration"]]
    assert len(calibrations) == 6 and all(x["memory_kept"] for x in calibrations)
    same = attnprof("diff", a, b, "--results", str(tmp_path), "--json")
    data = json.loads(same.stdout)
    assert same.returncode == 0 and data["summary"]["matched"] == 1, same.stdout[-2000:]
    assert [m["time_verdict"] for m in data["matched"]] == ["within noise"]
    slower = attnprof("diff", a, c, "--results", str(tmp_path), "--json")
    assert slower.returncode == 1 and [m["time_verdict"] for m in json.loads(slower.stdout)["matched"]] == \
        ["regression"]
    done = attnprof("record", "--out", str(tmp_path), "--backend", "fault-scaled", "--quiet", "--", str(SCRIPT),
                    "--steps", "3", env={**STEADY, "ATTNPROF_FAULT_FACTOR": "1", "ATTNPROF_FAULT_SWING": "5"})
    assert done.returncode == 0, done.stderr[-2000:]  # forwards of 1.3, 6.4 and 1.3 s of waits: an IQR of twice the
    noisy = attnprof("diff", a, list_runs(tmp_path)[-1].name, "--results", str(tmp_path))  # median, less its work
    assert noisy.returncode == 3 and re.search(r"not judged \(too noisy: IQR \d+% of the median in B\)",
                                               noisy.stdout), noisy.stdout[-2000:]


def _lines(stream, into: list):
    """Read a pipe line by line into a list (a thread's work: both pipes are read at once)."""
    for line in stream:
        into.append(line)


def _wait_for(lines: list, text: str, count: int = 1, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(text in line for line in lines) < count:
        assert time.monotonic() < deadline, f"never saw {text!r}: {''.join(lines)[-2000:]}"
        time.sleep(0.05)


def test_ctrl_c_leaves_an_interrupted_run_that_names_what_is_left_and_resumes(tmp_path):
    """SIGINT to record's process group mid-generation, as Ctrl-C in a terminal sends it (the script's process gets
    it too): the first stops the script (its own handler runs), the run is kept with interrupted: true, and record and
    show name the backends with no cell and the command that finishes the run; a second SIGINT, while the script
    still cleans up, prints one line and stops it now; no traceback. --resume then records what was left. The
    backend's calls are fixed waits (tests/faults.py fault-scaled: 40 ms x the factor), the calibrations injected."""
    script = tmp_path / "gen.py"
    script.write_text("import importlib.util, time\n"
                      f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r})\n"
                      "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
                      "pipe = g.tiny_pipeline()\n"
                      "print('generating', flush=True)\n"
                      "try:\n    g.generate(pipe, steps=3)\n"
                      "except KeyboardInterrupt:\n    print('cleaning up', flush=True)\n    time.sleep(60)\n"
                      "    raise\n")
    env = {**STEADY, "ATTNPROF_FAULT_FACTOR": "10", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "profiler", "record", "--out", str(tmp_path), "--backend",
                             "fault-scaled", "--", str(script)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err = [], []
    for stream, into in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_lines, args=(stream, into), daemon=True).start()
    try:
        _wait_for(out, "generating")  # its generation: 0.4 s a call
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        _wait_for(out, "cleaning up")
        _wait_for(err, "interrupted: waiting for the script to end")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)  # the reader threads' last lines
    stderr = "".join(err)
    assert "Traceback" not in stderr and sum("interrupted again" in line for line in err) == 1, stderr[-3000:]
    assert f"attnprof record: running {script} with backend fault-scaled\n" in err  # no arguments: one space
    (path,) = list_runs(tmp_path)
    run = Run.open(path)
    assert run.manifest()["interrupted"] is True and not len(run.cells())
    finish = f"attnprof record --out {tmp_path} --resume {path.name}"
    assert f"finish it with: {finish}" in stderr
    shown = attnprof("show", path.name, "--results", str(tmp_path), "--wide")
    assert shown.returncode == 0 and "(interrupted)" in shown.stdout and "device cpu" in shown.stdout
    assert f"interrupted: no cell of fault-scaled: its run of {script} was stopped or made no pipeline call; " \
           f"finish it with: {finish}" in shown.stdout
    done = attnprof(*finish.split()[1:], env={**env, "ATTNPROF_FAULT_FACTOR": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(run.cells()["backend"]) == ["fault-scaled"] and run.manifest()["interrupted"] is False


def _recording(args: list[str], env: dict, cwd) -> tuple[subprocess.Popen, list, list]:
    """attnprof record started in a process group of its own (as a terminal's Ctrl-C reaches it), its stdout and
    stderr read line by line as it runs."""
    proc = subprocess.Popen([sys.executable, "-m", "profiler", "record", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err = [], []
    for stream, into in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_lines, args=(stream, into), daemon=True).start()
    return proc, out, err


def _stopped(args: list[str], env: dict, cwd, seen: tuple[str, str], code: int, pause_s: float = 0.0) -> str:
    """attnprof record given SIGINT on its process group (a terminal's Ctrl-C) pause_s after `seen` (which stream,
    what text) appears, exiting `code`: its stderr."""
    proc, out, err = _recording(args, env, cwd)
    try:
        _wait_for(out if seen[0] == "stdout" else err, seen[1])
        time.sleep(pause_s)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)
    return "".join(err)


def test_a_ctrl_c_after_a_generation_keeps_it_as_a_partial_cell_that_resume_runs_again(tmp_path):
    """SIGINT to record mid-way through a script's second generation (the script lets it end it): the first
    generation is kept as a cell marked partial, the run interrupted; show names it partial and how to finish,
    attnprof runs flags the run; --resume from another folder (the script was given by a relative path) runs the
    backend again and its complete cell replaces the partial one."""
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    (work / "gen.py").write_text("import importlib.util\n"
                                 f"spec = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r})\n"
                                 "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
                                 "pipe = g.tiny_pipeline()\n"
                                 "g.generate(pipe, steps=2)\nprint('first done', flush=True)\n"
                                 "g.generate(pipe, steps=2)\n")
    env = {**STEADY, "ATTNPROF_FAULT_FACTOR": "2", "PYTHONPATH": str(REPO)}  # 80 ms a call: 5 s a generation
    stderr = _stopped(["--out", str(results), "--backend", "fault-scaled", "--", "gen.py"], env, work,
                      ("stdout", "first done"), 130, pause_s=1.0)
    assert "Traceback" not in stderr and "finish it with: attnprof record --out" in stderr, stderr[-3000:]
    (path,) = list_runs(results)
    run = Run.open(path)
    cell = run.cells().iloc[0]
    assert run.manifest()["interrupted"] is True and bool(cell["partial"]) and cell["generations"] == 1
    assert len(run.read_frame(f"calls-{cell['cell_id']}").query("component == 'unet'")) == 2 * 32
    shown = attnprof("show", path.name, "--results", str(results), "--wide")
    assert "interrupted: no complete cell of fault-scaled (its cells partial: the generations that ended before " \
           "the stop)" in " ".join(shown.stdout.split()) and "partial: the script was stopped" in shown.stdout
    listed = attnprof("runs", "--results", str(results))
    assert "interrupted: no complete cell of fault-scaled (attnprof record --resume finishes it)" in \
        " ".join(listed.stdout.split())
    done = attnprof("record", "--out", str(results), "--resume", path.name, env={**env, "ATTNPROF_FAULT_FACTOR": "0"},
                    cwd=tmp_path)  # another folder than the script's
    assert done.returncode == 0, done.stderr[-2000:]
    cells = run.cells()
    assert len(cells) == 1 and not cells["partial"].iloc[0] and cells["generations"].iloc[0] == 2
    assert run.manifest()["interrupted"] is False


def test_a_ctrl_c_after_every_script_ended_leaves_the_run_whole(tmp_path):
    """A Ctrl-C while record writes the run's end (every run of the script ended, its cells stored: a fault holds
    record there 5 s): one line says so, the run is not marked interrupted, no resume is suggested, and record exits
    with the script's status."""
    env = {**STEADY, "ATTNPROF_FAULT_SLOW_END_S": "5", "PYTHONPATH": str(REPO)}
    stderr = _stopped(["--out", str(tmp_path), "--", str(SCRIPT), "--steps", "1"], env, REPO,
                      ("stderr", "fault: finishing"), 0)
    assert "every run of the script has ended: writing the run's manifest, a moment" in stderr, stderr[-3000:]
    assert "interrupted" not in stderr and "--resume" not in stderr and "Traceback" not in stderr
    (path,) = list_runs(tmp_path)
    assert Run.open(path).manifest()["interrupted"] is False and len(Run.open(path).cells()) == 1


def test_records_prediction_is_said_as_far_as_its_evidence_goes(monkeypatch, capsys):
    """Before a generation record says what the time model predicts: a calibrated time with its expected
    (leave-one-out) error; nothing but why where that error is over 50% (and no comparison after); the roofline
    floor as 'at least'. The model's answers are given here (planner/generation.py is tested on its own)."""
    import importlib.util

    from profiler.planner import calibration, generation, timing
    from profiler.record import script

    spec = importlib.util.spec_from_file_location("generate", SCRIPT)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    pipe = gen.tiny_pipeline()
    monkeypatch.setattr(calibration, "target", lambda *a, **k: ({}, None, None))
    watch = script._Watch(None, False, None, quiet=False)
    for kind, error, said in (
            ("calibrated", 7.54, "predicted 2.57 s (expected error 8%, leave-one-out) for this generation"),
            ("calibrated", None, "predicted 2.57 s (expected error unknown: one cell to calibrate on) for this"),
            ("kernels", None, "predicted 2.57 s (expected error unknown: the kernel fits carry no held-out error) "
                              "for this generation"),
            ("floor", None, "at least 2.57 s predicted (the roofline floor, a lower bound) for this generation"),
            ("calibrated", 993.0, "no prediction for this generation (tiny-sd15, 64x64, 50 steps, sdpa): the "
                                  "calibration's leave-one-out error is 993%, over 50% (calibrated on 5 cells)")):
        unet = {"part": "denoise", "time_kind": "calibrated" if kind == "kernels" else kind, "time_error_pct": error,
                "source": "calibrated on 5 cells", "time_error_why": timing.NO_HELD_OUT if kind == "kernels" else
                "one cell to calibrate on" if kind == "calibrated" and error is None else None}
        monkeypatch.setattr(generation, "predict_generation", lambda *a, unet=unet: {"total_ms": 2570.0,
                                                                                     "parts": [unet]})
        eta = watch.predicted(pipe, (), {"height": 64, "width": 64})
        assert (eta is None) == (error == 993.0) and said in capsys.readouterr().err
