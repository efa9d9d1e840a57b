"""make bench: overhead ratios measured in one process (interleaved), never asserted in timed tests.

1. The recorder: a recorded forward (wrappers + per-call timer) against a plain forward of the same model and
   backend; target at most 1.05x. The probe pass's torch.profiler (allocation timeline) on the same forward, for
   reference.
2. The planner: SDXL base at 4096x4096 on the meta device, target under 2 seconds.
3. The sweep harness: a sweep's wall time against the sum of the forwards it ran (all of them: warm-up, timed,
   probe and reference); target under 1.15x for the CPU default.
4. The store: recording a cell of 140 block rows (SDXL's calls) into an empty run and into a run that already holds
   10,000 cells; target under 20 ms at 10,000.
5. Ray: 8 equal groups of CPU cells through a local Ray with 2 CPUs; the wall time against the sum of the groups'
   own times over 2; target within 1.2x.
6. The whole-forward planner: SDXL base at 1024x1024 on fake tensors, one backend (the fake model built first)
   under 5 s; all 11 backends at one size under 15 s; attnprof fit for SDXL base, all backends, 24 GiB, under 60 s.
7. The time model (planner/timing.py): its leave-one-out error of predicted against measured attention and forward
   time over the stored runs of this machine's CPU under --results (default results), per backend: each cell
   predicted from a fit to the others.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from .attention import backends
from . import devices
from .unet import models
from .env import configs
from .measure.probes import CallTimer, traced
from .attention.recorder import Recorder


def _forward_ms(unet, inputs) -> float:
    """One forward's milliseconds, timed as a cell's are (measure/rows.without_collection)."""
    from .measure.rows import without_collection

    with without_collection():
        t0 = time.perf_counter()
        unet(**inputs)
        return (time.perf_counter() - t0) * 1e3


def recorder_overhead(model: str, size: int, backend: str, rounds: int) -> dict:
    unet = models.build(model, weights="random", dtype="float32")
    inputs = models.example_inputs(unet, 1, size, size)
    factory = lambda: backends.make_processor(backend)  # noqa: E731
    unet.set_attn_processor({k: factory() for k in unet.attn_processors})
    plain, recorded, profiled = [], [], []
    with torch.no_grad():
        for _ in range(2):  # warm-up
            _forward_ms(unet, inputs)
        for _ in range(rounds):  # interleaved: each round runs all three once
            plain.append(_forward_ms(unet, inputs))
            with Recorder(unet, processor=factory, around=CallTimer(devices.get("cpu"))):
                recorded.append(_forward_ms(unet, inputs))
            with traced(devices.get("cpu")):  # the probe pass's profiler: allocation timeline and shapes
                profiled.append(_forward_ms(unet, inputs))
    med = statistics.median
    return {"plain_ms": med(plain), "recorded_ms": med(recorded), "profiled_ms": med(profiled),
            "recorder_ratio": med(recorded) / med(plain), "profiler_ratio": med(profiled) / med(plain)}


def planner_time(model: str = "sdxl-base", size: int = 4096, rounds: int = 3) -> dict:
    """Seconds to plan one size on the meta device (after one warm-up plan: imports and caches excluded)."""
    from .planner import plan

    plan(model, 1024, 1024)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan(model, size, size)
        times.append(time.perf_counter() - t0)
    return {"plan_s": statistics.median(times)}


def harness_overhead(config: Path, out: Path) -> dict:
    from .store import Run
    from .execute.grid import load, with_overrides
    from .execute.sweep import execute

    t0 = time.perf_counter()
    outcome = execute(with_overrides(load(config), out=str(out)), progress=False, command="bench")
    wall = time.perf_counter() - t0
    cells = Run.open(outcome.run_path).cells()
    forwards = float(cells["forwards_total_s"].fillna(0).sum())
    return {"wall_s": wall, "forwards_s": forwards, "harness_ratio": wall / forwards,
            "statuses": cells["status"].value_counts().to_dict(), "run": str(outcome.run_path)}


def _cell_rows(cid: str, calls: int = 140) -> tuple[dict, list[dict]]:
    """A cell row and its block rows shaped as a measured SDXL cell's (the columns, not the values)."""
    from .spec import CellSpec

    spec = CellSpec("sdxl-base", 1024, 1024, 1, "float16", "sdpa", "cuda").as_row()
    cell = {**spec, "cell_id": cid, "status": "ok", "error": "", "forward_time_ms": 100.0,
            "forward_time_samples_ms": [100.0, 101.0, 99.0], **{f"figure_{i}": float(i) for i in range(30)}}
    blocks = [{**spec, "cell_id": cid, "call_index": i, "block": f"up_blocks.0.attentions.{i % 3}.attn1",
               "stage": "up", "level": 1, "kind": "self", "heads": 10, "head_dim": 64, "tokens_q": 4096,
               "tokens_k": 4096, "time_ms": 1.0, "time_samples_ms": [1.0, 1.1, 0.9], "peak_mem_bytes": 2**20,
               "kernel": "aten::_scaled_dot_product_flash_attention", "status": "ok"} for i in range(calls)]
    return cell, blocks


def forward_planner(model: str = "sdxl-base") -> dict:
    """Seconds for the whole-forward plan of one backend (fake model included), of all backends, and for a fit."""
    from .planner.fit import fit
    from .planner.forward import fake_part, trace

    fake_part.cache_clear()
    t0 = time.perf_counter()
    trace(model, 1024, 1024, 1, "float16", "cuda", ["sdpa"])
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    trace(model, 1024, 1024, 1, "float16", "cuda")
    every = time.perf_counter() - t0
    t0 = time.perf_counter()
    f = fit(model, 24 * 2**30)
    return {"one_s": one, "every_s": every, "fit_s": time.perf_counter() - t0, "fit_traced": len(f["sizes_traced"])}


def store_record_ms(out: Path, held: int = 10_000, rounds: int = 20) -> dict:
    """Median ms to record one 140-call cell into an empty run and into one already holding `held` cells."""
    import shutil

    from .store import Run

    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for label, n in (("empty", 0), ("full", held)):
        run = Run.create(out, {"command": "bench", "cells": []})
        if n:
            run.record(*_cell_rows("seed"))
            cell_file = run.path / "cells" / "seed.parquet"
            blocks_file = next((run.path / "blocks").glob("seed.*.parquet"))
            for i in range(n - 1):  # the same files under other cells' names
                shutil.copyfile(cell_file, run.path / "cells" / f"held{i:05d}.parquet")
                shutil.copyfile(blocks_file, run.path / "blocks" / f"held{i:05d}.{blocks_file.name.split('.')[1]}"
                                                                   f".parquet")
        times = []
        for i in range(rounds):
            cell, blocks = _cell_rows(f"new{i:03d}")
            t0 = time.perf_counter()
            run.record(cell, blocks)
            times.append((time.perf_counter() - t0) * 1e3)
        result[label] = statistics.median(times)
        shutil.rmtree(run.path)
    return result


def ray_scaling(out: Path, groups: int = 8, workers: int = 2) -> dict:
    """8 equal groups (tiny-sd15, fp32, on the CPU) as Ray tasks of one CPU each on a local Ray with 2 CPUs."""
    import ray

    from .execute.grid import Sweep
    from .execute.ray import connect, run_chunks
    from .execute.sweep import InFlight, _progress
    from .store import Run

    sweep = Sweep(models=("tiny-sd15",), sizes=((192, 192), (256, 256)), dtypes=("float32",), device="cpu",
                  repeats=3, warmup=1, out=str(out))
    chunks = [[replace(c, backend_options=(("budget_bytes", 2**26 + g),)) for c in sweep.cells()]
              for g in range(groups)]  # equal work, distinct cells: split with budgets that never bind here
    chunks = [[replace(c, backend="split") for c in chunk] for chunk in chunks]
    connect(num_cpus=workers)
    try:
        run = Run.create(out, {"command": "bench", "cells": []})
        t0 = time.perf_counter()
        seconds = run_chunks(chunks, run, sweep, InFlight(run, _progress(groups * 2, 0, False)))
        wall = time.perf_counter() - t0
        statuses = run.cells()["status"].value_counts().to_dict()
    finally:
        ray.shutdown()
    ideal = sum(seconds) / workers
    return {"wall_s": wall, "groups_s": seconds, "ideal_s": ideal, "ratio": wall / ideal, "statuses": statuses}


def profile_overhead(rounds: int, steps: int = 10, size: int = 256) -> dict:
    """profiler.profile around a generation of docs/examples/generate.py's tiny SD 1.5 pipeline, against the same
    generation plain: wall times interleaved (plain, profiled) over rounds, their medians."""
    import importlib.util

    from .env import REPO
    from .record.session import profile

    spec = importlib.util.spec_from_file_location("generate", REPO / "docs" / "examples" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    pipe = gen.tiny_pipeline()

    def once(profiled: bool) -> float:
        t0 = time.perf_counter()
        if profiled:
            with profile(pipe, out=None):
                gen.generate(pipe, steps, size)
        else:
            gen.generate(pipe, steps, size)
        return (time.perf_counter() - t0) * 1e3

    plain, profiled = [], []
    for _ in range(2):  # warm-up
        once(False)
        once(True)
    for _ in range(rounds):
        plain.append(once(False))
        profiled.append(once(True))
    with profile(pipe, out=None) as prof:
        gen.generate(pipe, steps, size)
    med = statistics.median
    return {"plain_ms": med(plain), "profiled_ms": med(profiled), "ratio": med(profiled) / med(plain),
            "steps": steps, "size": size, "calls": len(prof.calls),
            "per_call_us": (med(profiled) - med(plain)) * 1e3 / max(1, len(prof.calls))}


def _print_recorder(args) -> None:
    r = recorder_overhead(args.model, args.size, args.backend, args.rounds)
    print(f"recorder overhead, {args.model} {args.size}x{args.size} {args.backend} fp32 cpu, "
          f"median of {args.rounds} interleaved rounds:")
    print(f"  plain forward      {r['plain_ms']:9.1f} ms")
    print(f"  recorded forward   {r['recorded_ms']:9.1f} ms   ratio {r['recorder_ratio']:.3f}x  (target <= 1.05x)")
    print(f"  torch.profiler     {r['profiled_ms']:9.1f} ms   ratio {r['profiler_ratio']:.3f}x  (for reference)")


def _print_profile(rounds: int) -> None:
    r = profile_overhead(rounds)
    print(f"profile overhead, a generation of docs/examples/generate.py's tiny SD 1.5 pipeline ({r['steps']} steps, "
          f"{r['size']}x{r['size']}, fp32 cpu, {r['calls']} attention calls), median of {rounds} interleaved "
          "rounds:")
    print(f"  plain generation   {r['plain_ms']:9.1f} ms")
    print(f"  profiled           {r['profiled_ms']:9.1f} ms   ratio {r['ratio']:.3f}x  (target <= 1.05x); "
          f"{r['per_call_us']:.0f} us more per attention call")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-sd15")
    p.add_argument("--size", type=int, default=256, help="square image size for the recorder bench")
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--sweep", default=str(configs() / "sweeps" / "cpu-default.yaml"))
    p.add_argument("--out", default="results/bench")
    p.add_argument("--only", nargs="+", choices=["recorder", "profile", "planner", "forward", "store", "ray", "sweep",
                                                 "time", "generation", "published"],
                   help="run only these benches (default: all)")
    p.add_argument("--validate", nargs=2, metavar=("CALIBRATION", "HELD_OUT"),
                   help="with generation: calibrate on the runs under CALIBRATION and predict each recorded "
                        "generation under HELD_OUT")
    p.add_argument("--results", default="results", help="for the time model: the stored runs it is judged on")
    args = p.parse_args(argv)

    run = set(args.only or ["recorder", "profile", "planner", "forward", "store", "ray", "sweep", "time",
                            "generation", "published"])
    if "published" in run:
        print(published_timings())
    if "time" in run:
        print(time_model_error(Path(args.results)))
    if "generation" in run:
        print(held_out(*map(Path, args.validate)) if args.validate else generation_error(Path(args.results)))
    if run & {"recorder", "profile", "store", "ray", "sweep"}:
        devices.keep_memory()  # these time cells as our processes do (devices.keep_memory)
    if "recorder" in run:
        _print_recorder(args)
    if "profile" in run:
        _print_profile(min(args.rounds, 7))  # a generation takes seconds here
    if "planner" in run:
        t = planner_time()
        print(f"planner, sdxl-base 4096x4096 on the meta device: {t['plan_s']:.2f} s (target < 2 s)")
    if "forward" in run:
        r = forward_planner()
        print(f"whole-forward planner, sdxl-base 1024x1024 on fake tensors: one backend {r['one_s']:.2f} s (fake "
              f"model built first; target < 5 s), all 11 backends {r['every_s']:.2f} s (target < 15 s); attnprof "
              f"fit, all backends, 24 GiB: {r['fit_s']:.1f} s, {r['fit_traced']} sizes traced (target < 60 s)")
    if "store" in run:
        r = store_record_ms(Path(args.out) / "store")
        print(f"store: recording a cell of 140 block rows: {r['empty']:.1f} ms into an empty run, {r['full']:.1f} ms "
              f"into a run holding 10,000 cells (target < 20 ms)")
    if "ray" in run:
        r = ray_scaling(Path(args.out) / "ray")
        print(f"ray: 8 equal CPU groups on a local Ray with 2 CPUs: wall {r['wall_s']:.1f} s, groups "
              f"{sum(r['groups_s']):.1f} s in all ({min(r['groups_s']):.1f}..{max(r['groups_s']):.1f} s each), "
              f"ratio {r['ratio']:.3f}x of their sum / 2 (target <= 1.2x); cells {r['statuses']}")
    if "sweep" in run:
        h = harness_overhead(Path(args.sweep), Path(args.out))
        print(f"sweep harness overhead, {args.sweep}:")
        print(f"  wall {h['wall_s']:.1f} s, forwards {h['forwards_s']:.1f} s, ratio {h['harness_ratio']:.3f}x "
              f"(target < 1.15x); cells {h['statuses']}; run {h['run']}")
    return 0


def time_model_error(results: Path) -> str:
    """The time model's leave-one-out error per backend over this CPU's stored runs under results."""
    from .measure.limits import device_key
    from .planner.calibration import calibrate

    c = calibrate(results, device_key("cpu", kept=True), write=False) if results.is_dir() else None
    if not c:
        return f"time model: no stored runs of this CPU under {results} to judge it on"
    from .planner.timing import passed_text

    lines = [f"time model, leave-one-out over {len(c['runs'])} runs of this CPU under {results} (each cell predicted "
             f"from a fit to the others; mean |predicted - measured| / measured){passed_text(c.get('passed_over'))}:"]
    for group, f in c["backends"].items():
        att, fwd = f["loo_error_pct"], f["loo_forward_error_pct"]
        lines.append(f"  {group:24s} {f['cells']:3d} cells  attention {'-' if att is None else f'{att:.1f}%':>7s}  "
                     f"forward {'-' if fwd is None else f'{fwd:.1f}%':>7s}")
    return "\n".join(lines)


def published_timings() -> str:
    """Each published timing (planner/published.py's rows) beside the time model's prediction, each row saying
    whether it was used to fit, the same row predicted with its GPU's rows left out of the fit and its range, the
    fit's shares and hosts."""
    from .planner.published import check, format_check

    return format_check(check())


def recorded_generations(results: Path) -> list[tuple[dict, object]]:
    """(cell, GenerationSpec) of every ok recorded generation of this CPU under results whose pipeline the planner
    knows."""
    from .measure.limits import device_key
    from .planner.generation import generation_spec
    from .store import kind_of, readable_runs

    found, key = [], device_key("cpu", kept=False)  # a user's own process: attnprof record's
    for run, manifest in readable_runs(results):
        if kind_of(manifest).name != "record" or (manifest.get("device_limits") or {}).get("key") != key:
            continue
        table, _ = run.read()
        for cell in table[table["status"] == "ok"].to_dict("records"):
            spec = generation_spec(run, manifest, cell)
            if spec:
                found.append(({**cell, "run": run.id}, spec))
    return found


def _predicted_ms(spec, c: dict) -> float:
    from .planner.generation import predict_generation

    return predict_generation(spec, c["limits"], c, None, "cpu")["total_ms"]


def _error_lines(pairs: list[tuple[str, float, float]]) -> list[str]:
    """Per backend: the mean |predicted - measured| / measured over (backend, predicted, measured)."""
    import numpy as np

    out = []
    for backend in sorted({b for b, _, _ in pairs}):
        errs = [100 * (p - m) / m for b, p, m in pairs if b == backend]
        out.append(f"  {backend:10s} {len(errs):3d} generations  mean |error| {np.mean(np.abs(errs)):5.1f}%  "
                   f"(each: {', '.join(f'{e:+.0f}%' for e in errs)})")
    return out


def generation_error(results: Path) -> str:
    """The whole-generation model's held-out error over this CPU's recorded generations under results: each
    generation predicted from a calibration on the stored runs less every cell of its size (leave-one-size-out) or
    of its step count (leave-one-steps-out), per backend."""
    from .measure.limits import device_key
    from .planner.calibration import calibrate

    found = recorded_generations(results)
    if not found:
        return f"generation time: no recorded generation of this CPU under {results} to judge it on (attnprof record)"
    lines = [f"generation time, held out over {len(found)} recorded generations of this CPU under {results} (mean "
             "|predicted - measured| / measured):"]
    for what, of in (("size", lambda c: (c["width"], c["height"])), ("steps", lambda c: c.get("steps"))):
        pairs = []
        for value in sorted({of(c) for c, _ in found}, key=str):
            c = calibrate(results, device_key("cpu", kept=False), write=False, keep=lambda cell, v=value: of(cell) != v)
            for cell, spec in found if c else []:
                if of(cell) == value and spec.backend in {g.split(" ")[0] for g in c["backends"]}:
                    pairs.append((spec.backend, _predicted_ms(spec, c), cell["generation_s"] * 1e3))
        lines += [f"leave-one-{what}-out:"] + (_error_lines(pairs) or ["  - (one value only)"])
    return "\n".join(lines)


def held_out(calibration_runs: Path, held: Path) -> str:
    """Each recorded generation under held predicted from a calibration on the runs under calibration_runs."""
    from .measure.limits import device_key
    from .planner.calibration import calibrate

    c = calibrate(calibration_runs, device_key("cpu", kept=False), write=False)
    found = recorded_generations(held)
    if not c or not found:
        return f"generation time: nothing to calibrate on under {calibration_runs} or to predict under {held}"
    lines = [f"generation time, calibrated on {len(c['runs'])} runs under {calibration_runs}, predicting the "
             f"{len(found)} recorded generations under {held} (predicted / measured):"]
    pairs = []
    for cell, spec in found:
        p, m = _predicted_ms(spec, c), cell["generation_s"] * 1e3
        pairs.append((spec.backend, p, m))
        lines.append(f"  {spec.backend:8s} {spec.width}x{spec.height} {spec.steps} steps: {p:8.0f} ms / {m:8.0f} ms "
                     f"({100 * (p - m) / m:+.0f}%)")
    return "\n".join(lines + _error_lines(pairs))


if __name__ == "__main__":
    raise SystemExit(main())
