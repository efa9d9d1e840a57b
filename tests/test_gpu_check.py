"""make gpu-check on the CPU (profiler/gpu_check): the plan first and within its budget, the five files at the top of
--out with every figure of the report found in cells.csv / blocks.csv, a stop (SIGTERM to the process, SIGINT to its
group, the budget's end) in the middle of a run leaving its finished cells tabulated and no process of the check
alive, a worker's native crash failing its check with faulthandler's trace in the log while the later steps run,
and the record table kept. The model checks themselves run on a GPU (tests/test_gpu.py, make gpu-check)."""
import csv
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from profiler import devices, gpu_check
from profiler.attention import kernel_choice
from profiler.gpu_check import checks, plan, runner, timing_judges
from profiler.gpu_check.report import FILES, add_record
from profiler.gpu_check.verdicts import Context
from tests.procs import alive as _alive, start_marked
from tests.test_devices import FakeNvml

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of a machine with no CUDA")
REPO = Path(__file__).resolve().parent.parent
DRY = ["--device", "cpu", "--models", "tiny-sd15"]


def _start(tmp_path, *args, session: bool = False, plugins: bool = False) -> tuple[subprocess.Popen, str]:
    """The check as a user runs it, in a process of its own, every process it starts marked (tests/procs.py)."""
    env = {**os.environ, **({"ATTNPROF_PLUGINS": "tests.faults"} if plugins else {})}
    return start_marked(["profiler.gpu_check", *DRY, "--out", str(tmp_path / "gc"), *args], env, session)


def _steps(report: Path) -> dict[str, str]:
    """step name -> its verdict, from the report's step headings."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^### \d+\. (.+): (PASS|FAIL|SKIP|STOPPED) \(",
                                                        report.read_text(), re.M)}


def _wait_for_cell(out: Path, backend: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (out / "cells.csv").read_text() if (out / "cells.csv").exists() else ""
        if f",{backend},ok," in text:
            return
        time.sleep(0.2)
    pytest.fail(f"no {backend} cell landed in cells.csv")


def _table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _same(text: str, value: str) -> bool:
    """A value as the report writes it (checks.num) against the CSV's."""
    if text == "null":
        return value in ("", "nan", "None")
    try:
        a, b = float(text), float(value)
    except ValueError:
        return text == " ".join(value.split()).replace("|", "/")
    return a == b or abs(a - b) <= 1e-5 * max(abs(a), abs(b))


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


def test_the_plan_for_an_h200_fits_its_budget_and_puts_both_models_first(capsys):
    """--dry-run prints the plan for one H200-class GPU (no GPU needed): the steps within the budget sum to no more
    than it, at the default budget and a smaller one; the first step is the core run, SD 1.5 at 512 and SDXL base
    at 1024 in fp16 with naive, sdpa, sdpa-cudnn and sdpa-efficient (its kernel traces kept), and it and its judges
    come before any harness check; the default budget is 300 s."""
    for budget in (None, 200):
        assert gpu_check.main(["--dry-run", *(["--budget-s", str(budget)] if budget else [])]) == 0
        text = capsys.readouterr().out
        rows = [r.split(" | ") for r in text.splitlines() if re.match(r"\| \d+ \|", r)]
        total = sum(float(r[3]) for r in rows if r[4].startswith("yes") and r[3] != "<1")
        said = re.search(r"expected (\d+) s of the (\d+) s budget on one H200-class GPU", text)
        assert said and float(said.group(1)) == total <= float(said.group(2)) == (budget or runner.DEFAULT_BUDGET_S)
        assert len(rows) == len(plan.STEPS)
    cells = checks.core_run(Context(device="cuda")).cells("cuda")
    assert {(c.model, c.width, c.height, c.dtype) for c in cells} == {("sd15", 512, 512, "float16"),
                                                                      ("sdxl-base", 1024, 1024, "float16")}
    assert sorted({c.backend for c in cells}) == sorted(["naive", "sdpa", "sdpa-efficient", "sdpa-cudnn"]) \
        and len(cells) == 8 and checks.core_run(Context(device="cuda")).trace == "kernels"
    assert runner.DEFAULT_BUDGET_S == 300
    groups = [s.group for s in plan.STEPS]
    assert plan.STEPS[0].name == "core run" and groups.index("harness") > max(
        i for i, s in enumerate(plan.STEPS) if s.run == "core run")


def test_the_dry_run_leaves_five_files_whose_tables_hold_every_figure_of_the_report(gpu_check_dry_run):
    """The command of the issue (tests/conftest.py's gpu_check_dry_run: run once for the suite, its wall timed from
    its start): ends within its budget, the plan printed first; at most five files at the top of --out; each evidence
    row and each run table of the report names a row of cells.csv or blocks.csv whose columns hold the values it
    gives."""
    run = gpu_check_dry_run
    out, err = run["stdout"], run["stderr"]
    assert run["wall_s"] <= run["budget_s"] + 5
    assert out.startswith(f"## Plan: {len(plan.STEPS)} steps in order of value"), out[:300]
    folder = Path(run["out"])
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == sorted(FILES)
    report = (folder / "report.md").read_text()
    assert report.count("\n**") == 1 and "PASS" in report
    tables = {"cells": _table(folder / "cells.csv"), "blocks": _table(folder / "blocks.csv")}
    assert tables["cells"] and tables["blocks"]
    by_key = {"cells": {r["cell_id"]: r for r in tables["cells"]},
              "blocks": {(r["cell_id"], r["call_index"]): r for r in tables["blocks"]}}
    checked = 0
    for line in report.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cols) == 8 and cols[0] in ("cells", "blocks"):  # an evidence row
            row = by_key[cols[0]][cols[1] if cols[0] == "cells" else (cols[1], cols[2])]
            for part in filter(None, (cols[4] + "; " + cols[5]).split("; ")):
                column, value = part.split(" = ", 1)
                assert _same(value, row[column]), (line, column, row[column])
                checked += 1
    header = None
    for line in report.splitlines():  # the run tables: columns of cells.csv, one row per cell
        cols = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cols[0] == "cell_id":
            header = cols
        elif header and len(cols) == len(header) and re.fullmatch(r"[0-9a-f]{12}", cols[0]):
            row = by_key["cells"][cols[0]]
            for column, value in zip(header, cols):
                if column != "status" or row["status"] == "ok":
                    assert _same(value, row[column]), (line, column, row[column])
                    checked += 1
    assert checked > 50
    verdicts = _steps(folder / "report.md")
    assert verdicts["core run: forward peak matches the planner"] == "PASS"
    assert verdicts["core run: sdpa runs the kernel pytorch answers"] == "PASS"
    assert "FAIL" not in verdicts.values() and not run["alive"]
    assert run["code"] == 0, err[-2000:]


@pytest.mark.parametrize("how", ["SIGTERM to the process", "SIGINT to its process group"])
def test_a_stop_mid_run_tabulates_its_finished_cells_and_leaves_no_process(tmp_path, how):
    """SIGTERM (a `timeout`) to the process, or SIGINT to its whole process group (Ctrl-C in a terminal), once the
    core run has recorded its first shape's cells (64x64: fault-slow-big is late only on calls of more tokens) and
    while its second shape (128x128, fault-slow-big 0.3 s late a call) runs: the report tabulates the finished cells
    and says where the check stopped, the exit is non-zero, the run is closed as interrupted, and no process of the
    check is alive a second after it exits."""
    group = how.endswith("group")
    proc, token = _start(tmp_path, "--models", "tiny-sd15", "tiny-sd15", "--sizes", "64", "128", "--backends",
                         "naive", "fault-slow-big", "sdpa", "--budget-s", "300", session=group, plugins=True)
    _wait_for_cell(tmp_path / "gc", "naive")
    os.killpg(proc.pid, signal.SIGINT) if group else proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    time.sleep(1)
    assert not _alive(token)
    assert proc.returncode == 1, err[-2000:]
    report = (tmp_path / "gc" / "report.md").read_text()
    name = "SIGINT" if group else "SIGTERM"
    assert f"**stopped after 0 of {len(plan.STEPS)} steps: {name} received during core run; its 3 finished " \
           "cells are tabulated above**" in report
    assert _steps(tmp_path / "gc" / "report.md") == {"core run": "STOPPED"}
    table = report.split("### The cells of the core run (3 recorded)", 1)[1]
    assert " | naive | ok | " in table and "128 | 128" not in table
    cells = _table(tmp_path / "gc" / "cells.csv")
    assert sorted((c["backend"], c["width"], c["status"]) for c in cells) == [
        ("fault-slow-big", "64", "ok"), ("naive", "64", "ok"), ("sdpa", "64", "ok")]


def test_the_budgets_end_stops_the_run_in_flight(tmp_path):
    """A budget that ends while the core run's slow cell runs: the check ends within a few seconds of it, says so,
    and leaves no process behind."""
    t0 = time.monotonic()
    proc, token = _start(tmp_path, "--sizes", "128", "--backends", "naive", "fault-slow", "--budget-s", "30",
                         plugins=True)
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 <= 30 + 5
    time.sleep(1)
    assert not _alive(token) and proc.returncode == 1
    assert "steps: the budget ran out during core run" in (tmp_path / "gc" / "report.md").read_text()


def test_a_workers_native_crash_fails_its_check_and_the_later_steps_run(tmp_path):
    """The core run's worker aborts (os.abort in a fault backend: SIGABRT) while its shape's cells run together:
    they run again each on its own, the aborting one's row says how the worker died, the judge of the run's cells
    FAILs naming it, faulthandler's trace is in the log, and the run's other cells and the later steps (the other
    judges of its cells) still run."""
    proc, token = _start(tmp_path, "--sizes", "128", "--backends", "naive", "fault-abort", "sdpa", "--budget-s",
                         "120", plugins=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    folder = tmp_path / "gc"
    verdicts = _steps(folder / "report.md")
    assert verdicts["core run"] == "PASS" and verdicts["core run: cells ok within tolerance"] == "FAIL"
    assert verdicts["core run: forward peak matches the planner"] == "PASS"  # a later step, on the cells that ran
    report = (folder / "report.md").read_text()
    assert "tiny-sd15 128x128 fault-abort: error (worker died: signal SIGABRT; last words in worker.log: Fatal " \
           "Python error: Aborted)" in report
    log = (folder / "gpu-check.log").read_text()
    trace = log.split("/worker.log (", 1)[1]  # the worker's own log, copied in: faulthandler's trace
    assert "Fatal Python error: Aborted" in trace and "tests/faults.py" in trace.split("Fatal Python error")[1]
    statuses = {c["backend"]: c["status"] for c in _table(folder / "cells.csv") if c["step"] == "core run"}
    assert statuses == {"naive": "ok", "fault-abort": "error", "sdpa": "ok"}


def test_a_step_that_would_not_fit_is_skipped_and_never_started(tmp_path, capsys):
    code = gpu_check.main([*DRY, "--sizes", "64", "--out", str(tmp_path / "gc"), "--budget-s", "20"])
    verdicts = _steps(tmp_path / "gc" / "report.md")
    assert code == 0 and verdicts["core run"] == "SKIP" and not list((tmp_path / "gc" / "runs").iterdir())
    assert verdicts["core run: forward peak matches the planner"] == "SKIP"
    report = (tmp_path / "gc" / "report.md").read_text()
    assert re.search(r"### 1\. core run: SKIP \(.*\)\n\nwould take about 15 s; \d+ s of the budget left", report)
    assert "the core run was not made" in report


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert gpu_check.main([*DRY, "--sizes", "64", "128", "256", "--out", str(tmp_path / "gc")]) == 2
    assert capsys.readouterr().err.strip() == "gpu-check: --sizes: give one size, or one per model (1), not 3"
    assert gpu_check.main([*DRY, "--backends", "nope", "--out", str(tmp_path / "gc")]) == 2
    assert "nope" in capsys.readouterr().err and not (tmp_path / "gc").exists()


def test_a_run_adds_a_row_to_the_record_table_and_keeps_the_others(tmp_path):
    record = tmp_path / "gpu-validation.md"
    record.write_text((REPO / "docs" / "gpu-validation.md").read_text())
    before = [ln for ln in record.read_text().splitlines() if ln.startswith("| 20")]
    report = tmp_path / "results" / "gpu-check-1" / "report.md"
    add_record(record, {"device_name": "NVIDIA H200"}, "17 PASS, 0 FAIL, 2 SKIP", report)
    after = [ln for ln in record.read_text().splitlines() if ln.startswith("| 20")]
    assert after[:-1] == before and len(before) >= 4
    assert after[-1].endswith("| NVIDIA H200 | 17 PASS, 0 FAIL, 2 SKIP: [report](results/gpu-check-1/report.md) |")


def test_the_flex_check_fails_when_only_cpu_side_ranges_carry_the_triton_name():
    """Inductor wraps each Triton launch in a CPU-side range named after the kernel: a call whose trace has that
    range and no GPU kernel is not credited flex's kernel; one with the GPU kernel is."""
    from profiler.measure.trace import attribute
    from tests.test_devices import Ev, CALLS, B0

    cpu_only = attribute([Ev(B0, 0, 10), Ev("triton_tem_fused_0", 1, 9)], CALLS)[0][0]
    assert "triton_tem_fused_0" in cpu_only["kernel"] and cpu_only["gpu_kernels"] == []
    assert not checks.own_gpu_kernels("flex", cpu_only["gpu_kernels"])
    assert not checks.own_gpu_kernels("flex", None)  # a CPU cell's row: no GPU kernels at all
    gpu = attribute([Ev(B0, 0, 10), Ev("triton_tem_fused_0", 1, 9, corr=7),
                     Ev("triton_tem_fused_0", 20, 30, device="cuda", linked=7)], CALLS)[0][0]
    assert gpu["gpu_kernels"] == ["triton_tem_fused_0"] and checks.own_gpu_kernels("flex", ",".join(gpu["gpu_kernels"]))


def test_the_judges_fail_on_figures_that_break_their_rule():
    """Each judge on rows a GPU run could give: a forward peak 8% over the planner's, a forced cuDNN cell whose
    calls ran flash, an sdpa call that ran another kernel than PyTorch answers, a call whose event time is under its
    kernels' time, the allocator holding an fp32 model beside the one under test: each FAILs naming the row."""
    import pandas as pd

    base = {"model": "sd15", "width": 512, "height": 512, "dtype": "float16", "status": "ok", "call_index": 0,
            "block": "down_blocks.0.attentions.0.transformer_blocks.0.attn1", "head_dim": 40, "tokens_k": 4096}
    cells = pd.DataFrame([{**base, "cell_id": "a", "backend": "sdpa", "forward_peak_total_bytes": 108,
                           "predicted_forward_peak_bytes": 100, "allocator_allocated_max_bytes": 108 + 2 * 2**31,
                           "max_rel_err": 1e-3}])
    v = checks.forward_peak_matches_the_planner(cells, None, "cuda")
    assert v.failed and "= 1.0800" in v.failed[0] and not v.evidence[0]["ok"]
    assert checks.allocator_holds_only_the_model_and_its_forward(cells, None, "cuda").failed
    blocks = pd.DataFrame([{**base, "cell_id": "b", "backend": "sdpa-cudnn", "sdpa_kernel": "flash",
                            "gpu_kernels": "flash_fwd_kernel"},
                           {**base, "cell_id": "a", "backend": "sdpa", "sdpa_kernel": "flash", "sdpa_kernel_asked":
                            "cudnn", "sdpa_kernel_rule": "cudnn", "gpu_time_ms": 2.0}])
    assert "ran flash, not cudnn" in checks.forced_kernels_ran(cells, blocks, "cpu").failed[0]
    assert "ran flash, PyTorch answers cudnn" in checks.sdpa_runs_the_kernel_pytorch_answers(cells, blocks,
                                                                                            "cpu").failed[0]


def test_a_sweeps_parent_asks_the_driver_not_is_initialized(monkeypatch):
    """torch.cuda.is_initialized() turns true on reading device properties, which makes no context: where the
    driver says this process holds no primary context, the planner follows its rule and allocates nothing on the
    GPU; where it does (a worker), PyTorch is asked."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(kernel_choice, "asked_sdpa_choice", lambda *a: asked.append(a) or "flash")
    h200 = kernel_choice.GpuTarget("NVIDIA H200", (9, 0), 91501, 13, False)
    monkeypatch.setattr(devices, "primary_context_active", lambda index=0: False)
    assert kernel_choice.sdpa_choice("float16", 40, 77, "cuda", h200) == "cudnn" and not asked
    monkeypatch.setattr(devices, "primary_context_active", lambda index=0: True)
    assert kernel_choice.sdpa_choice("float16", 40, 77, "cuda", h200) == "flash" and len(asked) == 1


def test_the_core_runs_preflight_asks_nothing_of_a_gpu(monkeypatch):
    """The preflight of the core run in a sweep's parent (the planner's fake-tensor forward, each sdpa call's kernel,
    the predicted times), with torch saying CUDA is initialised as it does once device properties were read: it runs
    on this machine, which has no CUDA, so any tensor it made on the GPU (to ask PyTorch which kernel) would raise.
    The kernels are the no-GPU rule's for this GPU."""
    from profiler.execute.sweep import predict

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    h200 = kernel_choice.GpuTarget("NVIDIA H200", (9, 0), 91501, 13, False)  # this GPU's, read from its properties
    monkeypatch.setattr(kernel_choice, "gpu_target", lambda arch=None, index=0: h200)
    cells = [c for c in checks.core_run(Context(device="cuda")).cells("cuda") if c.model == "sd15"]
    predicted, dims, _ = predict(cells)
    assert dims == {"sd15": (40, 80, 160)} and all(p["predicted_forward_peak_bytes"] for p in predicted.values())


def _kernel_run():
    """The first H200 run's core cells as a kernel-timed run would store them (tests/test_kernel_time.py's
    reading): each call's kernels (gpu_time_ms) its time, five alike samples, and every figure the fifth pass's
    judges read set as a steady, host-bound run of today's code would: the judges PASS on it."""
    from tests.test_kernel_time import _h200

    cells, blocks = _h200(("naive", "sdpa", "sdpa-cudnn", "sdpa-efficient"))
    cells2, blocks2 = _h200(("naive", "sdpa", "sdpa-cudnn", "sdpa-efficient"), "sdxl-base")
    cells, blocks = (pd.concat(x, ignore_index=True) for x in ((cells, cells2), (blocks, blocks2)))
    blocks = blocks.assign(time_ms=blocks["gpu_time_ms"], time_source="cupti",
                           time_samples_ms=[[g * f for f in (0.995, 1.0, 1.0, 1.0, 1.005)] for g in blocks["gpu_time_ms"]],
                           attn_kernel_ms=0.5 * blocks["gpu_time_ms"], proj_kernel_ms=0.5 * blocks["gpu_time_ms"],
                           graph_time_ms=1.02 * blocks["gpu_time_ms"], host_ms=0.45, gpu_span_ms=0.1,
                           launch_bound=True)
    sums = blocks.groupby("cell_id")["gpu_time_ms"].sum()
    att = cells["cell_id"].map(sums)
    cells = cells.assign(events_forward_ms=cells["forward_time_ms"],  # the H200's hooked event forwards, kept
                         forward_time_ms=cells["model"].map({"sd15": 40.0, "sdxl-base": 80.0}))  # interleaved: alike
    cells = cells.assign(time_source="cupti", attention_time_ms=att,
                         attention_time_samples_ms=[[a * f for f in (0.995, 1.0, 1.0, 1.0, 1.005)] for a in att],
                         attention_kernel_ms=0.5 * att, plain_attn_kernel_ms=0.5 * att, forward_gpu_ms=3 * att,
                         forward_graph_ms=3.2 * att, forward_host_ms=cells["forward_time_ms"] * 1.001,
                         hooked_forward_ms=cells["forward_time_ms"] * 1.3, hook_overhead_pct=30.0,
                         gpu_busy_pct=30.0, bound="host", host_launch_us_before=5.0, host_launch_us_after=5.1,
                         gpu_ref_ms_before=1.0, gpu_ref_ms_after=1.01, sm_clock_mhz_median=1950.0,
                         sm_clock_mhz_max=1980.0, clock_reasons=None, unsteady=None, unsteady_gpu=False)
    return cells, blocks


import pandas as pd  # noqa: E402 (the judges' tables)


def test_each_timing_judge_passes_a_sound_kernel_run():
    cells, blocks = _kernel_run()
    for judge in timing_judges.JUDGES:
        v = judge(cells, blocks, "cuda")
        assert not v.failed and v.evidence and all(e["ok"] for e in v.evidence), (judge.__name__, v.failed[:3])


@pytest.mark.parametrize("judge, broken, said", [
    ("attention_is_its_calls_kernels", lambda c, b: (c.assign(attention_time_ms=c["attention_time_ms"] * 1.01), b),
     "(1.00%)"),  # an attention time that is not its calls' kernels (host time folded in)
    ("attention_is_its_calls_kernels", lambda c, b: (c, b.assign(time_source="cuda events")), "clocks"),
    ("kernel_times_are_steady", lambda c, b: (c.assign(attention_time_samples_ms=[[1, 1.1, 1.2, 1.3, 1.4]] * len(c)),
                                              b), "attention IQR"),
    ("chosen_and_forced_agree", lambda c, b: (c.assign(forward_time_ms=c["events_forward_ms"]), b),
     "forward_time_ms sdpa 67.6517 / sdpa-cudnn 47.7454 = 1.417"),  # the H200's forwards, run once each in order
    ("kernels_rank_the_backends", lambda c, b: (c.assign(attention_time_ms=c["attention_time_ms"].where(
        c["backend"] != "sdpa-efficient", c["attention_time_ms"] / 2)), b), "sdpa-efficient / sdpa-cudnn"),
    ("graphs_agree_with_cupti", lambda c, b: (c, b.assign(graph_time_ms=1.3 * b["time_ms"])), "graph_calls_ms"),
    ("events_match_the_wall_clock", lambda c, b: (c.assign(forward_host_ms=c["forward_time_ms"] / 1.423), b),
     "events / wall clock 1.423"),  # the first H200 run's check 12
    ("hooks_change_no_kernel", lambda c, b: (c.assign(plain_attn_kernel_ms=c["attention_kernel_ms"] * 0.9), b),
     "hooked"),
    ("call_kernels_agree_across_passes", lambda c, b: (c, b.assign(time_ms=b["time_ms"].where(
        b["call_index"] != 3, b["time_ms"] * 9.3))), "9.300x"),  # an event time stored as the call's (the H200's)
    ("call_kernels_agree_across_passes", lambda c, b: (c, b.assign(gpu_time_ms=b["gpu_time_ms"].where(
        b["call_index"] > 9))), "calls"),  # too few calls judged: 10 a cell without the memory pass's kernels
    ("machine_held_still", lambda c, b: (c.assign(gpu_ref_ms_after=1.2), b), "the state says"),  # moved, unsaid
    ("machine_held_still", lambda c, b: (c.drop(columns=["host_launch_us_after"]), b), "missing"),
    ("bound_is_labelled", lambda c, b: (c.assign(bound=None), b), "bound None"),
])
def test_each_timing_judge_fails_where_its_figure_breaks_its_rule(judge, broken, said):
    cells, blocks = broken(*_kernel_run())
    v = getattr(timing_judges, judge)(cells, blocks, "cuda")
    assert v.failed and any(said in f for f in v.failed), v.failed[:3]
    assert not all(e["ok"] for e in v.evidence) or "calls" in said or "missing" in said


def test_the_timing_judges_skip_a_run_with_no_kernel_times():
    cells, blocks = _kernel_run()
    for judge in timing_judges.JUDGES:
        with pytest.raises(checks.Skip, match="no ok cell timed by its kernels"):
            judge(cells.assign(time_source="host clock"), blocks, "cpu")
