"""The runner of make gpu-check: the plan first, then every step in order of value within a budget, each step that
runs a model in a child process of its own (child.py, its own process group), the evidence written as it comes.

- The plan (plan.STEPS) lists each step with its expected seconds here; those whose running total passes the
  budget are marked as beyond it. As steps end, the estimates are scaled by measured / expected of the steps run so
  far, and a step that no longer fits in what is left is SKIPped with that reason, never started.
- The main process never makes a CUDA context: it reads device properties and NVML, judges tables, writes files.
  Every wait on a child has a deadline (the step's own, within the budget's); SIGTERM, SIGINT or the budget's end
  stop the step in flight, and its process group is killed, so that nothing of the check holds the GPU after the
  report's last line.
- At the top of --out, five files, each written as the check goes (a kill keeps what was found): report.md (every
  verdict with its figures and the rows it rests on), cells.csv and blocks.csv (every cell and every attention call
  of every run, rewritten as each cell lands), gpu-check.log (the console, the children's output, each run's
  worker.log with faulthandler's traces) and device.txt (nvidia-smi -q, torch's build, cuDNN, the commit). The runs
  themselves go under --runs (default --out/runs): nothing needed to judge a verdict lives only there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from ..attention import backends
from .. import devices
from ..env import REPO, environment
from ..store import Run, list_runs, write_text
from .checks import new_backend_reason
from .plan import STEPS, Step
from .verdicts import NATIVE, Context, Skip, num

RECORD = REPO / "docs" / "gpu-validation.md"
RESERVE_S = 8.0  # of the budget kept for the report's last lines
DEFAULT_BUDGET_S = 300.0
FILES = ("report.md", "cells.csv", "blocks.csv", "gpu-check.log", "device.txt")  # and on CUDA trace-<model>.json.gz
FIRST = ["step", "run_id", "cell_id", "model", "width", "height", "batch", "dtype", "backend", "status"]
BLOCK_FIRST = [*FIRST[:9], "call_index", "block", "kind", "heads", "head_dim", "tokens_q", "tokens_k", "time_ms",
               "time_source", "attn_kernel_ms", "proj_kernel_ms", "host_ms", "launch_bound", "event_ms",
               "graph_time_ms", "gpu_time_ms", "peak_mem_bytes", "predicted_peak_bytes", "sdpa_kernel",
               "sdpa_kernel_asked", "gpu_kernels", "kernel"]


class Out:
    """The files at the top of --out, appended a line at a time and synced to disk at once (report, log), or
    rewritten whole and atomically (the tables)."""

    def __init__(self, folder: Path, runs: Path):
        self.folder, self.runs = folder, runs
        folder.mkdir(parents=True, exist_ok=True)
        runs.mkdir(parents=True, exist_ok=True)
        self.report, self.log = folder / "report.md", folder / "gpu-check.log"
        self.report.write_text("")
        self.log.write_text("")
        self._seen: dict = {}
        self._logged: dict[Path, int] = {}

    @staticmethod
    def append(path: Path, text: str) -> None:
        with open(path, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write(self, text: str) -> None:
        self.append(self.report, text)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.append(self.log, text)

    def signature(self) -> tuple:
        """What the runs folder holds now, cheaply: per run, its cell files and compacted table (name, mtime)."""
        sig = []
        for run in list_runs(self.runs):
            for sub in ("cells", "cells.parquet"):
                p = run / sub
                if p.is_dir():
                    sig += [(e.name, e.stat().st_mtime_ns) for e in os.scandir(p)]
                elif p.exists():
                    sig.append((str(p), p.stat().st_mtime_ns))
        return tuple(sorted(sig))

    def runs_read(self) -> dict[str, tuple[pd.DataFrame, pd.DataFrame]]:
        """Every run under --runs by its step (the manifest's command `gpu-check <step>`): (cells, blocks)."""
        out = {}
        for path in list_runs(self.runs):
            run = Run.open(path)
            step = str(run.manifest().get("command", "")).removeprefix("gpu-check ")
            cells, blocks = run.read()
            out[step] = (cells.assign(step=step) if len(cells) else cells,
                         blocks.assign(step=step) if len(blocks) else blocks)
        return out

    def tables(self, force: bool = False) -> list[dict]:
        """cells.csv and blocks.csv rewritten from every run, where a cell landed since the last time (or force);
        the cells new since then, for the console."""
        sig = self.signature()
        if sig == self._seen.get("sig") and not force:
            return []
        runs = self.runs_read()
        cells = pd.concat([c for c, _ in runs.values() if len(c)] or [pd.DataFrame()], ignore_index=True)
        blocks = pd.concat([b for _, b in runs.values() if len(b)] or [pd.DataFrame()], ignore_index=True)
        for name, df, first in (("cells.csv", cells, FIRST), ("blocks.csv", blocks, BLOCK_FIRST)):
            cols = [c for c in first if c in df] + [c for c in df.columns if c not in first]
            write_text(self.folder / name, df[cols].to_csv(index=False) if len(df) else "")
        known = self._seen.get("cells", set())
        new = [r for r in cells.to_dict("records") if (r["step"], r["cell_id"]) not in known] if len(cells) else []
        self._seen = {"sig": sig, "cells": known | {(r["step"], r["cell_id"]) for r in new}}
        return new

    def keep_traces(self, step: str) -> list[str]:
        """One kernel-timing trace per model of a run that kept them (its sdpa cell's, else its first's), copied flat
        to the top of --out as trace-<model>.json.gz: what a CPU test reads again (measure/trace.load). The names."""
        kept = []
        for path in list_runs(self.runs):
            run = Run.open(path)
            if str(run.manifest().get("command", "")).removeprefix("gpu-check ") != step:
                continue
            cells = run.cells()
            ok = cells[cells["status"] == "ok"] if len(cells) else cells
            for model, group in (ok.groupby("model", sort=False) if len(ok) else []):
                group = group.sort_values("backend", key=lambda b: b != "sdpa", kind="stable")
                found = [run.path / "traces" / f"{c}.kernels.json.gz" for c in group["cell_id"]]
                found = [f for f in found if f.is_file()]
                if found:
                    shutil.copyfile(found[0], self.folder / f"trace-{model}.json.gz")
                    kept.append(f"trace-{model}.json.gz")
        return kept

    def worker_logs(self) -> None:
        """What each run's workers wrote since the last time (library warnings, faulthandler's trace of a crash),
        appended to the log under the run's name: the last 200 lines of each."""
        for path in list_runs(self.runs):
            log = path / "worker.log"
            if not log.is_file() or log.stat().st_size == self._logged.get(log, 0):
                continue
            with open(log, "rb") as f:
                f.seek(self._logged.get(log, 0))
                lines = f.read().decode(errors="replace").splitlines()
            self._logged[log] = log.stat().st_size
            lines = [ln for ln in lines if not ln.startswith("USDT:")]
            if lines:
                self.append(self.log, f"---- {path.name}/worker.log ({len(lines)} new lines, the last 200) ----\n"
                            + "\n".join(lines[-200:]) + "\n---- end of worker.log ----")


# ---- stops: a flag set by the signal handlers, read by the waits (nothing is raised from a handler)

class Stops:
    def __init__(self):
        self.reason: str | None = None
        self.old = {}

    def __enter__(self):
        self.old = {s: signal.signal(s, self._note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _note(self, signum, frame) -> None:
        self.reason = self.reason or f"{signal.Signals(signum).name} received"

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)


def _stop_group(proc: subprocess.Popen) -> None:
    """The child's process group ended: SIGTERM (a sweep closes its run as interrupted), then SIGKILL to whatever is
    left of it after 2 s, waited for until none of it is alive."""
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace
        while time.monotonic() < end:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def run_child(step: Step, ctx: Context, out: Out, stops: Stops, deadline: float, budget_end: float,
              t0: float) -> tuple[str, dict]:
    """The step in a child process (its own process group), waited for until it ends, its deadline passes or a
    stop comes; cells that land meanwhile go into the tables at once. (how it ended: done | overran | stopped |
    budget, its result)."""
    result = out.runs / f".result-{re.sub(r'[^a-z0-9]+', '-', step.name)}.json"
    result.unlink(missing_ok=True)
    job = {"step": step.name, "ctx": ctx.as_json(), "result": str(result)}
    with open(out.log, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "profiler.gpu_check.child"], stdin=subprocess.PIPE,
                                stdout=log, stderr=log, start_new_session=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    how = "done"
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        last = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            if stops.reason:
                how = "stopped"
            elif now >= budget_end:
                how = "budget"
            elif now >= deadline:
                how = "overran"
            if how != "done":
                break
            if now - last >= 2.0:
                last = now
                for c in out.tables():
                    out.say(f"[{now - t0:5.0f} s]   {c['step']}: {c['model']} {c['width']}x{c['height']} "
                            f"{c['backend']}: {c['status']}" + (f" ({c.get('error')})" if c["status"] != "ok" else
                                                               f", forward {num(c.get('forward_time_ms'))} ms"))
            time.sleep(0.2)
    finally:
        _stop_group(proc)  # also after a normal end: nothing the step started outlives it
    code = proc.wait()
    try:
        got = json.loads(result.read_text())
    except (OSError, ValueError):
        got = None
    stopped = {"overran": f"stopped: it ran past its deadline ({deadline - t0:.0f} s into the check)",
               "stopped": f"stopped: {stops.reason}", "budget": "stopped: the budget ran out"}.get(how)
    if stopped:  # what a stopped child wrote (a sweep closed as interrupted) is not its verdict
        got = {"verdict": "FAIL" if how == "overran" else "STOPPED", "figure": stopped, "evidence": [],
               "failed": [stopped] if how == "overran" else []}
    elif got is None:
        why = f"its process died with {_exit_reason(code)} (faulthandler's trace, if any, in gpu-check.log)"
        got = {"verdict": "FAIL", "figure": why, "evidence": [], "failed": [why]}
    return how, got


def _exit_reason(code: int) -> str:
    from ..execute.local import exit_reason

    return exit_reason(code)


# ---- the plan and the budget

def expected_s(step: Step, ctx: Context) -> float | None:
    """Seconds the step is expected to take here; None where it cannot run at all (a CUDA step on the CPU)."""
    if step.needs_cuda and not ctx.cuda:
        return None
    return step.expected(ctx.cuda)


def plan_rows(ctx: Context, budget_s: float) -> list[tuple[Step, float | None, bool]]:
    """(step, expected seconds, within the budget) in order: the running total of those within stays under the
    budget less its reserve."""
    total, rows = 0.0, []
    for step in STEPS:
        s = expected_s(step, ctx)
        within = s is not None and total + s <= budget_s - RESERVE_S
        total += s if within else 0.0
        rows.append((step, s, within))
    return rows


def plan_lines(ctx: Context, budget_s: float) -> list[str]:
    where = "one H200-class GPU" if ctx.cuda else "this CPU (a dry run)"
    rows = plan_rows(ctx, budget_s)
    total = sum(s for _, s, within in rows if within)
    lines = [f"## Plan: {len(STEPS)} steps in order of value, expected {total:.0f} s of the {budget_s:.0f} s budget "
             f"on {where} (estimates until a GPU run times them; scaled as steps end)", "",
             "| # | step | kind | expected s | in the budget |", "|---|---|---|---|---|"]
    for i, (step, s, within) in enumerate(rows, 1):
        cost = "SKIP (needs CUDA)" if s is None else f"{s:.0f}" if s else "<1"
        lines.append(f"| {i} | {step.name} | {step.kind} | {cost} | "
                     f"{'yes' if within else 'no' if s is not None else '-'} |")
    return [*lines, ""]


def precondition(step: Step, ctx: Context, made: set[str]) -> str:
    """Why the step SKIPs before it starts ('' if it may run)."""
    if expected_s(step, ctx) is None:
        return f"needs a CUDA device (here: {ctx.device})"
    backend = getattr(step.fn, "backend", None)
    if backend:
        return new_backend_reason(backend, ctx.device)
    if step.fn.__name__ == "cuda1_is_measured_on_cuda1" and torch.cuda.device_count() < 2:
        return f"one CUDA device here ({torch.cuda.get_device_properties(0).name}): cuda:1 needs a second"
    if step.kind == "judge" and step.run not in made:
        return f"the {step.run} was not made"
    return ""


class Budget:
    """The budget's end, and the scale of this machine's speed against the plan's estimates."""

    def __init__(self, t0: float, budget_s: float):
        self.t0, self.end = t0, t0 + budget_s - RESERVE_S
        self.expected = self.measured = 0.0

    @property
    def scale(self) -> float:
        return min(4.0, max(0.5, self.measured / self.expected)) if self.expected else 1.0

    def left(self) -> float:
        return self.end - time.monotonic()

    def ran(self, expected: float, seconds: float) -> None:
        if expected:
            self.expected += expected
            self.measured += seconds


# ---- the report

def header(env: dict, command: str, budget_s: float, ctx: Context) -> list[str]:
    facts = [("GPU", env.get("device_name")), ("architecture", env.get("device_arch")), ("driver", env.get("driver")),
             ("CUDA", env.get("cuda")), ("cuDNN", env.get("cudnn")), ("torch", env.get("torch")),
             ("diffusers", env.get("diffusers")), ("python", env.get("python")), ("commit", env.get("git_revision")),
             ("started", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())), ("budget", f"{budget_s:.0f} s"),
             ("runs", ", ".join(f"{m} at {s}x{s}" for m, s in ctx.pairs))]
    return ["# GPU validation", "",
            f"Written by `{command}` as each step ends: every figure is what it measured, and each evidence row names "
            "the row of cells.csv or blocks.csv (beside this file) it was read from, by cell_id and call_index. A run "
            "that was killed ends without a verdict line; one stopped by a signal or its budget ends with a "
            "'stopped' line, its finished cells tabulated.", "",
            "| | value |", "|---|---|", *(f"| {k} | {num(v)} |" for k, v in facts), ""]


def evidence_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["| table | cell_id | call_index | what | measured | against | rule | holds |", "|" + "---|" * 8]
    for r in rows:
        out.append("| " + " | ".join(num(v) if v is not None else "" for v in (
            r["table"], r["cell_id"], r["call_index"], r["what"], r["measured"], r["against"], r["rule"],
            "yes" if r["ok"] else "NO")) + " |")
    return out


CELL_COLUMNS = ["cell_id", "model", "width", "height", "backend", "status", "time_source", "forward_time_ms",
                "forward_gpu_ms", "forward_graph_ms", "bound", "attention_time_ms", "attention_host_ms", "unsteady",
                "attention_peak_mem_bytes", "predicted_peak_bytes", "forward_peak_total_bytes",
                "predicted_forward_peak_bytes", "max_rel_err", "sdpa_kernel"]


def run_table(step: str, cells: pd.DataFrame) -> list[str]:
    """The cells of one run as recorded (cells.csv's columns, its values), whether it finished or was stopped."""
    order = {b: i for i, b in enumerate(backends.names())}
    cells = cells.assign(o=cells["backend"].map(order)).sort_values(["model", "width", "o"], kind="stable")
    cols = [c for c in CELL_COLUMNS if c in cells]
    lines = [f"### The cells of the {step} ({len(cells)} recorded)", "",
             "Columns of cells.csv; bytes whole, times in ms; a failed cell's error under status.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in cells.to_dict("records"):
        vals = [f"{r['status']}: {r.get('error')}" if c == "status" and r["status"] != "ok" else r.get(c)
                for c in cols]
        lines.append("| " + " | ".join(num(v) for v in vals) + " |")
    return [*lines, ""]


def device_facts(path: Path, env: dict) -> None:
    """device.txt: the commit, the environment, cuDNN, torch's build and nvidia-smi -q, in one file."""
    smi = shutil.which("nvidia-smi")
    try:
        smi_out = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=30).stdout if smi else \
            "nvidia-smi: not on PATH"
    except (OSError, subprocess.SubprocessError) as e:
        smi_out = f"nvidia-smi -q failed: {e}"
    write_text(path, f"commit: {env.get('git_revision')}\ncuDNN: {torch.backends.cudnn.version()}\n\n"
                     f"== environment ==\n{json.dumps(env, indent=1, default=str)}\n\n== torch.__config__.show() ==\n"
                     f"{torch.__config__.show()}\n== nvidia-smi -q ==\n{smi_out}\n")


def add_record(record: Path, env: dict, verdict: str, report: Path) -> None:
    """A row at the end of the record table of docs/gpu-validation.md: date, machine, verdict, the report."""
    lines = record.read_text().splitlines() if record.exists() else ["# GPU validation", "", "## Record", "",
                                                                     "| date | machine | result |", "|---|---|---|"]
    where = os.path.relpath(report, record.parent)
    row = (f"| {time.strftime('%Y-%m-%d', time.gmtime())} | {num(env.get('device_name'))} | {num(verdict)}: "
           f"[report]({where}) |")
    last = max((i for i, ln in enumerate(lines) if ln.startswith("|")), default=len(lines) - 1)
    record.write_text("\n".join([*lines[:last + 1], row, *lines[last + 1:]]) + "\n")


# ---- the steps

def judge(step: Step, ctx: Context, out: Out) -> dict:
    from .verdicts import Verdict

    cells, blocks = out.runs_read().get(step.run, (pd.DataFrame(), pd.DataFrame()))
    try:
        if not len(cells):
            raise Skip(f"the {step.run} recorded no cell")
        verdict: Verdict = step.fn(cells, blocks, ctx.device)
    except Skip as e:
        return {"verdict": "SKIP", "figure": str(e), "evidence": [], "failed": []}
    except Exception as e:  # a judge that breaks on what it read FAILs with why; the others still run
        return {"verdict": "FAIL", "figure": f"{type(e).__name__}: {e}", "evidence": [], "failed": [str(e)]}
    return {"verdict": "FAIL" if verdict.failed else "PASS", "figure": verdict.figure, "evidence": verdict.evidence,
            "failed": verdict.failed}


def run_steps(ctx: Context, out: Out, budget: Budget, stops: Stops) -> tuple[list[tuple], str | None]:
    """Every step in order: (name, verdict, seconds, figure) rows, and why the check stopped (None: it did not)."""
    results, made = [], set()
    for i, step in enumerate(STEPS, 1):
        if stops.reason or budget.left() <= 0:
            why = stops.reason or "the budget ran out"
            return results, f"stopped after {i - 1} of {len(STEPS)} steps: {why} before {step.name}"
        start, expected = time.monotonic(), expected_s(step, ctx)
        reason = precondition(step, ctx, made)
        scaled = (expected or 0.0) * budget.scale
        if not reason and step.kind != "judge" and scaled > budget.left():
            reason = f"would take about {scaled:.0f} s; {max(budget.left(), 0):.0f} s of the budget left"
        how = "done"
        if reason:
            got = {"verdict": "SKIP", "figure": reason, "evidence": [], "failed": []}
        elif step.kind == "judge":
            got = judge(step, ctx, out)
        else:
            out.say(f"[{start - budget.t0:5.0f} s] {step.name}: started (expected {scaled:.0f} s)")
            deadline = start + max(60.0, 2.5 * scaled)
            how, got = run_child(step, ctx, out, stops, deadline, budget.end, budget.t0)
            budget.ran(expected or 0.0, time.monotonic() - start)
            made |= {step.name} if step.kind == "run" else set()
            out.tables(force=True)
            out.worker_logs()
            if step.kind == "run" and (kept := out.keep_traces(step.name)):
                out.say(f"[{time.monotonic() - budget.t0:5.0f} s]   kept {', '.join(kept)} (kernel traces)")
        seconds = time.monotonic() - start
        results.append((step.name, got["verdict"], seconds, got["figure"]))
        out.write(f"### {i}. {step.name}: {got['verdict']} ({seconds:.1f} s)\n\n{num(got['figure'])}\n")
        if got["failed"]:
            out.write("What broke the rule:\n\n" + "\n".join(f"- {num(f)}" for f in got["failed"][:40]) + "\n")
        if got["evidence"]:
            out.write("\n".join(evidence_lines(got["evidence"])) + "\n")
        if step.kind == "run" and step.name in made:
            cells = out.runs_read().get(step.name, (pd.DataFrame(), None))[0]
            out.write("\n".join(run_table(step.name, cells)) if len(cells) else f"(the {step.name} recorded no cell)\n")
        out.say(f"[{time.monotonic() - budget.t0:5.0f} s] {got['verdict']}  {step.name}: {got['figure']}")
        if how in ("stopped", "budget"):
            why = stops.reason if how == "stopped" else "the budget ran out"
            what = f"; its {len(out.runs_read().get(step.name, ([],))[0])} finished cells are tabulated above" \
                if step.kind == "run" else ""
            return results, f"stopped after {i - 1} of {len(STEPS)} steps: {why} during {step.name}{what}"
    return results, None


def closing(out: Out, results: list[tuple], stopped: str | None, seconds: float) -> str:
    counts = {v: sum(1 for r in results if r[1] == v) for v in ("PASS", "FAIL", "SKIP")}
    tally = f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
    out.write("## Summary\n\n| # | step | result | seconds | figure |\n|---|---|---|---|---|")
    for i, (name, verdict, secs, figure) in enumerate(results, 1):
        out.write(f"| {i} | {name} | {verdict} | {secs:.1f} | {num(figure)} |")
    verdict = stopped or tally
    out.write(f"\n**{verdict}** ({tally} in {seconds:.0f} s)\n")
    return verdict


# ---- the command

def parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m profiler.gpu_check", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script")
    p.add_argument("--models", nargs="+", help=f"the runs' models (default: {', '.join(m for m, _ in NATIVE)})")
    p.add_argument("--sizes", nargs="+", type=int,
                   help="square sizes, one per model or one for all (default: each model's native size: "
                        f"{', '.join(f'{m} {s}' for m, s in NATIVE)}; 512 for others)")
    p.add_argument("--backends", nargs="+", help="the core run's backends (default: naive, sdpa and each SDPA "
                                                 "kernel forced; on the CPU those it runs)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole verdict (default {DEFAULT_BUDGET_S:.0f}): the plan fits in it, and a "
                        "step that no longer fits is skipped")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the five files (default: results/gpu-check-<time>)")
    p.add_argument("--runs", type=Path, default=None,
                   help="folder for the runs themselves (default: OUT/runs); nothing needed to judge a verdict lives "
                        "only there")
    p.add_argument("--record", default=None,
                   help=f"the record table to add a row to (default: {RECORD.relative_to(REPO)} on a GPU, none on "
                        "the CPU); 'none' for no row")
    p.add_argument("--dry-run", action="store_true", help="print the plan for the device and exit")
    return p


def nvml_gpus() -> list[str]:
    """The GPUs NVML sees (their names), whatever torch sees; [] without a driver."""
    try:
        nvml = devices.nvml_module()
        return [devices._text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nvml.nvmlDeviceGetCount())]
    except Exception:  # ImportError, OSError or NVMLError: no driver here
        return []


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
    """monotonic's reading when this process started (Linux: /proc/self/stat), so that the budget holds the
    interpreter's start and imports too, as a `timeout` around the command does; now where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.monotonic() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def context(args) -> Context:
    from ..spec import InputError

    pairs = NATIVE
    if args.models or args.sizes:
        names = args.models or [m for m, _ in NATIVE]
        sizes = args.sizes or [dict(NATIVE).get(m, 512) for m in names]
        if len(sizes) not in (1, len(names)):
            raise InputError(f"--sizes: give one size, or one per model ({len(names)}), not {len(sizes)}")
        pairs = tuple(zip(names, sizes * len(names) if len(sizes) == 1 else sizes))
    for b in args.backends or ():
        backends.check_backend_name(b)
    out = args.out or REPO / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S", time.gmtime())
    return Context(device=args.device, out=out, runs=args.runs or out / "runs", pairs=tuple(pairs),
                   core_backends=tuple(args.backends) if args.backends else None)


def main(argv=None) -> int:
    from ..spec import InputError

    args = parser().parse_args(argv)
    try:
        ctx = context(args)
    except InputError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(plan_lines(ctx, args.budget_s)))
        return 0
    if ctx.cuda and (code := _no_cuda()) is not None:
        return code
    t0 = started_at() if argv is None else time.monotonic()
    out = Out(ctx.out, ctx.runs)
    env = environment(devices.resolve(ctx.device))
    command = "make gpu-check" if args.device == "cuda" and argv is None else \
        "python -m profiler.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    plan = plan_lines(ctx, args.budget_s)
    for line in header(env, command, args.budget_s, ctx) + plan + ["## Steps", ""]:
        out.write(line)
    out.say("\n".join(plan))
    device_facts(ctx.out / "device.txt", env)
    for name in ("cells.csv", "blocks.csv"):
        write_text(ctx.out / name, "")
    with Stops() as stops:
        results, stopped = run_steps(ctx, out, Budget(t0, args.budget_s), stops)
        out.tables(force=True)
        verdict = closing(out, results, stopped, time.monotonic() - t0)
        record = RECORD if args.record is None and ctx.cuda else None if args.record in (None, "none") else \
            Path(args.record)
        if record:
            add_record(record, env, verdict, out.report)
        out.say(f"gpu-check: {verdict}; report: {out.report} ({time.monotonic() - t0:.0f} s)")
    return 1 if stopped or any(r[1] == "FAIL" for r in results) else 0
