"""A profiled generation (Profile: what record/session.py measured) and the run of kind `record` (store.RUN_KINDS) it
is stored as: a cell per distinct pipeline, denoiser, dtype, size and batch (cell_key, cells_of: generations at two
sizes are never samples of one another), one block row per call of a forward with the per-forward times as its
samples (cell_rows), and every call with its step in calls-<cell_id>.parquet (store_cell)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ..measure.probes import summarize
from ..spec import CellSpec
from .summary import components_of

DENOISERS = ("unet", "transformer", "prior", "model")  # the one whose forwards are the steps


@dataclass
class Profile:
    """What a profiled generation measured. calls: one row per attention call; components: per component its
    forwards, their time, its attention calls and their time; run_dir: the stored run (None with out=None)."""

    target: str = ""
    calls: pd.DataFrame = field(default_factory=pd.DataFrame)
    components: pd.DataFrame = field(default_factory=pd.DataFrame)
    forwards: pd.DataFrame = field(default_factory=pd.DataFrame)  # each component forward: component, time_ms
    generations: pd.DataFrame = field(default_factory=pd.DataFrame)  # each pipeline call: generation, wall_s, steps
    run_dir: Path | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    traces: list[bytes] = field(default_factory=list)  # with trace=True: the generation's Chrome / Perfetto trace

    def __str__(self) -> str:
        from .summary import summary

        return summary(self)


def cell_rows(prof: Profile, backend: str | None) -> tuple[dict, list[dict]]:
    """The stored cell and its block rows: the denoiser's forwards are the timed forwards (their times, their
    attention sums the samples of the noise rule); one block row per call of a forward of each component, its
    samples the forwards'."""
    f, calls = prof.facts, prof.calls
    clock = f.get("time_source") or ("cupti" if f["device"].startswith("cuda") else "host clock")
    spec = CellSpec(f"{f['pipeline']} {f['denoiser']}", int(f["width"]), int(f["height"]), int(f["batch"]),
                    f["dtype"], backend or "loaded", "cuda" if f["device"].startswith("cuda") else "cpu")
    loop = calls[calls["component"].isin(DENOISERS)] if len(calls) else calls
    per_forward = loop.groupby(["generation", "pass_index"])["time_ms"].sum().tolist() if len(loop) else []
    forward_ms = prof.forwards[prof.forwards["component"].isin(DENOISERS)]["time_ms"].tolist() \
        if len(prof.forwards) else []
    blocks = []
    for (component, call_index), same in calls.groupby(["component", "call_index"], sort=False) if len(calls) else []:
        first = same.iloc[0].to_dict()
        samples = same["time_ms"].tolist()
        peaks, faulted = same["peak_bytes"].dropna(), same["faulted_bytes"].dropna()
        blocks.append({**spec.as_row(), **{k: first[k] for k in ("component", "block", "call_index", "stage", "level",
                                                                   "kind", "batch", "heads", "head_dim", "tokens_q",
                                                                   "tokens_k", "score_elements", "score_bytes",
                                                                   "flops", "upcast")},
                       **summarize(samples), "time_samples_ms": samples, "calls_recorded": len(same),
                       "time_source": clock, **{k: _median(same, k) for k in ("host_ms", "attn_kernel_ms",
                                                                              "proj_kernel_ms")},
                       "time_total_ms": float(sum(samples)),
                       "peak_mem_bytes": int(peaks.max()) if len(peaks) else None, "predicted_peak_bytes": None,
                       "faulted_bytes": int(faulted.median()) if len(faulted) else None, "kernel": "",
                       "sdpa_kernel": None, "gpu_time_ms": None, "gpu_kernels": None, "status": "ok"})
    for i, b in enumerate(blocks):
        b["call_index"] = i
    fwd, attention = summarize(forward_ms), summarize(per_forward)
    peaks = calls["peak_bytes"].dropna() if len(calls) else pd.Series(dtype=float)
    cell = {**spec.as_row(), "status": "ok", "error": "", "kind": "record", "time_source": clock,
            "pipeline_device": f["device"],
            **{f"attention_{k}": _per_forward(loop, v) for k, v in (("kernel_ms", "attn_kernel_ms"),
                                                                     ("proj_ms", "proj_kernel_ms"),
                                                                     ("host_ms", "host_ms"))},
            "forward_time_ms": fwd["time_ms"], "forward_time_samples_ms": forward_ms, "forward_iqr_ms": fwd["iqr_ms"],
            "noisy": fwd["noisy"] or attention["noisy"], "attention_time_ms": attention["time_ms"],
            "attention_time_samples_ms": per_forward,
            "attention_peak_mem_bytes": int(peaks.max()) if len(peaks) else None, "predicted_peak_bytes": None,
            "calls": int(len(loop) / max(1, len(per_forward))), "kernel": "", "sdpa_kernel": None,
            "pipeline": f["pipeline"], "denoiser": f["denoiser"], "source": f["source"], "steps": f["steps"],
            "guidance": f["guidance"],
            "scheduler": f["scheduler"], "processors": f["processors"], "generation_s": prof.wall_s,
            "generations": len(prof.generations), "generation_times_s": prof.generations["wall_s"].tolist(),
            "generation_steps": prof.generations["steps"].tolist(),
            "attention_share": float(calls["time_ms"].sum()) / 1e3 / prof.wall_s if prof.wall_s and len(calls) else None,
            "components": json.dumps(prof.components.to_dict("records"), default=float),
            "notes": "; ".join(prof.notes), "torch_threads": torch.get_num_threads()}
    return cell, blocks


def _median(rows: pd.DataFrame, column: str) -> float | None:
    values = rows[column].dropna() if column in rows else []
    return float(values.median()) if len(values) else None


def _per_forward(loop: pd.DataFrame, column: str) -> float | None:
    """A denoiser forward's calls' figure summed, the median over its forwards (None where no call has it)."""
    if not len(loop) or column not in loop or loop[column].isna().all():
        return None
    return float(loop.groupby(["generation", "pass_index"])[column].sum().median())


UNSIZED = ("nothing stored: no forward of the denoiser was seen (compiled with module.compile(): no hook of ours runs "
           "there), so the generation's size is unknown; torch.compile(module) leaves its forwards timeable")


def store(prof: Profile, out: Path, command: str, partial: bool = False) -> Path | None:
    """The generation(s) as a new run of kind `record` under out: a cell per size (cells_of), its block rows, every
    call with its step; None (and a note) where no generation's size is known. partial: a Ctrl-C cut the block short
    (its cells partial, the run interrupted)."""
    from ..store import Run, now

    parts = cells_of([prof])
    if not parts:
        prof.notes.append(UNSIZED)
        return None
    run = Run.create(out, {"kind": "record", "command": command, "cells": [], "ended_at": None})
    cells = [store_cell(run, part, prof.facts.get("backend"), partial) for part in parts]
    run.update_manifest(ended_at=now(), interrupted=partial, notes=prof.notes,
                        cells=[{k: cell[k] for k in CellSpec("", 0, 0, 0, "", "", "").as_row()} for cell in cells])
    return run.path


def store_cell(run, prof: Profile, backend: str | None, partial: bool = False) -> dict:
    """Record the profiled generation(s) of one cell (cells_of) as a cell of the run (its blocks, its calls as
    calls-<cell_id>.parquet, its traces), the run's environment added to its manifest where it has none, and the
    generations' facts: per cell (the manifest's record.cells[cell_id]) and, for readers of one cell, at the top.
    partial: the generations of a script stopped before it ended (attnprof record --resume runs it again), or of a
    profile block a Ctrl-C cut short (its steps that ended)."""
    from ..env import environment

    cell, blocks = cell_rows(prof, backend)
    cell["partial"] = partial
    files = {f"{cell['cell_id']}.generation-{i}.trace.json": t for i, t in enumerate(prof.traces)}
    run.record(cell, blocks, files or None)
    run.write_frame(f"calls-{cell['cell_id']}", prof.calls)
    m = run.manifest()
    if not m.get("device_limits"):  # what the time model keys its calibration by (measured once per machine)
        from ..measure.limits import device_limits

        run.update_manifest(**device_limits(prof.facts["device"], [prof.facts["dtype"]]))
    facts = {k: v for k, v in prof.facts.items() if k != "backend"}
    record = m.get("record") or {}
    run.update_manifest(environment=m.get("environment") or {**environment(prof.facts["device"]),
                                                            "executor": "record"},
                        record={**record, **facts, "cells": {**(record.get("cells") or {}), cell["cell_id"]: facts}})
    return cell


def cell_key(prof: Profile, generation: dict) -> tuple:
    """What makes a recorded generation's cell: its pipeline's class, its denoiser's class and config hash, its dtype,
    its size and batch (its latent shape). Generations of one key are samples of one another; of two, never."""
    f = prof.facts
    return (f.get("pipeline"), f.get("denoiser"), f.get("dtype"), int(generation["width"]), int(generation["height"]),
            int(generation["batch"]))


def cells_of(profiles: list[Profile]) -> list[Profile]:
    """The generations of these profiles (one profile block's, or each pipeline call of a script's) as a Profile per
    cell (cell_key), in the order each first ran: a block that ran 64x64 then 48x48 gives two, an SDXL base and its
    refiner two; each with its own calls, forwards, wall time, components and facts."""
    parts: dict[tuple, list[Profile]] = {}
    for p in profiles:
        keys = [cell_key(p, g) for g in p.generations.to_dict("records")] or [cell_key(p, {**p.facts})]
        for key in dict.fromkeys(k for k in keys if k[3]):  # no size: no denoiser forward seen (UNSIZED)
            mine = [i for i, k in enumerate(keys) if k == key]
            parts.setdefault(key, []).append(p if len(mine) == len(keys) else _part(p, mine))
    return [merged(ps) for ps in parts.values()]


def _part(p: Profile, generations: list[int]) -> Profile:
    """The profile of some of p's generations only, numbered from 0; its wall time theirs."""
    number = {g: i for i, g in enumerate(generations)}
    pick = lambda df: df[df["generation"].isin(generations)].assign(  # noqa: E731
        generation=lambda d: d["generation"].map(number)).reset_index(drop=True)
    calls, forwards, gens = pick(p.calls), pick(p.forwards), pick(p.generations)
    first = gens.iloc[0]
    return Profile(target=p.target, calls=calls, components=components_of(p.components, calls, forwards),
                   forwards=forwards, generations=gens, wall_s=float(gens["wall_s"].sum()), notes=p.notes,
                   facts={**p.facts, "generations": len(gens), **{k: int(first[k]) for k in ("batch", "width",
                                                                                              "height", "steps")},
                          "cut_short": bool(p.facts.get("cut_short")) and generations[-1] == len(p.generations) - 1},
                   traces=p.traces if 0 in generations else [])


def merged(profiles: list[Profile]) -> Profile:
    """Profiles of one cell (several pipeline calls of one process: attnprof record) as one: their calls, forwards
    and generations numbered on, one after another, their wall time together, the first one's facts."""
    if len(profiles) == 1:
        return profiles[0]
    calls, forwards, generations, offset = [], [], [], 0
    for p in profiles:
        on = lambda df: df.assign(generation=df["generation"] + offset) if len(df) else df  # noqa: E731
        calls.append(on(p.calls))
        forwards.append(on(p.forwards))
        generations.append(on(p.generations))
        offset += len(p.generations)
    comps = pd.concat([p.components for p in profiles]).groupby(["component", "class", "not_recorded"], sort=False,
                                                                 as_index=False).sum(min_count=1)  # NaN: not recorded
    return Profile(target=profiles[0].target, calls=pd.concat(calls, ignore_index=True), components=comps,
                   forwards=pd.concat(forwards, ignore_index=True),
                   generations=pd.concat(generations, ignore_index=True),
                   wall_s=sum(p.wall_s for p in profiles), notes=sorted({n for p in profiles for n in p.notes}),
                   facts={**profiles[0].facts, "generations": offset},
                   traces=[t for p in profiles for t in p.traces])
