"""The runner of make gpu-check: the plan first, then the checks in order of value within a budget, each check's line
written to DIR/gpu-validation.md (and flushed to disk) the moment it ends, so that a run killed at its time limit
still leaves what it found.

- A check that would not fit in what is left of the budget (its expected seconds on this device, with those of a
  shared run it would start) is SKIPped with that reason, never started; one that overruns the budget is stopped
  (SIGALRM at the deadline), as SIGTERM and SIGINT stop the check in flight: the report then ends with "stopped after
  N of M checks: <reason>" and the exit is non-zero, with everything so far kept.
- DIR holds everything worth copying off the machine: the report, the console's lines (gpu-check.log), the runs
  with their worker.log (runs/), `nvidia-smi -q` and `torch.__config__.show()`.
- On a GPU, the record table of docs/gpu-validation.md gets a row linking the report (--record none: no row).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from .. import backends, devices
from ..fmt import human_bytes
from ..env import REPO, environment
from .checks import CHECKS, SHARED_S, Context, Planned, SharedRunFailed, Skip, new_backend_reason

RECORD = REPO / "docs" / "gpu-validation.md"
RESERVE_S = 5.0  # of the budget kept for the report's last lines
MAIN_BACKENDS = ("naive", "sliced", "split", "subquad", "sdpa")


class Stopped(BaseException):
    """SIGTERM, SIGINT or the budget's end: the check in flight ends here (no `except Exception` catches it)."""


def _stop(signum, frame):
    raise Stopped("the budget ran out" if signum == signal.SIGALRM else f"{signal.Signals(signum).name} received")


class Report:
    """DIR/gpu-validation.md and DIR/gpu-check.log, appended a line at a time and synced to disk at once."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self.log = folder / "gpu-validation.md", folder / "gpu-check.log"
        self.path.write_text("")
        self.log.write_text("")

    def write(self, text: str, path: Path | None = None) -> None:
        with open(path or self.path, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.write(text, self.log)


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "/")


def expected_s(check: Planned, ctx: Context) -> float | None:
    """Seconds the check is expected to take here, with those of the shared run it would start; None where it
    cannot run (CPU dry run of a CUDA check)."""
    cuda = ctx.device.startswith("cuda")
    own = check.gpu_s if cuda else check.cpu_s
    if own is None:
        return None
    shared = SHARED_S[check.uses][0 if cuda else 1] if check.uses and check.uses not in ctx.shared else 0.0
    return own + (shared or 0.0)


def precondition(check: Planned, ctx: Context) -> str:
    """Why the check SKIPs before it starts ('' if it may run): no CUDA, the backend not installed, or the shared
    run it needs was not made (skipped)."""
    if expected_s(check, ctx) is None:
        return f"needs a CUDA device (here: {ctx.device})"
    backend = getattr(check.fn, "backend", None)
    if backend:
        return new_backend_reason(backend, ctx.device)
    return ""


def run_checks(ctx: Context, report: Report, budget_s: float, t0: float) -> tuple[list[tuple], str | None]:
    """Each check in order: (name, verdict, seconds, figure) rows, and why the run stopped (None: it did not)."""
    results, deadline = [], t0 + budget_s - RESERVE_S
    for i, check in enumerate(CHECKS, 1):
        start = time.perf_counter()
        try:
            verdict, figure = run_one(check, ctx, deadline)
        except Stopped as e:
            return results, f"stopped after {i - 1} of {len(CHECKS)} checks: {e} during {check.name}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.perf_counter() - start
        results.append((check.name, verdict, seconds, figure))
        report.write(f"| {i} | {check.name} | {verdict} | {seconds:.1f} | {_cell(figure)} |")
        report.say(f"[{time.perf_counter() - t0:5.0f} s] {verdict}  {check.name}: {figure}")
    return results, None


def run_one(check: Planned, ctx: Context, deadline: float) -> tuple[str, str]:
    """(verdict, figure) of one check: SKIP before it starts where it cannot run or would not fit in what is left
    of the budget; else run, with an alarm at the deadline."""
    reason, left = precondition(check, ctx), deadline - time.perf_counter()
    expected = expected_s(check, ctx)
    if not reason and expected > left:
        reason = f"would take about {expected:.0f} s; {max(left, 0):.0f} s of the budget left"
    if reason:
        return "SKIP", reason
    signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))
    try:
        return "PASS", check.fn(ctx)
    except Skip as e:
        return "SKIP", str(e)
    except Exception as e:  # a failed check is a row of the report, and the others still run
        return "FAIL", f"{type(e).__name__}: {e}".strip()


def plan_lines(ctx: Context) -> list[str]:
    where = "one H200-class GPU" if ctx.device.startswith("cuda") else "this CPU (a dry run)"
    rows = ["| # | check | group | expected s |", "|---|---|---|---|"]
    shared = set()
    for i, check in enumerate(CHECKS, 1):
        own = check.gpu_s if ctx.device.startswith("cuda") else check.cpu_s
        run = SHARED_S[check.uses][0 if ctx.device.startswith("cuda") else 1] if check.uses not in shared and \
            check.uses else 0
        shared.add(check.uses)
        cost = "SKIP (needs CUDA)" if own is None else f"{own + (run or 0):.0f}" + \
            (f" (with the {check.uses} run)" if run else "")
        rows.append(f"| {i} | {check.name} | {check.group} | {cost} |")
    return [f"## Plan: {len(CHECKS)} checks in order of value, expected seconds on {where} (estimates until a "
            "GPU run measures them)", "", *rows, ""]


def header(env: dict, command: str, budget_s: float, sweep) -> list[str]:
    facts = [("GPU", env.get("device_name")), ("driver", env.get("driver")), ("CUDA", env.get("cuda")),
             ("cuDNN", env.get("cudnn")), ("torch", env.get("torch")), ("diffusers", env.get("diffusers")),
             ("python", env.get("python")), ("git", env.get("git_revision")),
             ("started", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())), ("budget", f"{budget_s:.0f} s")]
    return ["# GPU validation", "",
            f"Written by `{command}` as each check ends: every figure is what it measured. A run that was killed "
            "ends without a verdict line; one stopped by a signal or its budget ends with a 'stopped' line. The "
            f"sweep checks read the reduced default sweep ({', '.join(sweep.models)} at "
            f"{', '.join(str(w) for w, _ in sweep.sizes)}; {', '.join(b for b, _ in sweep.backends)}; "
            f"{', '.join(sweep.dtypes)}; {sweep.repeats} timed forwards per cell).", "",
            "| | value |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in facts), ""]


def backend_table(cells: pd.DataFrame) -> str:
    order = {b: i for i, b in enumerate(backends.names())}
    cells = cells.assign(o=cells["backend"].map(order)).sort_values(["model", "width", "o"], kind="stable")
    lines = ["| model | size | backend | status | forward | attention | peak per call | predicted | forward peak "
             "| planner | ratio | kernel |", "|" + "---|" * 12]
    for c in cells.to_dict("records"):
        ok = c["status"] == "ok"
        ratio = c.get("forward_peak_total_bytes", 0) / c["predicted_forward_peak_bytes"] \
            if ok and c.get("predicted_forward_peak_bytes") else None
        cols = [c["model"], f"{c['width']}x{c['height']}", backends.label(c["backend"], c.get("backend_options")),
                c["status"] if ok else f"{c['status']}: {c['error']}",
                f"{c['forward_time_ms']:.1f} ms" if ok else "-", f"{c['attention_time_ms']:.1f} ms" if ok else "-",
                human_bytes(c["attention_peak_mem_bytes"]) if ok else "-", human_bytes(c.get("predicted_peak_bytes")),
                human_bytes(c.get("forward_peak_total_bytes")) if ok else "-",
                human_bytes(c.get("predicted_forward_peak_bytes")), f"{ratio:.3f}" if ratio else "-",
                (c.get("sdpa_kernel") or c.get("kernel") or "") if ok else ""]
        lines.append("| " + " | ".join(_cell(v) for v in cols) + " |")
    return "\n".join(lines)


def closing(report: Report, results: list[tuple], stopped: str | None, ctx: Context, seconds: float) -> str:
    counts = {v: sum(1 for r in results if r[1] == v) for v in ("PASS", "FAIL", "SKIP")}
    verdict = stopped or f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
    report.write(f"\n**{verdict}** ({counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
                 f"{seconds:.0f} s)\n")
    swept = ctx.shared.get("sweep")
    if swept is not None and not isinstance(swept, SharedRunFailed):
        run, cells, _ = swept
        main = cells[cells["backend"].isin(MAIN_BACKENDS)]
        rest = cells[~cells["backend"].isin(MAIN_BACKENDS)]
        report.write(f"## The reduced default sweep (run {run.path.relative_to(report.path.parent)})\n\n"
                     "forward: median time per U-Net forward; attention: the sum of the calls' median times; peak per "
                     "call: the largest call's allocator peak over what was held when it began; predicted: its memory "
                     "model's; forward peak: weights + inputs + the forward's allocator peak; planner: attnprof "
                     "plan's predicted_forward_peak_bytes; kernel: the SDPA kernel each call ran, or its ops.\n\n"
                     + (backend_table(main) if len(main) else "(no cells)") + "\n\n### The fused kernels\n\n"
                     + (backend_table(rest) if len(rest) else "(no cells)") + "\n")
    return verdict


def add_record(record: Path, env: dict, verdict: str, report: Path) -> None:
    """A row at the end of the record table of docs/gpu-validation.md: date, machine, verdict, the report."""
    lines = record.read_text().splitlines() if record.exists() else ["# GPU validation", "", "## Record", "",
                                                                     "| date | machine | result |", "|---|---|---|"]
    where = os.path.relpath(report, record.parent)
    row = (f"| {time.strftime('%Y-%m-%d', time.gmtime())} | {_cell(env.get('device_name'))} | {_cell(verdict)}: "
           f"[report]({where}) |")
    last = max((i for i, ln in enumerate(lines) if ln.startswith("|")), default=len(lines) - 1)
    record.write_text("\n".join([*lines[:last + 1], row, *lines[last + 1:]]) + "\n")


def evidence(folder: Path) -> None:
    """What the device and the build are, beside the report: nvidia-smi -q and torch.__config__.show()."""
    (folder / "torch-config.txt").write_text(torch.__config__.show())
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out = f"nvidia-smi -q failed: {e}"
        (folder / "nvidia-smi-q.txt").write_text(out)


def nvml_gpus() -> list[str]:
    """The GPUs NVML sees (their names), whatever torch sees; [] without a driver."""
    try:
        nvml = devices.nvml_module()
        return [devices._text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nvml.nvmlDeviceGetCount())]
    except Exception:  # ImportError, OSError or NVMLError: no driver here
        return []


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m profiler.gpu_check", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script")
    p.add_argument("--models", nargs="+", help="models of the reduced sweep (default: those of default.yaml)")
    p.add_argument("--sizes", nargs="+", type=int, default=[512, 1024], help="square sizes of the reduced sweep")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds for the whole verdict (default 420): a check that would not fit is skipped")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the report and everything it rests on (default: results/gpu-check-<time>)")
    p.add_argument("--record", default=None,
                   help=f"the record table to add a row to (default: {RECORD.relative_to(REPO)} on a GPU, none on "
                        "the CPU); 'none' for no row")
    return p


def _no_cuda() -> int | None:
    """Exit code and one line where there is no CUDA to check; None where there is."""
    if torch.cuda.is_available():
        return None
    gpus = nvml_gpus()
    if gpus:
        print(f"gpu-check: NVML sees {len(gpus)} GPU(s) ({gpus[0]}) but this torch has no CUDA (torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}): install a CUDA build of torch, then run "
              "make gpu-check again")
        return 1
    print("gpu-check: no CUDA GPU here (torch sees none): nothing to check and no report written; run "
          "make gpu-check on a GPU box")
    return 0


def started_at() -> float:
    """perf_counter's reading when this process started (Linux: /proc/self/stat), so that the budget holds the
    interpreter's start and imports too, as a `timeout` around the command does; now where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.perf_counter() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and (code := _no_cuda()) is not None:
        return code
    t0 = started_at() if argv is None else time.perf_counter()
    out = args.out or REPO / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S", time.gmtime())
    ctx = Context(device=args.device, out=out, models=tuple(args.models) if args.models else None,
                  sizes=tuple(args.sizes))
    report, sweep = Report(out), ctx.default_sweep()
    env = environment(sweep.resolved_device())
    command = "make gpu-check" if args.device == "cuda" and argv is None else \
        "python -m profiler.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    for line in header(env, command, args.budget_s, sweep) + plan_lines(ctx):
        report.write(line)
    print("\n".join(plan_lines(ctx)), flush=True)
    report.write(f"## Checks\n\n| # | check | result | seconds | figure |\n|---|---|---|---|---|")
    evidence(out)
    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    try:
        results, stopped = run_checks(ctx, report, args.budget_s, t0)
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_IGN if s != signal.SIGALRM else handler)
    try:
        verdict = closing(report, results, stopped, ctx, time.perf_counter() - t0)
        record = RECORD if args.record is None and cuda else None if args.record in (None, "none") else \
            Path(args.record)
        if record:
            add_record(record, env, verdict, report.path)
        report.say(f"gpu-check: {verdict}; report: {report.path} ({time.perf_counter() - t0:.0f} s)")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 1 if stopped or any(r[1] == "FAIL" for r in results) else 0
