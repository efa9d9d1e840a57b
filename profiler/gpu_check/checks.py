"""The steps of make gpu-check but the timing judges (timing_judges.py), of three kinds (the plan, plan.py, orders
them):

- a run: a sweep through worker subprocesses, each shape's cells recorded as they end (`core`: each model at its
  native size, fp16, with naive, sdpa as PyTorch picks, sdpa-cudnn and sdpa-efficient forced, its kernel-timing
  traces kept; `rest`: sdpa-flash and sdpa-math forced, the chunked backends, xformers and flash-attn where
  installed). Made in a child process of its own (child.py).
- a judge: a pure function of one run's (cells, blocks) that returns a Verdict: its figure, and evidence rows that
  each name the cells.csv / blocks.csv row and columns it rests on, with the value it read and the bound it held it
  to, PASS and FAIL alike. Judges run in the main process and touch no device.
- a model check: a function of a Context that runs a model (a build, kernels credited to their call, an OOM, a
  backend that compiles); each runs in a child process of its own. Where it measures cells, it records them as a run,
  so that its figures are in cells.csv too.

tests/test_gpu.py runs the model checks as tests (`pytest -m gpu`); steps.py runs every step within a budget."""
from __future__ import annotations

import itertools
import time
from dataclasses import replace

import torch

from ..attention import backends, kernel_choice
from .. import devices
from ..unet import models
from ..fmt import human_bytes
from ..measure.rows import TOLERANCE
from .verdicts import Context, Skip, Verdict, evidence, num, ok_cells, ratio_rows, records, said, span, what

# the SDPA kernels forced one per cell, and the kernel each must run (each record's sdpa_kernel)
FORCED = {n: backends.BACKENDS[n].sdpa_kernel for n in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")}
CORE_BACKENDS = ("naive", "sdpa", "sdpa-cudnn", "sdpa-efficient")  # the audit's N1-N12 rest on these
REST_FORCED = ("sdpa-flash", "sdpa-math")
CPU_CORE_BACKENDS = ("naive", "sdpa", "sdpa-flash", "sdpa-math")  # those a CPU runs (the dry run)
CHUNKED = ("sliced", "split", "subquad")
OPTIONAL = ("xformers", "flash-attn")  # in the rest run where installed; unavailable rows of these are no failure
# the backends of the last checks, each its own (they compile, or need an extension), each owning its GPU kernels
NEW_BACKENDS = ("flex", "sage", "diffusers:_flash_3")
PEAK_TOLERANCE = 0.05  # measured forward or call peak against the planner's / the memory model's prediction
WORKSPACES_MAX = 2**30  # what the allocator may hold beyond the model and its forward: the libraries' workspaces


def core_run(ctx: Context):
    """The core run: each shape's backends timed together, the kernel-timing trace of each cell kept (trace.save),
    one a model copied to the top of --out by the runner so that CPU tests can read a GPU's kernels again."""
    return replace(ctx.sweep(ctx.core_backends or (CORE_BACKENDS if ctx.cuda else CPU_CORE_BACKENDS)), trace="kernels")


def rest_run(ctx: Context):
    """The other SDPA kernels forced, the chunked backends, and xformers and flash-attn where their package is
    installed (found without importing them: nothing here touches the device)."""
    import importlib.util

    installed = [b for b in OPTIONAL if importlib.util.find_spec(backends.BACKENDS[b].needs.package or b)]
    return ctx.sweep((*(REST_FORCED if ctx.cuda else ()), *CHUNKED, *installed))


# ---- judges: each a function of (cells, blocks, device) of one run

def cells_ok_within_tolerance(cells, blocks, device) -> Verdict:
    """Every cell of the run ended ok (a backend of OPTIONAL may be unavailable: not installed), its output within
    the dtype's tolerance of the fp32 reference (TF32 off)."""
    if not len(cells):
        raise Skip("no cell of the run was recorded")
    rows, failed = [], []
    for r in records(cells):
        optional = r["backend"] in OPTIONAL and r["status"] == "unavailable"
        tol = TOLERANCE[r["dtype"]]
        ok = optional or (r["status"] == "ok" and (r.get("max_rel_err") or 0) <= tol)
        rows.append(evidence(r, "cells", ["status", "max_rel_err"] if r["status"] == "ok" else ["status", "error"],
                             rule=f"status ok and max_rel_err <= {tol:g}" + (" (optional backend)" if optional
                                                                            else ""), ok=ok))
        if not ok:
            failed.append(f"{what(r)}: {r['status']}" + (f" ({r.get('error')})" if r["status"] != "ok" else
                                                          f", max_rel_err {num(r.get('max_rel_err'))} > {tol:g}"))
    ok_rows = cells[cells["status"] == "ok"]
    worst = f"; worst max_rel_err {ok_rows['max_rel_err'].max():.2e}" if len(ok_rows) else ""
    counts = ", ".join(f"{n} {s}" for s, n in cells["status"].value_counts().items())
    return Verdict(f"{len(cells)} cells: {counts}{worst}", rows, failed)


def forced_kernels_ran(cells, blocks, device) -> Verdict:
    """Every call of a forced SDPA kernel (sdpa-flash, sdpa-efficient, sdpa-cudnn, sdpa-math) ran that kernel, as
    named from its GPU kernels (blocks.csv's gpu_kernels; on the CPU its aten op): one row per distinct kernel seen."""
    forced = blocks[blocks["backend"].isin(list(FORCED))] if len(blocks) else blocks
    if not len(forced):
        raise Skip("no forced SDPA kernel's cell ended ok")
    rows, failed, said_ = [], [], []
    for (cid, backend), calls in forced.groupby(["cell_id", "backend"], sort=False):
        want = FORCED[backend]
        for kernel, same in calls.groupby(calls["sdpa_kernel"].fillna("none"), sort=False):
            r = records(same.head(1))[0]
            ok = kernel == want
            rows.append(evidence(r, "blocks", ["sdpa_kernel", "gpu_kernels"] if device != "cpu" else
                                 ["sdpa_kernel", "kernel"], rule=f"every call runs {want} ({len(same)} calls so)",
                                 ok=ok))
            if not ok:
                failed.append(f"{what(r)}: {len(same)} calls ran {kernel}, not {want}")
        said_.append(f"{backend} {calls['width'].iloc[0]}: {','.join(calls['sdpa_kernel'].fillna('none').unique())}")
    return Verdict("; ".join(said_), rows, failed)


def forward_peak_matches_the_planner(cells, blocks, device) -> Verdict:
    """Every ok cell's forward peak (weights + inputs + the allocator's peak over what the forward began with; on
    the CPU the allocation trace's) within 5% of the planner's predicted_forward_peak_bytes."""
    ok = ok_cells(cells)
    rows, failed, ratios = ratio_rows(records(ok), "cells", "forward_peak_total_bytes", "predicted_forward_peak_bytes",
                                       1 - PEAK_TOLERANCE, 1 + PEAK_TOLERANCE, "within 5%")
    return Verdict(f"{len(ok)} cells, measured / predicted {span(ratios)}", rows, failed)


def sdpa_runs_the_kernel_pytorch_answers(cells, blocks, device) -> Verdict:
    """Every call of an sdpa cell ran the kernel PyTorch answers for it on the device (torch._fused_sdp_choice,
    asked in the worker: sdpa_kernel_asked); where the planner's no-GPU rule (sdpa_kernel_rule) names another, the
    figure says so: that is what a plan made without this GPU gets wrong. One row per (cell, head_dim, tokens_k)."""
    sdpa = blocks[blocks["backend"] == "sdpa"] if len(blocks) else blocks
    if not len(sdpa):
        raise Skip("no sdpa cell ended ok")
    rows, failed, seen, rule = [], [], {}, {}
    for _, calls in sdpa.groupby(["cell_id", "head_dim", "tokens_k"], sort=False):
        r = records(calls.head(1))[0]
        ran = ",".join(sorted(set(calls["sdpa_kernel"].fillna("none"))))
        ok = ran == r.get("sdpa_kernel_asked")
        rows.append(evidence(r, "blocks", "sdpa_kernel", "sdpa_kernel_asked",
                             f"the kernel PyTorch answers ({len(calls)} calls of this shape)", ok))
        seen.setdefault(f"{r['model']} head_dim {r['head_dim']}", ran)
        if not ok:
            failed.append(f"{what(r)} head_dim {r['head_dim']} tokens_k {r['tokens_k']}: ran {ran}, PyTorch "
                          f"answers {r.get('sdpa_kernel_asked')}")
        if r.get("sdpa_kernel_rule") and r["sdpa_kernel_rule"] != r.get("sdpa_kernel_asked"):
            rule[f"head_dim {r['head_dim']}"] = f"rule {r['sdpa_kernel_rule']}, torch {r.get('sdpa_kernel_asked')}"
    where = kernel_choice.gpu_target(index=torch.device(device).index or 0).describe() if device.startswith("cuda") \
        else "the CPU"
    differs = ("; the no-GPU rule differs at " + ", ".join(f"{k} ({v})" for k, v in rule.items())) if rule else \
        ("; the no-GPU rule names the same" if device.startswith("cuda") else "")
    return Verdict(f"on {where}, {len(sdpa)} calls: " + "; ".join(f"{k}: {v}" for k, v in seen.items()) + differs,
                   rows, failed)


def call_peaks_match_their_memory_models(backends_):
    """Each call of these backends where its memory matters (predicted peak at least 1/16 of the cell's largest):
    the allocator's peak over what the call began with within 5% of the backend's memory model."""
    def judge(cells, blocks, device) -> Verdict:
        calls = blocks[blocks["backend"].isin(list(backends_)) & blocks["peak_mem_bytes"].notna()] if len(blocks) \
            else blocks
        if not len(calls):
            raise Skip(f"no call of {', '.join(backends_)} with a measured peak")
        big = calls[calls["predicted_peak_bytes"] >= calls.groupby("cell_id")["predicted_peak_bytes"]
                    .transform("max") / 16]
        rows, failed, ratios = ratio_rows(records(big), "blocks", "peak_mem_bytes", "predicted_peak_bytes",
                                           1 - PEAK_TOLERANCE, 1 + PEAK_TOLERANCE, "within 5%")
        return Verdict(f"{len(big)} calls of {', '.join(sorted(set(big['backend'])))}, measured / predicted "
                       f"{span(ratios)} (largest {human_bytes(big['peak_mem_bytes'].max())})", rows, failed)

    return judge


def nvml_covers_the_allocator(cells, blocks, device) -> Verdict:
    """NVML's memory of the worker process holds the allocator's reserved memory plus what the allocator cannot see
    (the CUDA context, kernel images: what the planner lists under not_counted), under 4 GiB of it."""
    ok = ok_cells(cells)
    known = ok[ok["nvml_process_used_max_bytes"].notna()] if "nvml_process_used_max_bytes" in ok else ok.iloc[:0]
    if not len(known):
        raise Skip(f"NVML gave no process memory: {ok['nvml_status'].iloc[0] if 'nvml_status' in ok else 'none'}")
    rows, failed, outside = [], [], []
    for r in records(known):
        extra = r["nvml_process_used_max_bytes"] - r["allocator_reserved_max_bytes"]
        good = 0 <= extra < 4 * 2**30
        outside.append(extra)
        rows.append(evidence(r, "cells", "nvml_process_used_max_bytes", "allocator_reserved_max_bytes",
                             f"0 <= difference < 4 GiB (difference {human_bytes(extra)})", good))
        if not good:
            failed.append(f"{what(r)}: NVML {human_bytes(r['nvml_process_used_max_bytes'])}, reserved "
                          f"{human_bytes(r['allocator_reserved_max_bytes'])}")
    return Verdict(f"{len(known)} cells: {human_bytes(min(outside))}..{human_bytes(max(outside))} outside the "
                   "allocator (the CUDA context, kernel images)", rows, failed)


def allocator_holds_only_the_model_and_its_forward(cells, blocks, device) -> Verdict:
    """Measure the backend, not the harness: each ok cell's highest allocated memory is its model, its inputs and its
    forward's peak, plus only the workspaces the libraries keep in the allocator (cuBLAS, cuDNN): under 1 GiB. An
    fp32 reference model left beside the model under test would add twice its weights."""
    ok = ok_cells(cells)
    rows, failed, extras = [], [], []
    for r in records(ok):
        extra = r["allocator_allocated_max_bytes"] - r["forward_peak_total_bytes"]
        good = -2**20 <= extra <= WORKSPACES_MAX
        extras.append(extra)
        rows.append(evidence(r, "cells", "allocator_allocated_max_bytes", "forward_peak_total_bytes",
                             f"difference within -1 MiB..1 GiB ({human_bytes(extra)})", good))
        if not good:
            failed.append(f"{what(r)}: {human_bytes(extra)} beyond the model and its forward")
    return Verdict(f"{len(ok)} cells: the allocator held {human_bytes(min(extras))}..{human_bytes(max(extras))} "
                   "beyond the model, its inputs and its forward (the libraries' workspaces)", rows, failed)


# ---- model checks: each a function of the Context, run in a child process of its own

def random_build_on_cuda(ctx: Context) -> Verdict:
    ctx.need_cuda()
    t0 = time.perf_counter()
    unet = models.build("sd15", weights="random", device=ctx.device, dtype="float16")
    seconds = time.perf_counter() - t0
    placed = {str(p.device) for p in unet.parameters()}
    finite = all(bool(torch.isfinite(p).all()) for p in unet.parameters())
    n = sum(p.numel() for p in unet.parameters())
    want = str(torch.device(ctx.device, torch.device(ctx.device).index or 0))
    ok = placed == {want} and finite
    return Verdict(f"sd15 ({n / 1e6:.2f}M parameters) built with random weights on {want} in {seconds:.1f} s",
                   [said(f"parameters {n}; devices {sorted(placed)}; all finite {finite}; seconds {seconds:.2f}",
                         f"every parameter on {want} and finite", ok)],
                   [] if ok else [f"parameters on {sorted(placed)}, all finite: {finite}"])


def folder_build_on_cuda(ctx: Context) -> Verdict:
    ctx.need_cuda()
    from ..measure.cell import ModelCache

    saved = models.build("tiny-sd15", weights="random", dtype="float32", seed=7)
    folder = ctx.runs / "ckpt"
    saved.save_pretrained(folder / "unet", safe_serialization=True)
    _, unet = ModelCache().get(str(folder), "float16", ctx.device)
    differ = [name for (name, p), (_, q) in zip(unet.named_parameters(), saved.named_parameters(), strict=True)
              if p.device.type != "cuda" or not torch.equal(p.cpu(), q.half())]
    n = len(list(unet.parameters()))
    return Verdict(f"a saved diffusers folder loaded on {ctx.device} with its weights ({n - len(differ)} of {n} "
                   "tensors equal)", [said(f"tensors {n}; equal on cuda {n - len(differ)}", "every tensor equal",
                                           not differ)], [f"{len(differ)} tensors differ, e.g. {differ[:2]}"]
                   if differ else [])


def kernels_credited_to_their_call(ctx: Context) -> Verdict:
    """Backends alternate from one attention module to the next, so a kernel credited by timestamp to the next call
    (GPU work runs after its launch) would carry the other backend's name. Only GPU kernels (CUDA-device events)
    count, named by trace.sdpa_kernel (cuDNN's names carry "flash": never taken for flash)."""
    ctx.need_cuda()
    from ..measure.probes import CallProbe, traced
    from ..measure.trace import sdpa_kernel, trace_windows
    from ..attention.recorder import Recorder

    fused = [b for b in ["sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "xformers", "flash-attn"]
             if backends.availability(b, ctx.device, "float16", (40, 80, 160))[0]]
    if not fused:
        raise Skip("no fused backend is available on this GPU")
    unet = models.build("sd15", weights="random", device=ctx.device, dtype="float16")
    inputs = models.example_inputs(unet, 1, 512, 512)
    groups = [[b for b in fused if b in FORCED]] + [[b] for b in ("xformers", "flash-attn") if b in fused]
    dev, rows, failed = devices.get(ctx.device), [], []
    for group in filter(None, groups):
        order, chosen = itertools.cycle(group), []

        def factory():
            chosen.append(next(order))
            return backends.make_processor(chosen[-1])

        probe = CallProbe(dev)
        with torch.no_grad(), dev.guard(), Recorder(unet, processor=factory, around=probe) as rec, \
                traced(dev) as prof:
            unet(**inputs)
        per_call, _ = trace_windows(prof, probe.ranges)
        by_block = dict(zip([k.removesuffix(".processor") for k in unet.attn_processors], chosen))
        for row in rec.rows:
            backend, call = by_block[row["block"]], per_call[row["call_index"]]
            named = sdpa_kernel(call["gpu_kernels"]) if call["gpu_kernels"] else None
            want = FORCED.get(backend)
            ok = bool(call["gpu_kernels"]) and (named == want if want else named in ("flash", "efficient"))
            if not ok or row["call_index"] < len(group):
                rows.append(said(f"call {row['call_index']} {row['block']} ({backend}): "
                                 f"{','.join(call['gpu_kernels']) or 'no GPU kernel'}", f"names {want or backend}",
                                 ok))
            if not ok:
                failed.append(f"call {row['call_index']} ({backend}) ran {named or 'no attention kernel'}")
    return Verdict(f"{len(rec.rows)} calls per forward, backends alternating in {len(groups)} group(s): "
                   f"{len(failed)} credited to the wrong kernel", rows, failed)


def provoked_oom_then_ok(ctx: Context) -> Verdict:
    """tiny-sd15 (SD 1.5's block topology) with naive attention at 2048 (a 68 GB score table) under a 12 GiB cap on
    this process's allocator, then at 512: the first ends `oom` naming the size asked for, the second runs ok."""
    ctx.need_cuda()
    from ..execute.sweep import execute
    from ..store import Run

    index = torch.device(ctx.device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 12 * 2**30 / total), index)
    try:
        sweep = ctx.sweep(["naive"], pairs=[("tiny-sd15", 2048), ("tiny-sd15", 512)])
        run = Run.open(execute(replace(sweep, repeats=1, warmup=0, also=tuple(replace(g, repeats=1, warmup=0)
                                                                            for g in sweep.also)),
                               workers=False, force=True, progress=False, command="gpu-check oom").run_path)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()
    cells = {r["width"]: r for r in records(run.cells())}
    big, small = cells.get(2048, {}), cells.get(512, {})
    ok_big = big.get("status") == "oom" and "GiB" in str(big.get("error"))
    ok_small = small.get("status") == "ok"
    rows = [evidence(big, "cells", ["status", "error"], rule="oom, naming the size asked for", ok=ok_big),
            evidence(small, "cells", "status", rule="ok", ok=ok_small)]
    failed = ([] if ok_big else [f"2048: {big.get('status')} {big.get('error')}"]) + \
        ([] if ok_small else [f"512 after it: {small.get('status')} {small.get('error')}"])
    return Verdict(f"naive 2048x2048 under a 12 GiB cap: {big.get('status')} ({str(big.get('error'))[:100]}); then "
                   f"512x512 {small.get('status')}", rows, failed)


def sweep_parent_holds_no_context(ctx: Context) -> Verdict:
    """A sweep through workers (tiny-sd15 at 256, naive and sdpa) made by this process: its cells ok, and this
    process, the sweep's parent, holds no CUDA context (asked of the driver: cuDevicePrimaryCtxGetState) after its
    preflight, its availability probes and its cells, so the workers get the whole device."""
    ctx.need_cuda()
    from ..execute.sweep import execute
    from ..store import Run

    run = Run.open(execute(ctx.sweep(["sdpa", "naive"], pairs=[("tiny-sd15", 256)]), progress=False,
                           command="gpu-check parent").run_path)
    active = devices.primary_context_active(torch.device(ctx.device).index or 0)
    cells = records(run.cells())
    rows = [evidence(r, "cells", "status", rule="ok", ok=r["status"] == "ok") for r in cells]
    rows.append(said(f"primary context active in the sweep's parent: {active}", "False", active is False))
    failed = [f"{what(r)}: {r['status']} {r.get('error')}" for r in cells if r["status"] != "ok"]
    if active is None:
        raise Skip("the cells ran, but the driver cannot be asked about the primary context here")
    if active:
        failed.append("the sweep's parent holds a CUDA context")
    return Verdict(f"a sweep through workers ({len(cells)} cells): its parent holds "
                   f"{'a' if active else 'no'} CUDA context", rows, failed)


def cuda1_is_measured_on_cuda1(ctx: Context) -> Verdict:
    ctx.need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"one CUDA device here ({torch.cuda.get_device_name(0)}): cuda:1 needs a second")
    from ..execute.sweep import execute
    from ..store import Run

    before = torch.cuda.memory_allocated(0)
    one = replace(ctx, device="cuda:1")
    run = Run.open(execute(one.sweep(["naive"], pairs=[("tiny-sd15", 512)]), workers=False, progress=False,
                           command="gpu-check cuda:1").run_path)
    c = records(run.cells())[0]
    untouched = torch.cuda.memory_allocated(0) == before
    ok = c["status"] == "ok" and c["device"] == "cuda:1" and untouched
    return Verdict(f"naive on cuda:1: {c['status']}, cuda:0 {'untouched' if untouched else 'moved'}",
                   [evidence(c, "cells", ["status", "device", "attention_peak_mem_bytes"], rule="ok on cuda:1", ok=ok),
                    said(f"cuda:0 allocator untouched: {untouched}", "True", untouched)],
                   [] if ok else [f"{c['status']} on {c['device']}, cuda:0 untouched {untouched}"])


def own_gpu_kernels(backend: str, gpu_kernels) -> bool:
    """Whether a call's GPU kernels (its block row's gpu_kernels: CUDA-device events only, never the CPU-side
    ranges that carry a kernel's name, such as Inductor's around each Triton launch) include the backend's own
    (its record's `kernels`, or for a dispatcher backend the record of the kernel it runs: backends.kernel_of);
    another backend's kernel never counts."""
    import re

    pattern = backends.own_kernels().get(backends.kernel_of(backend))
    if not pattern:  # a backend with no kernels of its own (SDPA's, a matmul's) owns none
        return False
    names = gpu_kernels if isinstance(gpu_kernels, list) else str(gpu_kernels or "").split(",")
    return any(re.search(pattern, k) for k in names if k)


def new_backend_reason(name: str, device: str) -> str:
    """Why a backend of the last checks cannot run here, from what it needs alone (nothing run): '' if it may."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return f"needs a CUDA device (here: {device})"
    return backends._static_reason(name, torch.device(device), "float16", (64,))


def new_backend_check(name: str):
    """The check of one backend of NEW_BACKENDS on SD 2.1's U-Net at 512x512 (head_dim 64, which each takes; SD
    1.5's 160-dim blocks are beyond sage), through a worker: the cell ok and within the fp16 tolerance, every call's
    GPU kernels its own, flex's compile time recorded apart from its forwards."""
    def check(ctx: Context) -> Verdict:
        ctx.need_cuda()
        from ..execute.sweep import execute
        from ..store import Run

        run = Run.open(execute(ctx.sweep([name], pairs=[("sd21-base", 512)]), progress=False,
                               command=f"gpu-check {name}").run_path)
        cells, blocks = run.read()
        c = records(cells)[0]
        if c["status"] == "unavailable":
            raise Skip(str(c.get("error")))
        ok = c["status"] == "ok" and bool(c.get("error_ok"))
        rows = [evidence(c, "cells", ["status", "max_rel_err"] + (["compile_s"] if backends.compiles(name) else []),
                         rule="ok within the fp16 tolerance", ok=ok)]
        failed = [] if ok else [f"{c['status']}: {c.get('error') or c.get('max_rel_err')}"]
        for r in records(blocks):
            mine = own_gpu_kernels(name, r.get("gpu_kernels"))
            if not mine or r["call_index"] == 0:
                rows.append(evidence(r, "blocks", "gpu_kernels", rule=f"a GPU kernel of {name}'s own", ok=mine))
            if not mine:
                failed.append(f"call {r['call_index']} {r['block']}: no GPU kernel of {name}'s own")
        if backends.compiles(name) and not (c.get("compile_s") or 0) > 0:
            failed.append(f"{name} recorded no compile time")
        first = str(blocks["gpu_kernels"].iloc[0])[:80] if len(blocks) else "no calls"
        return Verdict(f"{name}: {first} (rel err {num(c.get('max_rel_err'))}"
                       f"{', compile ' + num(c.get('compile_s')) + ' s' if backends.compiles(name) else ''})",
                       rows, failed)

    return check
