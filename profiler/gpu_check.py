"""make gpu-check: one script for a GPU box (under 8 minutes on one H200). SD1.5 and SDXL base in fp16 at 512 to
1024 across every available backend, then checks on the stored run:
  1. the naive backend's measured per-call peak is within 5% of its memory model;
  2. the fused backends stay far below naive (under a tenth) at the largest self-attention calls;
  3. times are positive, and stable (few calls flagged noisy);
  4. NVML's process memory agrees with the allocator's reserved memory to within the CUDA context's size.
Prints a short table and PASS / FAIL per check; exits 1 if any check fails. Try it on the CPU first:
  python -m profiler.gpu_check --device cpu --models tiny-sd15 --sizes 256 512 --dtype float32
"""
from __future__ import annotations

import argparse
import sys

from . import backends
from .fmt import human_bytes
from .report import format_run
from .store import Run
from .sweep import Sweep, execute

FUSED = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "xformers", "flash-attn")


def cuda_context_bytes() -> int | None:
    """NVML's view of this process minus what the allocator reserved: the CUDA context and kernels."""
    import torch

    try:
        import pynvml

        torch.zeros(1, device="cuda")
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        import os

        used = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                   if p.pid == os.getpid())
        return used - torch.cuda.memory_reserved() if used else None
    except Exception as e:  # no NVML here: the check says so instead of failing the script
        print(f"NVML unavailable: {e}")
        return None


def checks(run: Run, context: int | None) -> list[tuple[str, bool, str]]:
    cells, blocks = run.cells(), run.blocks()
    ok = blocks[blocks["status"] == "ok"]
    out = []
    naive = ok[ok["backend"] == "naive"]
    if len(naive):
        ratio = naive["peak_mem_bytes"] / naive["predicted_peak_bytes"]
        big = naive["score_bytes"] >= naive["score_bytes"].max() / 16  # where the score table dominates
        r = ratio[big]
        out.append(("naive peak within 5% of its model", bool(r.between(0.95, 1.05).all()),
                    f"measured/predicted {r.min():.3f}..{r.max():.3f} over {len(r)} calls"))
    for (model, w, h), group in ok.groupby(["model", "width", "height"]):
        top = group[group["score_elements"] == group["score_elements"].max()]
        base = top[top["backend"] == "naive"]["peak_mem_bytes"].min()
        fused = top[top["backend"].isin(FUSED)].groupby("backend")["peak_mem_bytes"].max()
        if len(fused) and base == base:
            worst = fused.max() / base
            out.append((f"fused below naive/10, {model} {w}x{h}", bool(worst < 0.1),
                        f"worst fused/naive {worst:.4f} ({fused.idxmax()})"))
    noisy = ok["noisy"].mean() if len(ok) else 1.0
    out.append(("times positive and stable", bool((ok["time_ms"] > 0).all() and noisy <= 0.2),
                f"min {ok['time_ms'].min():.3f} ms; {100 * noisy:.0f}% of calls noisy (IQR/median > 0.1)"))
    good = cells[cells["status"] == "ok"]
    nvml = good.get("nvml_process_used_max_bytes")
    if context is not None and nvml is not None and nvml.notna().any():
        diff = good["nvml_process_used_max_bytes"] - good["allocator_reserved_max_bytes"]
        out.append(("NVML agrees with the allocator within the context", bool(diff.between(0, 1.5 * context).all()),
                    f"NVML - reserved: {human_bytes(diff.min())}..{human_bytes(diff.max())}; "
                    f"context {human_bytes(context)}"))
    else:
        out.append(("NVML agrees with the allocator within the context", True, "skipped: NVML unavailable here"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", default=["sd15", "sdxl-base"])
    p.add_argument("--sizes", nargs="+", type=int, default=[512, 768, 1024])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--out", default="results/gpu-check")
    args = p.parse_args(argv)
    names = [n for n in backends.names() if backends.availability(n, args.device, args.dtype)[0]]
    print("available backends:", ", ".join(names), flush=True)
    sweep = Sweep(models=tuple(args.models), sizes=tuple((s, s) for s in args.sizes), dtypes=(args.dtype,),
                  backends=tuple((n, ()) for n in names), repeats=5, warmup=2, device=args.device, out=args.out)
    context = cuda_context_bytes() if args.device.startswith("cuda") else None
    run = Run.open(execute(sweep, workers=False, command="gpu-check").run_path)
    print(format_run(run))
    results = checks(run, context)
    for name, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    print(f"run: {run.path}")
    return 0 if all(passed for _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
