"""What every step of make gpu-check shares: the Context it runs in, a step that cannot run (Skip), a Verdict with
its evidence rows (each naming the cells.csv / blocks.csv row and columns it rests on), and the small helpers the
judges read tables with. Below the steps (checks.py, timing_judges.py, and the plan, plan.py)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from ..execute.grid import Sweep

NATIVE = (("sd15", 512), ("sdxl-base", 1024))  # the models of the runs, each at its native size
CELL_TIMEOUT_S = 120  # per cell of a run: a cell that hangs is stopped and recorded as `timeout`


class Skip(Exception):
    """A step that cannot run here, with the reason; never reported as PASS."""


@dataclass
class Context:
    """What every step knows: the device, where the report and the runs go, the (model, size) pairs of the runs and
    the core run's backends (default CORE_BACKENDS on CUDA, CPU_CORE_BACKENDS on the CPU)."""

    device: str = "cuda"
    out: Path = Path("gpu-check")
    runs: Path = Path("gpu-check/runs")
    pairs: tuple[tuple[str, int], ...] = NATIVE
    core_backends: tuple[str, ...] | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def as_json(self) -> dict:
        return {**asdict(self), "out": str(self.out), "runs": str(self.runs)}

    @classmethod
    def from_json(cls, d: dict) -> "Context":
        return cls(d["device"], Path(d["out"]), Path(d["runs"]), tuple(tuple(p) for p in d["pairs"]),
                   tuple(d["core_backends"]) if d.get("core_backends") else None)

    def need_cuda(self) -> None:
        if not self.cuda or not torch.cuda.is_available():
            raise Skip(f"needs a CUDA device (here: {self.device})")

    def sweep(self, backends_, pairs=None, **kw) -> Sweep:
        """One run over (model, size) pairs: each pair its own grid (a Sweep's further grids), fp16 on CUDA, fp32 on
        the CPU, 3 timed forwards after 1 warm-up, into self.runs."""
        dtype = "float16" if self.cuda else "float32"
        grids = [Sweep(models=(m,), sizes=((s, s),), dtypes=(dtype,), backends=tuple((b, ()) for b in backends_),
                       repeats=3, warmup=1, device=self.device, out=str(self.runs), timeout_s=CELL_TIMEOUT_S, **kw)
                 for m, s in (pairs or self.pairs)]
        return replace(grids[0], also=tuple(grids[1:]))

    def record(self, step: str, rows: list[tuple[dict, list[dict]]]):
        """Cells a model check measured itself, recorded as a run of its own (command `gpu-check <step>`), so that
        cells.csv and blocks.csv hold their figures."""
        from ..env import environment
        from ..store import Run, now

        run = Run.create(self.runs, {"command": f"gpu-check {step}", "cells": [], "ended_at": None,
                                     "environment": environment(self.device)})
        for cell, blocks in rows:
            run.record(cell, blocks)
        run.update_manifest(ended_at=now(), interrupted=False)
        return run


@dataclass
class Verdict:
    """A step's outcome: its figure (one line), the rows it rests on, and what broke its rule (none: PASS)."""

    figure: str
    evidence: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def num(v) -> str:
    """A value as the report writes it: whole numbers whole, others to 6 significant digits (cells.csv and
    blocks.csv hold them whole), None / NaN as null."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "null"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1e6):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.6g}"
    return " ".join(str(v).split()).replace("|", "/")


def what(r: dict) -> str:
    return f"{r.get('model')} {r.get('width')}x{r.get('height')} {r.get('backend')}"


def evidence(r: dict, table: str, measured, against=(), rule: str = "", ok: bool = True) -> dict:
    """One evidence row: the cells.csv or blocks.csv row (by cell_id, and call_index for a call), the columns read
    (`col = value; ...`) and those it was held against, the rule and whether it held."""
    pairs = lambda cols: "; ".join(f"{c} = {num(r.get(c))}" for c in ([cols] if isinstance(cols, str) else cols))  # noqa: E731
    return {"table": table, "cell_id": r.get("cell_id", ""),
            "call_index": r.get("call_index") if table == "blocks" else None,
            "what": what(r) + (f" {r.get('block')}" if table == "blocks" else ""),
            "measured": pairs(measured), "against": pairs(against) if against else "", "rule": rule, "ok": bool(ok)}


def said(text: str, rule: str = "", ok: bool = True) -> dict:
    """An evidence row measured by a model check itself, not read from a table (its log has it too)."""
    return {"table": "check", "cell_id": "", "call_index": None, "what": "", "measured": text, "against": "",
            "rule": rule, "ok": bool(ok)}


def records(df: pd.DataFrame) -> list[dict]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in df.to_dict("records")] if len(df) else []


def ok_cells(cells: pd.DataFrame) -> pd.DataFrame:
    ok = cells[cells["status"] == "ok"] if len(cells) else cells
    if not len(ok):
        raise Skip("no cell of the run ended ok")
    return ok


def ratio_rows(rows: list[dict], table: str, measured: str, against: str, low: float, high: float, rule: str):
    """Evidence for measured / against within [low, high] per row: (evidence, failures, ratios)."""
    out, failed, ratios = [], [], []
    for r in rows:
        ratio = r[measured] / r[against] if r.get(against) else float("nan")
        ok = low <= ratio <= high
        ratios.append(ratio)
        out.append(evidence(r, table, measured, against, f"{rule} (ratio {ratio:.4f})", ok))
        if not ok:
            failed.append(f"{what(r)}{' ' + str(r.get('block')) if table == 'blocks' else ''}: {measured} "
                          f"{num(r[measured])} / {against} {num(r.get(against))} = {ratio:.4f}")
    return out, failed, ratios


def span(ratios) -> str:
    ratios = [r for r in ratios if r == r]
    return f"{min(ratios):.3f}..{max(ratios):.3f}" if ratios else "none"
