"""make gpu-check: the GPU path proven in one command (under 8 minutes on one H200-class GPU).

1. The GPU checks (the same functions `pytest -m gpu` runs, in tests/test_gpu.py), each PASS / FAIL / SKIP with
   its figure: random and folder builds on cuda (and cuda:1 where there is one), the naive backend's allocator peak
   against its memory model, CUDA-event time against a synchronized wall clock, kernels credited to the call that
   launched them, NVML against the allocator, a provoked OOM followed by a cell that runs, reserved >= allocated
   per cell, and a sweep's parent that holds no CUDA context.
2. configs/sweeps/default.yaml at 512, 768 and 1024 (SD 1.5 and SDXL base, every backend, fp16), through workers.
3. docs/gpu-validation.md: the machine, each check with its figure, and the backends' table.

On a machine without CUDA it says so in one line and exits 0, writing nothing. `--device cpu` runs the same flow on
the CPU (every check SKIP, small sweep) to try the script; give --report to write its report somewhere else.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from . import backends, devices, models
from .fmt import human_bytes, table
from .store import REPO, Run, environment
from .execute.grid import Sweep, load
from .execute.sweep import execute

REPORT = REPO / "docs" / "gpu-validation.md"
FUSED_PATTERNS = {"sdpa-flash": r"flash", "sdpa-efficient": r"fmha|efficient|mem_eff", "sdpa-cudnn": r"cudnn",
                  "xformers": r"fmha|cutlass|xformers", "flash-attn": r"flash"}


class Skip(Exception):
    """A check that cannot run here, with the reason; never reported as PASS."""


@dataclass
class Context:
    device: str = "cuda"
    out: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="attnprof-gpu-")))
    cells: list[pd.DataFrame] = field(default_factory=list)  # every cell the checks ran, for the per-cell checks

    def need_cuda(self) -> None:
        if not self.device.startswith("cuda") or not torch.cuda.is_available():
            raise Skip(f"needs a CUDA device (here: {self.device})")

    def run(self, model: str, sizes, backends_, force=False, workers=False, repeats=3, warmup=1,
            **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
        sweep = Sweep(models=(model,), sizes=tuple((s, s) for s in sizes), dtypes=("float16",),
                      backends=tuple((b, ()) for b in backends_), device=self.device, repeats=repeats, warmup=warmup,
                      out=str(self.out), **kw)
        run = Run.open(execute(sweep, workers=workers, force=force, progress=False, command="gpu-check").run_path)
        self.cells.append(run.cells())
        return run.read()


def _ok(cells: pd.DataFrame) -> None:
    bad = cells[cells["status"] != "ok"]
    assert not len(bad), "; ".join(f"{r.backend} {r.width}: {r.status} {r.error}" for r in bad.itertuples())


# ---- the checks: each returns its figure, raises Skip, or fails an assert

def check_random_build_on_cuda(ctx: Context) -> str:
    ctx.need_cuda()
    t0 = time.perf_counter()
    unet = models.build("sd15", weights="random", device="cuda", dtype="float16")
    seconds = time.perf_counter() - t0
    placed = {p.device for p in unet.parameters()}
    assert placed == {torch.device("cuda", 0)}, placed
    assert all(torch.isfinite(p).all() for p in unet.parameters())
    n = sum(p.numel() for p in unet.parameters())
    del unet
    torch.cuda.empty_cache()
    return f"sd15 ({n / 1e6:.2f}M parameters) built with random weights on cuda:0 in {seconds:.1f} s"


def check_cuda1_is_measured_on_cuda1(ctx: Context) -> str:
    ctx.need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"one CUDA device here ({torch.cuda.get_device_name(0)}): cuda:1 needs a second")
    before = torch.cuda.memory_allocated(0)
    cells, blocks = replace(ctx, device="cuda:1").run("tiny-sd15", [512], ["naive"], repeats=2)
    _ok(cells)
    assert torch.cuda.memory_allocated(0) == before, "cuda:0's allocator moved while cuda:1 was measured"
    c = cells.iloc[0]
    assert c["device"] == "cuda:1" and c["attention_peak_mem_bytes"] > 0 and blocks["time_ms"].gt(0).all()
    return f"naive on cuda:1: attention peak {human_bytes(c['attention_peak_mem_bytes'])}, cuda:0 untouched"


def check_folder_build_on_cuda(ctx: Context) -> str:
    ctx.need_cuda()
    from .measure.cell import ModelCache

    saved = models.build("tiny-sd15", weights="random", dtype="float32", seed=7)
    folder = ctx.out / "ckpt"
    saved.save_pretrained(folder / "unet", safe_serialization=True)
    _, unet = ModelCache().get(str(folder), "float16", "cuda")
    for (name, p), (_, q) in zip(unet.named_parameters(), saved.named_parameters(), strict=True):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), q.half()), name
    return f"a saved diffusers folder loaded on cuda with its weights ({len(list(unet.parameters()))} tensors equal)"


def check_naive_peak_within_5_percent(ctx: Context) -> str:
    ctx.need_cuda()
    cells, blocks = ctx.run("sd15", [512], ["naive"])
    _ok(cells)
    big = blocks[blocks["score_bytes"] >= blocks["score_bytes"].max() / 16]  # where the score table dominates
    ratio = big["peak_mem_bytes"] / big["predicted_peak_bytes"]
    assert ratio.between(0.95, 1.05).all(), ratio.round(3).tolist()
    return (f"sd15 512x512 fp16: measured/predicted {ratio.min():.3f}..{ratio.max():.3f} over {len(ratio)} calls "
            f"(largest {human_bytes(big['peak_mem_bytes'].max())})")


def check_event_time_matches_wall_clock(ctx: Context) -> str:
    ctx.need_cuda()
    from .measure.probes import CallTimer
    from .recorder import Recorder
    from .measure.cell import ModelCache, measure_cell

    cache = ModelCache()
    spec = Sweep(models=("sd15",), dtypes=("float16",), device="cuda").cells()[0]  # sdpa at 512x512
    cell, _ = measure_cell(spec, cache, repeats=10, warmup=2)
    source, unet = cache.get("sd15", "float16", "cuda")
    inputs = models.example_inputs(unet, 1, 512, 512)
    dev, n = devices.get("cuda"), 10
    with torch.no_grad(), Recorder(unet, processor=lambda: backends.make_processor("sdpa"), around=CallTimer(dev)):
        unet(**inputs)
        dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            unet(**inputs)
        dev.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / n
    ratio = cell["forward_time_ms"] / wall_ms
    assert 0.9 <= ratio <= 1.1, f"events {cell['forward_time_ms']:.2f} ms, wall {wall_ms:.2f} ms"
    return f"sd15 512x512 sdpa: events {cell['forward_time_ms']:.2f} ms, wall clock {wall_ms:.2f} ms ({ratio:.3f}x)"


def check_kernels_credited_to_their_call(ctx: Context) -> str:
    """Backends alternate from one attention module to the next, so a kernel credited by timestamp to the next call
    (GPU work runs after its launch) would carry the other backend's name."""
    ctx.need_cuda()
    from .measure.probes import CallProbe, trace_windows, traced
    from .recorder import Recorder

    fused = [b for b in FUSED_PATTERNS if backends.availability(b, "cuda", "float16", (40, 80, 160))[0]]
    if not fused:
        raise Skip("no fused backend is available on this GPU")
    unet = models.build("sd15", weights="random", device="cuda", dtype="float16")
    inputs = models.example_inputs(unet, 1, 512, 512)
    groups = [[b for b in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn") if b in fused]]
    groups += [[b] for b in ("xformers", "flash-attn") if b in fused]
    dev, seen = devices.get("cuda"), {}
    for group in filter(None, groups):
        order = itertools.cycle(group)
        chosen = []

        def factory():
            chosen.append(next(order))
            return backends.make_processor(chosen[-1])

        probe = CallProbe(dev)
        with torch.no_grad(), Recorder(unet, processor=factory, around=probe) as rec, traced(dev) as prof:
            unet(**inputs)
        per_call, _ = trace_windows(prof)
        by_block = dict(zip([k.removesuffix(".processor") for k in unet.attn_processors], chosen))
        for row in rec.rows:
            backend = by_block[row["block"]]
            gpu = [k for k in per_call[row["call_index"]]["kernel"].split(",") if k and not k.startswith("aten::")]
            assert gpu, f"call {row['call_index']} ({backend}) got no GPU kernel"
            others = [FUSED_PATTERNS[b] for b in group if b != backend]
            assert all(re.search(FUSED_PATTERNS[backend], k, re.I) for k in gpu), (backend, gpu)
            assert not any(re.search(o, k, re.I) for o in others for k in gpu), (backend, gpu)
            seen.setdefault(backend, gpu[0])
    del unet
    torch.cuda.empty_cache()
    return "; ".join(f"{b}: {k}" for b, k in seen.items()) + " (each on its own call, backends alternating)"


def check_nvml_sees_at_least_the_allocator(ctx: Context) -> str:
    ctx.need_cuda()
    cells, _ = ctx.run("sd15", [768], ["sdpa"])
    _ok(cells)
    c = cells.iloc[0]
    if not str(c["nvml_status"]).startswith("ok"):
        raise Skip(f"NVML: {c['nvml_status']}")
    assert c["nvml_device_used_max_bytes"] >= c["allocator_reserved_max_bytes"], c.to_dict()
    process = c["nvml_process_used_max_bytes"]
    return (f"NVML device used {human_bytes(c['nvml_device_used_max_bytes'])} >= reserved "
            f"{human_bytes(c['allocator_reserved_max_bytes'])}; this process "
            f"{human_bytes(process) if process == process and process is not None else 'unknown (container pids)'}")


def check_provoked_oom_then_ok(ctx: Context) -> str:
    ctx.need_cuda()
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 12 * 2**30 / total), dev)  # a 12 GiB card
    try:
        cells, _ = ctx.run("sd15", [2048, 512], ["naive"], force=True, repeats=1, warmup=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    by_size = cells.set_index("width")
    assert by_size.loc[2048, "status"] == "oom", by_size.loc[2048, ["status", "error"]].tolist()
    assert "GiB" in by_size.loc[2048, "error"]
    assert by_size.loc[512, "status"] == "ok", by_size.loc[512, ["status", "error"]].tolist()
    return f"naive 2048x2048 under a 12 GiB cap: oom ({by_size.loc[2048, 'error'][:120]}); then 512x512 ok"


def check_reserved_at_least_allocated(ctx: Context) -> str:
    ctx.need_cuda()
    cells = pd.concat(ctx.cells, ignore_index=True) if ctx.cells else pd.DataFrame()
    ok = cells[cells["status"] == "ok"] if len(cells) else cells
    if not len(ok):
        raise Skip("no cell of the checks above ended ok")
    assert (ok["allocator_reserved_max_bytes"] >= ok["allocator_allocated_max_bytes"]).all()
    slack = (ok["allocator_reserved_max_bytes"] - ok["allocator_allocated_max_bytes"])
    return f"{len(ok)} cells; reserved - allocated peak {human_bytes(slack.min())}..{human_bytes(slack.max())}"


def check_sweep_parent_holds_no_context(ctx: Context) -> str:
    ctx.need_cuda()
    code = ("import json; from profiler import devices; from profiler.store import Run; "
            "from profiler.execute.grid import Sweep; from profiler.execute.sweep import execute; "
            f"s = Sweep(models=('tiny-sd15',), sizes=((256, 256),), backends=(('sdpa', ()), ('naive', ())), "
            f"repeats=1, warmup=0, device='cuda', out={str(ctx.out / 'parent')!r}); "
            "run = Run.open(execute(s, progress=False).run_path); "
            "print(json.dumps([devices.primary_context_active(0), run.cells()['status'].tolist()]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-500:]
    active, statuses = json.loads(p.stdout.strip().splitlines()[-1])
    if active is None:
        raise Skip("libcuda.so.1 cannot be asked about the primary context here")
    assert statuses == ["ok", "ok"], statuses
    assert active is False, "the sweep's parent holds a CUDA context"
    return "a sweep through workers (2 cells ok): its parent holds no CUDA context, the workers get the budget"


CHECKS = [check_random_build_on_cuda, check_cuda1_is_measured_on_cuda1, check_folder_build_on_cuda,
          check_naive_peak_within_5_percent, check_event_time_matches_wall_clock,
          check_kernels_credited_to_their_call, check_nvml_sees_at_least_the_allocator, check_provoked_oom_then_ok,
          check_reserved_at_least_allocated, check_sweep_parent_holds_no_context]


def title(check) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


def run_checks(ctx: Context, say=print) -> list[tuple[str, str, str]]:
    results, t0 = [], time.perf_counter()
    for check in CHECKS:
        try:
            verdict, figure = "PASS", check(ctx)
        except Skip as e:
            verdict, figure = "SKIP", str(e)
        except Exception as e:  # a failed check is a row of the report, and the others still run
            verdict, figure = "FAIL", f"{type(e).__name__}: {e}".strip()[:400]
        results.append((title(check), verdict, figure))
        say(f"[{time.perf_counter() - t0:5.0f} s] {verdict}  {title(check)}: {figure}")
    return results


# ---- the report

MAIN_BACKENDS = ("naive", "sliced", "split", "subquad", "sdpa")


def backend_table(cells: pd.DataFrame) -> str:
    rows = []
    order = {b: i for i, b in enumerate(backends.names())}
    cells = cells.assign(o=cells["backend"].map(order)).sort_values(["model", "width", "o"], kind="stable")
    for c in cells.to_dict("records"):
        ok = c["status"] == "ok"
        rows.append({"model": c["model"], "size": f"{c['width']}x{c['height']}", "backend": c["backend"],
                     "status": c["status"] if ok else f"{c['status']}: {str(c['error'])[:60]}",
                     "forward": f"{c['forward_time_ms']:.1f} ms" if ok else "-",
                     "attention": f"{c['attention_time_ms']:.1f} ms" if ok else "-",
                     "peak per call": human_bytes(c["attention_peak_mem_bytes"]) if ok else "-",
                     "predicted": human_bytes(c.get("predicted_peak_bytes")),
                     "kernel": str(c.get("kernel") or "")[:60] if ok else ""})
    cols = ["model", "size", "backend", "status", "forward", "attention", "peak per call", "predicted", "kernel"]
    return _markdown(rows, cols)


def _markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def report(env: dict, checks: list[tuple[str, str, str]], cells: pd.DataFrame, seconds: float, command: str,
           sweep: Sweep) -> str:
    head = [("GPU", env.get("device_name")), ("driver", env.get("driver")), ("CUDA", env.get("cuda")),
            ("torch", env.get("torch")), ("diffusers", env.get("diffusers")), ("python", env.get("python")),
            ("git", env.get("git_revision")), ("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
            ("wall time", f"{seconds / 60:.1f} min")]
    counts = {v: sum(1 for _, verdict, _ in checks if verdict == v) for v in ("PASS", "FAIL", "SKIP")}
    main = cells[cells["backend"].isin(MAIN_BACKENDS)]
    rest = cells[~cells["backend"].isin(MAIN_BACKENDS)]
    return "\n".join([
        "# GPU validation", "",
        f"Written by `{command}` (`python -m profiler.gpu_check`); every figure below is what it measured. It runs "
        "the GPU checks (`pytest -m gpu` runs the same functions, tests/test_gpu.py), then "
        f"`configs/sweeps/default.yaml` at {', '.join(str(w) for w, _ in sweep.sizes)} through workers "
        f"({', '.join(sweep.models)}; {', '.join(sweep.dtypes)}; {sweep.repeats} timed forwards per cell).", "",
        _markdown([{"": k, "value": v} for k, v in head], ["", "value"]), "",
        f"## Checks: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", "",
        _markdown([{"check": n, "result": v, "figure": f} for n, v, f in checks], ["check", "result", "figure"]), "",
        f"## Naive, chunked and SDPA backends ({', '.join(sweep.dtypes)}, batch 1)", "",
        "forward: median time per U-Net forward; attention: the sum of the calls' median times; peak per call: the "
        "largest call's allocator peak over what was held when it began; predicted: the memory model's figure.", "",
        backend_table(main) if len(main) else "(no cells)", "",
        "## The fused kernels", "",
        backend_table(rest) if len(rest) else "(no cells)", ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script")
    p.add_argument("--models", nargs="+", help="models of the sweep (default: those of default.yaml)")
    p.add_argument("--sizes", nargs="+", type=int, default=[512, 768, 1024], help="square sizes of the sweep")
    p.add_argument("--report", type=Path, default=REPORT, help=f"where to write the report (default {REPORT})")
    p.add_argument("--out", default=None, help="results folder of the sweep (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here (torch sees none): nothing to check and no report written; run "
              "make gpu-check on a GPU box")
        return 0
    t0 = time.perf_counter()
    ctx = Context(device=args.device)
    print(f"gpu-check on {args.device}: {len(CHECKS)} checks, then the default sweep at "
          f"{', '.join(map(str, args.sizes))}", flush=True)
    checks = run_checks(ctx, lambda line: print(line, flush=True))
    default = load(REPO / "configs" / "sweeps" / "default.yaml")
    sweep = replace(default, models=tuple(args.models or default.models), sizes=tuple((s, s) for s in args.sizes),
                    repeats=3, warmup=1, device=args.device, out=args.out or str(ctx.out / "sweep"),
                    dtypes=default.dtypes if args.device.startswith("cuda") else ("float32",))
    print(f"[{time.perf_counter() - t0:5.0f} s] sweep: {len(sweep.cells())} cells", flush=True)
    run = Run.open(execute(sweep, progress=True, command="gpu-check").run_path)
    text = report(environment(sweep.resolved_device()), checks, run.cells(), time.perf_counter() - t0,
                  "make gpu-check" if args.device == "cuda" else f"gpu_check --device {args.device}", sweep)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(table([{"check": n, "result": v} for n, v, _ in checks], [("check", "check"), ("result", "result")]))
    print(f"report: {args.report}  (run: {run.path}; {time.perf_counter() - t0:.0f} s)")
    return 1 if any(v == "FAIL" for _, v, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
