"""attnprof replay: each distinct attention shape of a run or a plan, the backend's kernel alone on random Q, K, V.

- Shapes: a plan's calls (a meta-device forward: no weights, no U-Net in memory) or the block rows of a run's ok
  cells; a shape is (batch, heads, head_dim, tokens_q, tokens_k, kind, upcast). Each distinct one is measured once per
  backend, dtype and device, and its figures given to every call that has it.
- The kernel alone: a diffusers Attention of the shape's heads and head_dim, built on the meta device (no weights),
  whose to_q, to_k and to_v hand back random Q, K and V (B, T, heads x head_dim) made once beforehand and whose
  output projection is an identity: the backend's own processor then runs its head reshapes and its kernel and
  nothing else. A run's calls inside the model also ran the projections, their launches and copies: the gap.
- Repeats: `warmup` calls, then timed calls until there are at least `repeats` samples and their IQR is at most 10%
  of their median, or 5 x `repeats` samples, or the shape has been timed for MAX_S seconds (past `repeats`); a shape
  still over 10% is flagged noisy. On the CPU each call by the host clock. On CUDA as Inductor's
  do_bench_using_profiling does: each call's kernels (CUPTI, credited to the call's range: trace.call_samples), calls
  run back to back in batches under the profiler, an L2 flush before each (a buffer of twice the device's L2 written
  over, outside the call's range): the kernels of one call from a cold cache, no host time, no synchronize between.
- Memory: one more call under the probe (CUDA: the allocator's peak; the CPU: the profiler's allocation timeline):
  the transient over Q, K and V, which exist before the call (inside the model the projections allocate them).
- Stored like a run: a run folder with one cell per (model, size, batch, dtype, backend) and one block row per call
  of the forward (its shape's figures), so `attnprof show`, `attnprof diff` and the dashboard read it. The device's
  limits (limits.py) place each call on the roofline as in a measured run.
"""
from __future__ import annotations

import time

import pandas as pd
import torch

from ..attention import backends
from .. import devices
from ..unet.models import facts_of
from ..planner.memory import bytes_moved, predicted_peak_bytes, working_set
from ..spec import CellSpec, torch_dtype
from .limits import cell_peaks, device_limits, place, roof_of
from .probes import CallProbe, CallTimer, summarize, traced
from .trace import call_samples, events, trace_windows

SHAPE = ("batch", "heads", "head_dim", "tokens_q", "tokens_k", "kind", "upcast")
MAX_S = 10.0  # a noisy shape stops being timed after this many seconds (once it has `repeats` samples)


class _Given(torch.nn.Module):
    """Stands in for a projection: hands back a tensor made beforehand, so that only the attention is timed."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__()
        self.tensor = tensor

    def forward(self, x):
        return self.tensor


def _attention(shape: dict, dtype: str, device: torch.device):
    """(module, hidden_states, context) for one shape: random Q, K and V behind identity projections."""
    from diffusers.models.attention_processor import Attention

    h, d, b = shape["heads"], shape["head_dim"], shape["batch"]
    with torch.device("meta"):  # no weights: every projection is replaced below
        attn = Attention(query_dim=h * d, heads=h, dim_head=d, cross_attention_dim=h * d if shape["kind"] == "cross"
                         else None, upcast_attention=shape["upcast"] == "attention",
                         upcast_softmax=shape["upcast"] == "softmax")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h * d, generator=gen).to(device=device, dtype=torch_dtype(dtype))
               for t in (shape["tokens_q"], shape["tokens_k"], shape["tokens_k"]))  # (B, T, h*d)
    attn.to_q, attn.to_k, attn.to_v = _Given(q), _Given(k), _Given(v)
    attn.to_out[0] = torch.nn.Identity()
    return attn.eval(), q, k if shape["kind"] == "cross" else None


def measure_shape(shape: dict, spec: CellSpec, repeats: int, warmup: int) -> dict:
    """One shape's kernel alone: {time_ms, iqr_ms, noisy, time_samples_ms, peak_mem_bytes, kernel, sdpa_kernel}."""
    devices.keep_memory()  # timed as a cell is (devices.keep_memory)
    dev = devices.get(spec.device)
    with dev.guard(), torch.no_grad():
        attn, hidden, context = _attention(shape, spec.dtype, dev.torch)
        processor = backends.make_processor(spec.backend, **spec.options)
        row = {"call_index": 0, "block": shape["block"]}
        call = lambda: processor(attn, hidden, context)  # noqa: E731
        for _ in range(warmup):
            call()
        dev.synchronize()
        samples = kernel_samples(dev, call, repeats) if dev.kernel_clock else host_samples(dev, row, call, repeats)
        probe = CallProbe(dev)
        with traced(dev) as prof:
            probe(row, call)
        seen = trace_windows(prof, probe.ranges)[0].get(0, {})
        del attn, hidden, context
        dev.release()
    peak = probe.peak.get(0, seen.get("peak_mem_bytes"))  # the allocator's (CUDA), else the allocation timeline's
    return {**summarize(samples), "time_samples_ms": samples, "peak_mem_bytes": peak, "kernel": seen.get("kernel", ""),
            "time_source": "cupti" if dev.kernel_clock else "host clock",
            "sdpa_kernel": seen.get("sdpa_kernel") if backends.uses_sdpa(spec.backend) else None}


def host_samples(dev, row: dict, call, repeats: int) -> list[float]:
    """The call timed by the device's clock (the CPU's host clock), one call per interval, by the repeat rule."""
    timer, t0, samples = CallTimer(dev), time.perf_counter(), []
    while not _enough(samples, repeats, time.perf_counter() - t0):
        timer(row, call)
        timer.collect()
        samples = timer.samples[0]
    return samples


def kernel_samples(dev, call, repeats: int, batch: int = 10) -> list[float]:
    """The call's kernels (ms) per call, by the repeat rule: batches of calls under the profiler, each call in a
    range of its own after an L2 flush outside it (module docstring)."""
    flush = torch.empty(max(2 * (dev.cache_bytes() or 0), 64 * 2**20) // 4, device=dev.torch)
    t0, samples = time.perf_counter(), []
    while not _enough(samples, repeats, time.perf_counter() - t0):
        ranges = {f"attnprof::replay call {i}": i for i in range(max(batch, repeats))}
        with traced(dev, memory=False, shapes=False) as prof:
            for name in ranges:
                flush.zero_()
                with torch.profiler.record_function(name):
                    call()
        windows = call_samples(events(prof), ranges)
        samples += [windows[i][0]["gpu_time_ms"] or 0.0 for i in sorted(windows)]
    del flush
    return samples


def output_of(shape: dict, spec: CellSpec) -> torch.Tensor:
    """One call of the shape under the spec's backend, on the random Q, K, V that measure_shape times (seeded: the
    same values in every dtype, rounded to it): its output (B, Tq, C), float, on the CPU. attnprof tune holds each
    backend's to that of the reference backend in float32 (the reference's spec) with its dtype's tolerance."""
    dev = devices.get(spec.device)
    with dev.guard(), torch.no_grad():
        attn, hidden, context = _attention(shape, spec.dtype, dev.torch)
        return backends.make_processor(spec.backend, **spec.options)(attn, hidden, context).float().cpu()


def _enough(samples: list[float], repeats: int, timed_s: float) -> bool:
    """The repeat rule: at least `repeats` samples, then more until their IQR is within 10% of their median, or
    5 x repeats samples, or MAX_S seconds of timing."""
    if len(samples) < repeats:
        return False
    return not summarize(samples)["noisy"] or len(samples) >= 5 * repeats or timed_s >= MAX_S


def targets_of_plan(model: str, sizes, batch: int, dtype: str) -> list[tuple[dict, list[dict], dict]]:
    """(the shape of a forward: model, width, height, batch, dtype; its calls' rows; no in-model times) per size."""
    from ..planner import plan

    return [({"model": model, "width": w, "height": h, "batch": batch, "dtype": dtype},
             plan(model, w, h, batch, dtype)["blocks"], {}) for w, h in sizes]


def targets_of_run(cells: pd.DataFrame, blocks: pd.DataFrame) -> list[tuple[dict, list[dict], dict]]:
    """Per forward shape of the run's ok cells: its calls' rows, and the calls' times inside the model by backend
    label and block ({(label, block): time_ms})."""
    ok = cells[cells["status"] == "ok"]
    keys = ["model", "width", "height", "batch", "dtype"]
    out = []
    for key, group in ok.groupby(keys, sort=False):
        rows = blocks[blocks["cell_id"] == group["cell_id"].iloc[0]].sort_values("call_index").to_dict("records")
        mine = blocks[blocks["cell_id"].isin(group["cell_id"])]
        in_model = {(backends.label(b, o), blk): t for b, o, blk, t in
                    zip(mine["backend"], mine["backend_options"], mine["block"], mine["time_ms"])}
        target = dict(zip(keys, key))
        target.update({k: int(target[k]) for k in ("width", "height", "batch")})  # numpy ints would change cell ids
        out.append((target, rows, in_model))
    return out


def shape_of(row: dict) -> tuple:
    """A call's shape: what its kernel's cost depends on."""
    return tuple(row[k] for k in SHAPE)


def replay(targets, chosen: list[tuple[str, dict]], device: str, repeats: int, warmup: int, out, command: str,
           source: str, say=lambda line: None, measured: dict | None = None, manifest: dict | None = None):
    """Measure each target's distinct shapes under each backend (name, options) and store them as a run (returned):
    a cell per target and backend, a block row per call. measured: shape figures measured already, by (backend,
    options, dtype, device, shape) (attnprof tune's, in rounds); manifest: what the run's manifest adds."""
    from ..env import environment
    from ..store import Run, now

    specs = [CellSpec(t["model"], t["width"], t["height"], t["batch"], t["dtype"], name, device,
                      tuple(sorted(opts.items()))) for t, _, _ in targets for name, opts in chosen]
    dtypes = sorted({s.dtype for s in specs})
    limits = device_limits(device, dtypes)
    settings = {"models": sorted({s.model for s in specs}), "sizes": sorted({s.size for s in specs}),
                "batch": sorted({s.batch for s in specs}), "dtypes": dtypes,
                "backends": [[n, o] for n, o in chosen], "repeats": repeats, "warmup": warmup, "device": device,
                "source": source}
    run = Run.create(out, {"command": command, "replay": settings, "cells": [s.as_row() for s in specs],
                           "environment": {**environment(device), "executor": "replay"}, **limits, **(manifest or {})})
    measured = {} if measured is None else measured  # shape figures by (backend, options, dtype, device, shape):
    # each distinct shape measured once
    for (_, rows, in_model), spec in zip([t for t in targets for _ in chosen], specs):
        say(f"{spec.model} {spec.size} b{spec.batch} {spec.dtype} {_label(spec)}")
        run.record(*_replay_cell(spec, rows, in_model, repeats, warmup, measured, cell_peaks(limits, spec.dtype)))
    run.update_manifest(ended_at=now(), interrupted=False)
    run.compact()
    return run


def _label(spec: CellSpec) -> str:
    return backends.label(spec.backend, spec.as_row()["backend_options"])


def _replay_cell(spec, rows, in_model, repeats, warmup, measured: dict, peaks: dict) -> tuple[dict, list[dict]]:
    from .cell import _describe, failed_cell

    started, dev, label = time.time(), devices.get(spec.device), _label(spec)
    ok, reason = backends.availability(spec.backend, spec.device, spec.dtype, tuple({r["head_dim"] for r in rows}))
    if not ok:
        return failed_cell(spec, "unavailable", reason), []
    blocks = []
    roof = roof_of(peaks)
    try:
        for row in rows:
            key = (spec.backend, spec.backend_options, spec.dtype, spec.device, shape_of(row))
            if key not in measured:
                measured[key] = measure_shape({**dict(zip(SHAPE, key[-1])), "block": row["block"]}, spec, repeats,
                                              warmup)
            blocks.append(block_of(spec, row, measured[key], in_model.get((label, row["block"])), roof))
    except Exception as e:  # a shape that fails fails its cell, as a measured cell would
        oom = devices.oom_message(e)
        dev.release()
        return failed_cell(spec, "oom" if oom else "error", oom or _describe(e), **dev.identity()), []
    return cell_of(spec, blocks, peaks, started), blocks


def block_of(spec: CellSpec, row: dict, figures: dict, inside: float | None, roof: tuple) -> dict:
    """One call's row of a replay: its shape (a plan's or a run's row), its shape's figures (measure_shape's), its
    memory model (its transient over Q, K and V, which exist before the call here) and place on the roofline, and
    beside it the same call's time inside the model (inside: a run's; None for a plan's) and the gap. A processor
    map's (attnprof tune): each call its block's backend's models."""
    base = {k: row[k] for k in ("call_index", "block", "stage", "level", "kind", "batch", "heads", "head_dim",
                                "tokens_q", "tokens_k", "score_elements", "score_bytes", "flops", "upcast")}
    modelled = {**base, "sdpa_kernel": figures["sdpa_kernel"], "device": spec.device}
    moved = bytes_moved(spec.backend, modelled, spec.dtype, **spec.options)
    qkv = (base["tokens_q"] + 2 * base["tokens_k"]) * base["batch"] * base["heads"] * base["head_dim"] * \
        torch_dtype(spec.dtype).itemsize  # held before the call here, allocated by it inside the model
    return {**spec.as_row(), **base, **figures,
            "predicted_peak_bytes": predicted_peak_bytes(spec.backend, modelled, spec.dtype, **spec.options) - qkv,
            "bytes_moved": moved, **place(row["flops"], moved, figures["time_ms"], *roof,
                                          working=working_set(spec.backend, modelled, spec.dtype, **spec.options)),
            "in_model_time_ms": inside, "gap_ms": None if inside is None else inside - figures["time_ms"],
            "status": "ok"}


def cell_of(spec: CellSpec, blocks: list[dict], peaks: dict, started: float) -> dict:
    """A replay's cell row from its calls' rows: their attention summed (each shape's median), the device's limits
    (peaks), where it ran."""
    from .cell import attention_summary

    dev = devices.get(spec.device)
    return {**spec.as_row(), **facts_of(spec.model), "status": "ok", "error": "",
            **attention_summary(blocks, roof_of(peaks), per_forward=False),
            "noisy": any(b["noisy"] for b in blocks), "shapes": len({shape_of(b) for b in blocks}),
            "time_source": "cupti" if dev.kernel_clock else "host clock",  # each shape's kernels, or its host time
            **peaks, **dev.identity(), "torch_threads": torch.get_num_threads(), "wall_s": time.time() - started}


def replay_command(run, model, size, batch, dtype, backend, option, device, repeats, warmup, results, out,
                   quiet):
    """attnprof replay: a run's ok cells (RUN, under results; its backends) or a plan (model, size; sdpa), replayed
    with each --backend where given; the replay's run."""
    import json
    from pathlib import Path

    from ..fmt import progress, typed
    from ..spec import InputError, parse_options
    from ..store import find_run
    from ..unet import models

    if (run is None) == (model is None):
        raise InputError("replay takes a run (RUN) or a plan (--model M --size WxH), one of the two")
    if repeats < 1 or warmup < 0:
        raise InputError("--repeats must be 1 or more and --warmup 0 or more")
    device = devices.resolve(devices.parse(device, "--device"))
    options = parse_options(option)
    if run is not None:
        if size or batch or dtype:
            raise InputError("--size, --batch and --dtype go with --model: a run's cells give them")
        found = find_run(results, run)
        if not found.kind.named:
            raise InputError(f"run {found.id} is a {found.kind.name} run ({found.kind.what}): its models are not "
                             "named configs to rebuild; replay a run of attnprof run or sweep, or --model and --size")
        targets = targets_of_run(*found.read())
        if not targets:
            raise InputError(f"run {found.id} has no ok cell to replay: give another run, or --model and --size")
        ok = found.cells().query("status == 'ok'")
        chosen = [(b, json.loads(o)) for b, o in dict.fromkeys(zip(ok["backend"], ok["backend_options"]))]
        source = f"run {found.id}"
    else:
        models.resolve(model)
        targets = targets_of_plan(model, *devices.given_shape(size, batch or "1", dtype, device, say=True))
        chosen, source = [("sdpa", {})], f"a plan of {model}"
    if backend:
        chosen = [(name, backends.check_options(name, options)) for name in backend]
    return replay(targets, [(n, backends.check_options(n, o)) for n, o in chosen], device, repeats, warmup,
                  Path(out), typed(), source, progress("replay", quiet))
