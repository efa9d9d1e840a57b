"""make gpu-check's runner on the CPU (profiler/gpu_check): its plan first, the report written as each check ends,
its budget held (checks that would not fit skipped, one that overruns stopped), SIGTERM leaving a report that says
where it stopped, a failing shared run run once, and the record table kept. The checks themselves run on a GPU
(tests/test_gpu.py, make gpu-check)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from profiler import devices, gpu_check
from profiler.store import list_runs
from profiler.gpu_check import checks, runner
from tests.test_devices import FakeNvml

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of a machine with no CUDA")
DRY = ["--device", "cpu", "--models", "tiny-sd15", "--sizes", "64"]
REPO = Path(__file__).resolve().parent.parent


def _rows(report: Path) -> list[list[str]]:
    """The rows of the report's check table: [#, check, result, seconds, figure]."""
    lines = (report.read_text().split("## Checks", 1) + [""])[1].splitlines()
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines if ln.startswith("| ") and
            ln.split(" | ")[0].strip("| ").isdigit()]


def _start(tmp_path, budget: float, session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "profiler.gpu_check", *DRY, "--out", str(tmp_path / "gc"),
                             "--budget-s", str(budget)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=session)


def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "nvml_gpus", lambda: [])
    assert gpu_check.main(["--out", str(tmp_path / "gc")]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "gpu-check: no CUDA GPU here (torch sees none): nothing to check and no report written; run make gpu-check "
        "on a GPU box"]
    assert not (tmp_path / "gc").exists()


def test_a_cpu_only_torch_on_a_gpu_box_fails_in_one_line(tmp_path, capsys, monkeypatch):
    """NVML sees a GPU, torch has no CUDA: every check would SKIP, so the check fails instead of passing quietly."""
    monkeypatch.setattr(devices, "nvml_module", lambda: FakeNvml())
    assert runner.nvml_gpus() == ["NVIDIA H200", "NVIDIA H200"]
    assert gpu_check.main(["--out", str(tmp_path / "gc")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: NVML sees 2 GPU(s) (NVIDIA H200) but this torch has no "
                                               "CUDA") and "install a CUDA build of torch" in out[0]
    assert not (tmp_path / "gc").exists()


def test_the_dry_run_prints_its_plan_writes_as_it_goes_and_ends_within_its_budget(tmp_path):
    """The command of the issue, timed from its start: ends within its budget however busy the machine is (a
    check that would not fit is skipped, one that overruns is stopped), with the plan printed first and a report
    whose every check has its row and whose last line gives the verdict."""
    budget, t0 = 60, time.monotonic()
    proc = _start(tmp_path, budget)
    out, err = proc.communicate(timeout=budget + 60)
    wall = time.monotonic() - t0
    assert wall <= budget + 5, f"{wall:.0f} s for a {budget} s budget"
    assert out.startswith(f"## Plan: {len(gpu_check.CHECKS)} checks in order of value")
    report = tmp_path / "gc" / "gpu-validation.md"
    text, rows = report.read_text(), _rows(report)
    assert [r[1] for r in rows] == [c.name for c in gpu_check.CHECKS][:len(rows)]
    verdict = [ln for ln in text.splitlines() if ln.startswith("**")]
    assert len(verdict) == 1 and (len(rows) == len(gpu_check.CHECKS) or "stopped after" in verdict[0])
    # on the CPU only the checks on the sweep's cells can run; the rest need CUDA and never pass
    assert {r[1] for r in rows if r[2] == "PASS"} <= {"forward peak matches the planner",
                                                      "sdpa picks the kernel the planner names"}
    assert not [r for r in rows if r[2] == "FAIL"], rows
    assert (tmp_path / "gc" / "torch-config.txt").read_text() == torch.__config__.show()
    assert proc.returncode == (1 if "stopped" in verdict[0] else 0), err[-2000:]


@pytest.mark.parametrize("how", ["SIGTERM to the process", "SIGINT to its process group"])
def test_a_stop_ends_the_check_in_flight_and_leaves_a_report_that_says_so(tmp_path, how):
    """SIGTERM (a `timeout`) to the process, or SIGINT to its whole process group (Ctrl-C in a terminal: the sweep's
    worker gets it too) while the sweep runs (the 14th check): the report keeps the 13 checks done and says where
    it stopped; the exit is non-zero; the run folder (with its worker.log) is under --out."""
    group = how.endswith("group")
    proc = _start(tmp_path, 600, session=group)
    report, runs = tmp_path / "gc" / "gpu-validation.md", tmp_path / "gc" / "runs"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list_runs(runs):  # the sweep's run began
        time.sleep(0.2)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-2000:]
    rows, text = _rows(report), report.read_text()
    assert len(rows) == 13 and {r[2] for r in rows} == {"SKIP"}
    name = "SIGINT" if group else "SIGTERM"
    assert f"**stopped after 13 of {len(gpu_check.CHECKS)} checks: {name} received during forward peak matches " \
           "the planner**" in text
    assert "stopped after 13" in (tmp_path / "gc" / "gpu-check.log").read_text()
    (run,) = list_runs(runs)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["ended_at"] and manifest["interrupted"] is True  # the sweep's run closed as interrupted


def test_a_failing_sweep_is_run_once_and_each_check_on_it_fails_with_the_reason(tmp_path, monkeypatch, capsys):
    calls = []

    def failing(sweep, **kw):
        calls.append(sweep)
        raise RuntimeError("the availability probe exited with signal SIGSEGV")

    monkeypatch.setattr(checks, "execute", failing)
    code = gpu_check.main([*DRY, "--out", str(tmp_path / "gc"), "--budget-s", "600"])
    rows = {r[1]: r for r in _rows(tmp_path / "gc" / "gpu-validation.md")}
    assert code == 1 and len(calls) == 1
    reason = "SharedRunFailed: the sweep run failed (run once): RuntimeError: the availability probe exited with " \
             "signal SIGSEGV"
    for name in ("forward peak matches the planner", "sdpa picks the kernel the planner names"):
        assert rows[name][2:3] == ["FAIL"] and rows[name][4] == reason
    assert "allocator holds only" in "".join(rows) and len(rows) == len(gpu_check.CHECKS)  # every check has its row
    assert "**0 PASS, 2 FAIL" in (tmp_path / "gc" / "gpu-validation.md").read_text()


def test_a_check_that_would_not_fit_is_skipped_and_its_shared_run_never_started(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "execute", lambda *a, **k: pytest.fail("the sweep started"))
    code = gpu_check.main([*DRY, "--out", str(tmp_path / "gc"), "--budget-s", "8"])
    rows = {r[1]: r for r in _rows(tmp_path / "gc" / "gpu-validation.md")}
    assert code == 0
    for name in ("forward peak matches the planner", "sdpa picks the kernel the planner names"):
        assert rows[name][2] == "SKIP" and rows[name][4].startswith("would take about 4")
        assert rows[name][4].endswith("s of the budget left")


def test_a_check_that_overruns_the_budget_is_stopped_at_its_deadline(tmp_path, monkeypatch):
    def slow(ctx):
        time.sleep(60)

    slow.__name__ = "check_sleeps_a_minute"
    monkeypatch.setattr(runner, "CHECKS", [checks.Planned(slow, 1, 1)])
    t0 = time.monotonic()
    code = gpu_check.main([*DRY, "--out", str(tmp_path / "gc"), "--budget-s", "12"])
    assert code == 1 and time.monotonic() - t0 < 14
    text = (tmp_path / "gc" / "gpu-validation.md").read_text()
    assert "**stopped after 0 of 1 checks: the budget ran out during sleeps a minute**" in text


def test_a_run_adds_a_row_to_the_record_table_and_keeps_the_others(tmp_path):
    record = tmp_path / "gpu-validation.md"
    record.write_text((REPO / "docs" / "gpu-validation.md").read_text())
    before = [ln for ln in record.read_text().splitlines() if ln.startswith("| 20")]
    report = tmp_path / "results" / "gpu-check-1" / "gpu-validation.md"
    runner.add_record(record, {"device_name": "NVIDIA H200"}, "17 PASS, 0 FAIL, 2 SKIP", report)
    after = [ln for ln in record.read_text().splitlines() if ln.startswith("| 20")]
    assert after[:-1] == before and len(before) >= 4
    assert after[-1].endswith("| NVIDIA H200 | 17 PASS, 0 FAIL, 2 SKIP: [report](results/gpu-check-1/"
                              "gpu-validation.md) |")


def test_the_flex_check_fails_when_only_cpu_side_ranges_carry_the_triton_name():
    """Inductor wraps each Triton launch in a CPU-side range named after the kernel: a call whose trace has that
    range and no GPU kernel is not credited flex's kernel; one with the GPU kernel is."""
    from profiler.measure.probes import attribute
    from tests.test_devices import Ev, CALLS, B0

    cpu_only = attribute([Ev(B0, 0, 10), Ev("triton_tem_fused_0", 1, 9)], CALLS)[0][0]
    assert "triton_tem_fused_0" in cpu_only["kernel"] and cpu_only["gpu_kernels"] == []
    assert not checks.own_gpu_kernels("flex", cpu_only["gpu_kernels"])
    assert not checks.own_gpu_kernels("flex", None)  # a CPU cell's row: no GPU kernels at all
    gpu = attribute([Ev(B0, 0, 10), Ev("triton_tem_fused_0", 1, 9, corr=7),
                     Ev("triton_tem_fused_0", 20, 30, device="cuda", linked=7)], CALLS)[0][0]
    assert gpu["gpu_kernels"] == ["triton_tem_fused_0"] and checks.own_gpu_kernels("flex", ",".join(gpu["gpu_kernels"]))
