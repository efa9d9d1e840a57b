"""The command of make gpu-check (python -m profiler.gpu_check): its arguments, the one line where there is no CUDA to
check, and main: the plan first, then every step within the budget (steps.py), the evidence written as it comes into
the five files at the top of --out (report.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from ..attention import backends
from .. import devices
from ..env import REPO, environment
from ..store import write_text
from .report import RECORD, Out, add_record, closing, device_facts, header
from .steps import Budget, Stops, plan_lines, run_steps
from .verdicts import NATIVE, Context

DEFAULT_BUDGET_S = 300.0


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
