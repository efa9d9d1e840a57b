"""The stepping of make gpu-check: the plan's rows within a budget (plan_rows, plan_lines, Budget), then every step in
order of value (run_steps), each that runs a model in a child process of its own (child.py, its own process group:
run_child), the evidence written as it comes.

- The plan (plan.STEPS) lists each step with its expected seconds here; those whose running total passes the
  budget are marked as beyond it. As steps end, the estimates are scaled by measured / expected of the steps run so
  far, and a step that no longer fits in what is left is SKIPped with that reason, never started.
- The main process never makes a CUDA context: it reads device properties and NVML, judges tables, writes files.
  Every wait on a child has a deadline (the step's own, within the budget's); SIGTERM, SIGINT or the budget's end
  stop the step in flight (Stops), and its process group is killed, so that nothing of the check holds the GPU
  after the report's last line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import torch

from .checks import new_backend_reason
from .plan import STEPS, Step
from .report import Out, evidence_lines, run_table
from .verdicts import Context, Skip, num

RESERVE_S = 8.0  # of the budget kept for the report's last lines


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

def plan_rows(ctx: Context, budget_s: float) -> list[tuple[Step, float | None, bool]]:
    """(step, expected seconds, within the budget) in order: the running total of those within stays under the
    budget less its reserve."""
    total, rows = 0.0, []
    for step in STEPS:
        s = step.expected(ctx.cuda)
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
    if step.expected(ctx.cuda) is None:
        return f"needs a CUDA device (here: {ctx.device})"
    if step.backend:
        return new_backend_reason(step.backend, ctx.device)
    if step.needs_two_gpus and torch.cuda.device_count() < 2:
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
        start, expected = time.monotonic(), step.expected(ctx.cuda)
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
