"""attnprof from Python: the planner's two commands (plan, fit) as functions that return frozen dataclasses with
DataFrames, beside profile (record/session.py). They take what the command line takes, as Python values, and run the
same code (planner/calls.py, planner/fit.py); printing one gives what the command prints."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from .spec import parse_bytes, parse_size


@dataclass(frozen=True)
class Plan:
    """One model at one size: blocks, one row per attention call (tokens, score tables, FLOPs; with a backend each
    call's predicted and traced peak); totals, the forward's (with a backend its predicted peak, and whether it fits
    a budget)."""

    model: str
    width: int
    height: int
    batch: int
    dtype: str
    backend: str | None
    blocks: pd.DataFrame
    totals: pd.Series
    raw: dict = field(repr=False, compare=False)

    def __str__(self) -> str:
        from .planner import format_plan

        return format_plan(self.raw)


@dataclass(frozen=True)
class Fit:
    """The largest image whose forward fits a memory budget, per backend: backends, one row per backend (largest
    width and height, the bytes it needs, the next step and its need, how it was traced)."""

    model: str
    budget_bytes: int
    dtype: str
    batch: int
    backends: pd.DataFrame
    raw: dict = field(repr=False, compare=False)

    def __str__(self) -> str:
        from .planner.fit import format_fit

        return format_fit(self.raw)


def plan(model: str, size: str = "512x512", batch: int = 1, dtype: str = "float16", backend: str | None = None,
         options: dict | None = None, memory_budget: str | int | None = None, device: str = "cuda",
         gpu_arch: str | None = None, settings: dict | None = None, gpu: str | None = None,
         results: str | None = None, host_us_per_op: float | None = None) -> Plan:
    """attnprof plan --model MODEL --size SIZE [--backend B ...] [--gpu NAME] in Python: no weights, no GPU. With
    gpu (a name of attnprof gpus), or results (this machine's stored runs), the predicted times too, in totals and
    each block's row (planner/predict.py, as the command prints them): backend's, or sdpa's where backend is None
    (as attnprof plan takes it), which then has no peak of its own."""
    from .planner import plan as run, predict

    width, height = parse_size(size)
    budget = parse_bytes(memory_budget, "memory_budget") if isinstance(memory_budget, str) else memory_budget
    raw = run(model, width, height, batch, dtype, backend, options, budget, device, gpu_arch,
              tuple(sorted((settings or {}).items())))
    if gpu or results or host_us_per_op is not None:
        predict.plans([raw], backend, raw["dtype"], device, gpu, results, host_us_per_op)
    return Plan(model, width, height, batch, raw["dtype"], backend, pd.DataFrame(raw["blocks"]),
                pd.Series(raw["totals"]), raw)


def fit(model: str, budget: str | int, backends: list[str] | None = None, dtype: str = "float16", batch: int = 1,
        aspect: str = "1:1", device: str = "cuda", gpu_arch: str | None = None, gpu: str | None = None,
        results: str | None = None, host_us_per_op: float | None = None) -> Fit:
    """attnprof fit --model MODEL --budget BUDGET [--backend B ...] [--gpu NAME] in Python: the largest square (or
    `aspect`) image per backend whose whole forward fits the budget (a size such as 24GiB, a GPU's name, or bytes);
    with gpu or results, each backend's predicted forward time at its largest (column predicted_forward_time_ms)."""
    from .planner import predict
    from .planner.fit import fit as run, parse_aspect

    need = parse_bytes(budget, "budget") if isinstance(budget, str) else int(budget)
    raw = run(model, need, backends, dtype, batch, parse_aspect(aspect), device=device, gpu_arch=gpu_arch)
    if gpu or results or host_us_per_op is not None:
        predict.fit_lines(raw, model, (), True, raw["dtype"], batch, device, gpu, results, host_us_per_op)
    rows = [{"backend": b["backend"], "largest_width": (b["largest"] or [None, None])[0],
             "largest_height": (b["largest"] or [None, None])[1], "largest_need_bytes": b["largest_need_bytes"],
             "next_width": (b["next"] or [None, None])[0], "next_height": (b["next"] or [None, None])[1],
             "next_need_bytes": b["next_need_bytes"], "method": b["method"],
             "predicted_forward_time_ms": b.get("predicted_forward_time_ms")} for b in raw["backends"]]
    return Fit(model, need, raw["dtype"], batch, pd.DataFrame(rows), raw)
