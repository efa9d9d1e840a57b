"""make bench: overhead ratios measured in one process (interleaved), never asserted in timed tests.

1. The recorder: a recorded forward (wrappers + per-call timer) against a plain forward of the same model and
   backend; target at most 1.05x. The probe pass's torch.profiler (allocation timeline) on the same forward, for
   reference.
2. The planner: SDXL base at 4096x4096 on the meta device, target under 2 seconds.
3. The sweep harness: a sweep's wall time against the sum of the forwards it ran (all of them: warm-up, timed,
   probe and reference); target under 1.15x for the CPU default.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from . import backends, devices, models
from .measure.probes import CallTimer, traced
from .recorder import Recorder

REPO = Path(__file__).resolve().parent.parent


def _forward_ms(unet, inputs) -> float:
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
    from .plan import plan

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-sd15")
    p.add_argument("--size", type=int, default=256, help="square image size for the recorder bench")
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--sweep", default=str(REPO / "configs" / "sweeps" / "cpu-default.yaml"))
    p.add_argument("--out", default="results/bench")
    p.add_argument("--skip-sweep", action="store_true")
    args = p.parse_args(argv)

    r = recorder_overhead(args.model, args.size, args.backend, args.rounds)
    print(f"recorder overhead, {args.model} {args.size}x{args.size} {args.backend} fp32 cpu, "
          f"median of {args.rounds} interleaved rounds:")
    print(f"  plain forward      {r['plain_ms']:9.1f} ms")
    print(f"  recorded forward   {r['recorded_ms']:9.1f} ms   ratio {r['recorder_ratio']:.3f}x  (target <= 1.05x)")
    print(f"  torch.profiler     {r['profiled_ms']:9.1f} ms   ratio {r['profiler_ratio']:.3f}x  (for reference)")
    t = planner_time()
    print(f"planner, sdxl-base 4096x4096 on the meta device: {t['plan_s']:.2f} s (target < 2 s)")
    if not args.skip_sweep:
        h = harness_overhead(Path(args.sweep), Path(args.out))
        print(f"sweep harness overhead, {args.sweep}:")
        print(f"  wall {h['wall_s']:.1f} s, forwards {h['forwards_s']:.1f} s, ratio {h['harness_ratio']:.3f}x "
              f"(target < 1.15x); cells {h['statuses']}; run {h['run']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
