"""The five files of make gpu-check at the top of --out (Out), each written as the check goes, so that a kill keeps
what was found: report.md (every verdict with its figures and the rows it rests on: header, evidence_lines,
run_table, closing), cells.csv and blocks.csv (every cell and every attention call of every run, rewritten as each
cell lands), gpu-check.log (the console, the children's output, each run's worker.log with faulthandler's traces)
and device.txt (device_facts: nvidia-smi -q, torch's build, cuDNN, the commit); and a row of docs/gpu-validation.md's
record table (add_record). The runs themselves go under --runs: nothing needed to judge a verdict lives only there."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from ..attention import backends
from ..env import REPO
from ..store import Run, list_runs, write_text
from .verdicts import Context, num

RECORD = REPO / "docs" / "gpu-validation.md"
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


def closing(out: Out, results: list[tuple], stopped: str | None, seconds: float) -> str:
    counts = {v: sum(1 for r in results if r[1] == v) for v in ("PASS", "FAIL", "SKIP")}
    tally = f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
    out.write("## Summary\n\n| # | step | result | seconds | figure |\n|---|---|---|---|---|")
    for i, (name, verdict, secs, figure) in enumerate(results, 1):
        out.write(f"| {i} | {name} | {verdict} | {secs:.1f} | {num(figure)} |")
    verdict = stopped or tally
    out.write(f"\n**{verdict}** ({tally} in {seconds:.0f} s)\n")
    return verdict
