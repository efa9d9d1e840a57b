"""Published timings of Stable Diffusion on GPUs: what the time model's GPU side is fitted to where no GPU of ours
ran, and what it is checked against (docs/timing.md's table; python -m profiler.bench --only published).

Each row is a denoising loop's rate as its source prints it: U-Net steps a second, each step one forward at twice
the images (classifier-free guidance), so a step's time is the forward's eager time, the longer of its kernels and
its host (planner/host.py). The sources:
[1] diffusers docs, optimization/torch2.0.mdx (huggingface/diffusers at 07dc8feb, its Benchmark section): SD 1.5
    txt2img, fp16, channels-last U-Net, torch 2.0 without compile (SDPA), 512x512, 50 steps; A100 (40 GB), V100,
    T4, RTX 3090 and RTX 4090 at 1, 4 and 16 images (T4's 16 in seconds an iteration).
[2] fal-ai/stable-diffusion-benchmarks README (at 0490f695): an A100 80G SXM, torch 2.1, diffusers, fp16, 50 steps,
    the pipelines' defaults (SD 1.5 512x512 guidance 7.5, SDXL 1024x1024 guidance 5), its speed (it/s) column.
What each row is used for ("use"):
- "gpu": fits its GPU's rest-of-forward factor (gpu_scale: the time of the rest's kernels over their time at the
  efficiencies gpus.EFFICIENCY assumes), so that the model's kernels of that step take what the row says: the row of
  the GPU at 16 images, where the kernels take several times the host. A GPU without such a row takes the factor of
  its architecture's GPU that has one, else the A100's (said so).
- "host": fits the host of the source's machine, in us an op: the row at one image, where the host sets the pace.
  [1]'s GPUs are taken to share one machine's host but the 4090's, whose own row says its host was about twice as
  fast per op (assumed; [1] does not say where each ran).
- "naive": fits the unfused attention's factor on a GPU other than the H200's architecture (naive_factor: its
  kernels fitted on the H200's, where they moved 37% of its bandwidth, carried by this one figure, never below the
  roofline): [3] says SDPA ran 20-28% faster than the vanilla attention in fp16 on the GPUs it shows in fp16 but
  the 4090 (the A100 and the 3090), so the row is [1]'s SDPA step at 4 images times 1.24 (the middle), on the A100;
  the 3090's is predicted. Both naive rows are derived, not published (Row.derived). On the A100 the fit comes out
  at -0.01, under naive's roofline: taken at 0 (the floor, 4 passes over each score table at the bandwidth), said.
- "": predicted, never fitted: the check. check() names each such row whose prediction is a fitted row's (copy_of:
  host-bound on a machine whose host that row fits), and leave_one_gpu_out() predicts each GPU's rows from a fit to
  the other GPUs' rows alone: the case of a GPU one lacks.
[3] PyTorch blog, "Accelerated Diffusers with PyTorch 2.0" (pytorch/pytorch.github.io, 2023-03-16), "Results in
    float16": SDPA 20-28% faster than standard attention (diffusers' vanilla processor) on all GPUs tested but the
    4090.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

DIFFUSERS_DOC = ("[1] diffusers docs, optimization/torch2.0.mdx (huggingface/diffusers at 07dc8feb): SD 1.5, fp16, "
                 "torch 2.0 without compile, SDPA; steps a second")
FAL = "[2] fal-ai/stable-diffusion-benchmarks README (at 0490f695): A100 80G SXM, torch 2.1, fp16; steps a second"
BLOG = ("[3] PyTorch blog 2023-03-16, Accelerated Diffusers with PyTorch 2.0: fp16 SDPA 20-28% faster than vanilla "
        "attention; the row: [1]'s SDPA step times 1.24")
VANILLA = 1.24  # [3]'s 20-28%: the middle


@dataclass(frozen=True)
class Row:
    source: str
    machine: str  # whose host: rows of one machine share it
    pipeline: str
    size: int
    images: int
    guidance: float
    backend: str
    gpu: str
    value: float  # steps a second
    use: str = ""
    derived: str = ""  # how the row was made from published figures, where no source printed it as such

    @property
    def what(self) -> str:
        return f"{'SDXL' if self.pipeline == 'sdxl' else 'SD 1.5'} {self.size}, {self.backend}"


_CLOUD, _DESK = "[1]'s machine", "[1]'s 4090 machine"
_DERIVED = "naive's rows: [1]'s SDPA rate at 4 images over 1.24 ([3]: SDPA 20-28% faster than vanilla attention)"
ROWS = (
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 1, 7.5, "sdpa", "A100-40GB", 21.66, "host"),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 4, 7.5, "sdpa", "A100-40GB", 11.6),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 16, 7.5, "sdpa", "A100-40GB", 3.04, "gpu"),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 1, 7.5, "sdpa", "V100-32GB", 18.99),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 4, 7.5, "sdpa", "V100-32GB", 5.96),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 16, 7.5, "sdpa", "V100-32GB", 1.66, "gpu"),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 1, 7.5, "sdpa", "T4", 6.9),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 4, 7.5, "sdpa", "T4", 1.79),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 16, 7.5, "sdpa", "T4", 1 / 2.34, "gpu"),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 1, 7.5, "sdpa", "RTX-3090", 22.56),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 4, 7.5, "sdpa", "RTX-3090", 6.46),
    Row(DIFFUSERS_DOC, _CLOUD, "sd15", 512, 16, 7.5, "sdpa", "RTX-3090", 1.7, "gpu"),
    Row(DIFFUSERS_DOC, _DESK, "sd15", 512, 1, 7.5, "sdpa", "RTX-4090", 40.5, "host"),
    Row(DIFFUSERS_DOC, _DESK, "sd15", 512, 4, 7.5, "sdpa", "RTX-4090", 12.62),
    Row(DIFFUSERS_DOC, _DESK, "sd15", 512, 16, 7.5, "sdpa", "RTX-4090", 3.17, "gpu"),
    Row(BLOG, _CLOUD, "sd15", 512, 4, 7.5, "naive", "A100-40GB", 11.6 / VANILLA, "naive", _DERIVED),
    Row(BLOG, _CLOUD, "sd15", 512, 4, 7.5, "naive", "RTX-3090", 6.46 / VANILLA, derived=_DERIVED),
    Row(FAL, "[2]'s machine", "sd15", 512, 1, 7.5, "sdpa", "A100-80GB", 31.44, "host"),
    Row(FAL, "[2]'s machine", "sd15", 512, 1, 7.5, "xformers", "A100-80GB", 28.43),
    Row(FAL, "[2]'s machine", "sdxl", 1024, 1, 5.0, "sdpa", "A100-80GB", 8.43),
    Row(FAL, "[2]'s machine", "sdxl", 1024, 1, 5.0, "xformers", "A100-80GB", 8.74),
)
FALLBACK_GPU = "A100-40GB"  # the factor of an architecture with no published row of its own


def _step(row: Row, calibration: dict) -> dict:
    """The time model's U-Net step of the row on its GPU (planner/timing.predict's totals)."""
    from .. import gpus
    from .pipeline import PIPELINES
    from .timing import predict, walked_plan

    gpu = gpus.get(row.gpu)
    p = walked_plan(PIPELINES[row.pipeline]["unet"], row.size, row.size, 2 * row.images, "float16")
    return predict(p, row.backend, {}, gpus.limits(gpu, "float16"), calibration, gpu)


def gpu_row(gpu: dict, rows: tuple = ROWS) -> tuple[Row | None, str]:
    """(the "gpu" row of rows whose factor the GPU takes, how): its own, else that of a GPU of its architecture, else
    FALLBACK_GPU's (module docstring); None where rows hold none of these (a fit that leaves the A100 out)."""
    from .. import gpus

    fits = [r for r in rows if r.use == "gpu"]
    own = [r for r in fits if r.gpu == gpu["name"]]
    same = [r for r in fits if gpus.get(r.gpu)["arch"] == gpu["arch"]]
    found = own or same or [r for r in fits if r.gpu == FALLBACK_GPU]
    if not found:
        return None, f"no published row of its own, its architecture's or the {FALLBACK_GPU}'s"
    row = found[0]
    how = "its own" if own else f"assumed as the {row.gpu}'s" + (" (the same architecture)" if same else
                                                                 " (no published row of its architecture)")
    return row, how


def gpu_scale(gpu: dict, rows: tuple = ROWS) -> tuple[float, str]:
    """(the factor of the GPU's rest-of-forward kernels, its source): fitted to the row gpu_row names, else the median
    of the factors of rows' GPUs; cached with the kernel fits."""
    import statistics

    row, how = gpu_row(gpu, rows)
    if row is None:
        scales = [_fitted_scale(r) for r in rows if r.use == "gpu"]
        return statistics.median(scales), f"{how}: the median of {len(scales)} GPUs' factors"
    return _fitted_scale(row), f"{how}: fitted to {row.source.split(' ', 1)[0]}'s {row.gpu} row at {row.images} images"


def _fitted_scale(row: Row) -> float:
    """The factor that makes the row's step take 1 / value seconds of kernels: the rest's class terms scaled, its
    attention and its ops' minimum as they are (a forward's kernel time is linear in it)."""
    from .. import gpus
    from ..env import cache_dir
    from ..store import add_to_cache, read_cache
    from .kernels import FITS_FILE, model_key

    gpu = gpus.get(row.gpu)
    cal = published_calibration(gpu, "float16", host_us=1.0, scaled=False, naive=False)
    key = json.dumps(["gpu-scale", *model_key(), repr(row), cal["kernel_data"]])
    path = cache_dir() / FITS_FILE
    if key in read_cache(path):
        return read_cache(path)[key]
    t = _step(row, cal)
    ops = cal["rest"]["float16"]["coefficients"]["ops"] * t["rest_ops"]
    classes = t["predicted_rest_time_ms"] - ops
    scale = (1e3 / row.value - t["predicted_attention_time_ms"] - ops) / classes
    add_to_cache(path, key, scale)
    return scale


def naive_row(rows: tuple = ROWS) -> Row:
    """The row naive's factor is fitted to: the "naive" row of rows, else another naive row of rows (a fit that leaves
    the A100 out)."""
    return next(r for r in sorted(rows, key=lambda r: r.use != "naive") if r.backend == "naive")


def naive_factor(rows: tuple = ROWS) -> float:
    """The unfused attention's factor off the H200's architecture (module docstring, "naive"): its calls' cores scaled
    so that the model's step of naive_row takes what the row says (the step is linear in it: two predictions). Not
    clamped: a factor below 0 would mean the row is faster than naive's roofline, which naive_floor_said reports."""
    from .. import gpus
    from ..env import cache_dir
    from ..store import add_to_cache, read_cache
    from .kernels import FITS_FILE, model_key

    row = naive_row(rows)
    gpu = gpus.get(row.gpu)
    cal = published_calibration(gpu, "float16", host_us=1.0, naive=False, rows=rows)
    key = json.dumps(["naive-factor", *model_key(), repr(row), cal["kernel_data"], gpu_scale(gpu, rows)[0]])
    path = cache_dir() / FITS_FILE
    if key in read_cache(path):
        return read_cache(path)[key]
    steps = []
    for f in (0.0, 1.0):
        c = dict(cal["kernels"]["naive"]["coefficients"], core_self=0.0, core_cross=0.0) if not f else \
            cal["kernels"]["naive"]["coefficients"]
        mine = {**cal, "kernels": {**cal["kernels"], "naive": {**cal["kernels"]["naive"], "coefficients": c}}}
        steps.append(_step(row, mine)["predicted_gpu_time_ms"])
    factor = (1e3 / row.value - steps[0]) / (steps[1] - steps[0])
    add_to_cache(path, key, factor)
    return factor


def host_us(row: Row, rows: tuple = ROWS) -> tuple[float, str]:
    """The host of the row's machine, in us an op: fitted to that machine's "host" row in rows (its step all host),
    else to another 1-image SDPA row of that machine in rows, else the median of rows' other machines' (a fit that
    leaves the machine's only GPU out)."""
    import statistics

    from .forward import walk
    from .host import forward_ops
    from .pipeline import PIPELINES

    mine = sorted((r for r in rows if r.machine == row.machine and r.images == 1 and r.backend == "sdpa"),
                  key=lambda r: r.use != "host")
    if not mine:
        others = {r.machine: host_us(r, rows)[0] for r in rows if r.use == "host"}
        us = statistics.median(others.values())
        return us, f"{row.machine}: {us:.1f} us an op, the median of {len(others)} other machines' (none of its rows)"
    fit = mine[0]
    ops = forward_ops(walk(PIPELINES[fit.pipeline]["unet"], fit.size, fit.size, 2 * fit.images, "float16"),
                      fit.backend)
    us = 1e6 / fit.value / ops
    return us, f"{row.machine}: {us:.1f} us an op, fitted to its {fit.gpu} {fit.what} row at {fit.images} image(s)"


def typical_host() -> tuple[float, str]:
    """(a typical host's microseconds per op, its source): the median of the published machines' hosts (host_us of
    each machine's "host" row, the batch-1 loops where the host set the pace), the default host of a GPU one lacks."""
    import statistics

    fitted = sorted((host_us(r)[0], r) for r in ROWS if r.use == "host")
    us = statistics.median(u for u, _ in fitted)
    each = ", ".join(f"{r.machine} {u:.1f}" for u, r in fitted)
    return us, (f"a typical host, {us:.1f} us an op: the median of the published timings' machines, each fitted to "
                f"its batch-1 loop, where the host set the pace ({each}); --host-us-per-op US for yours, "
                f"--host-us-per-op here for this machine's")


def predicted(row: Row, rows: tuple = ROWS) -> dict:
    """The row against the time model fitted to rows: {"row", "published_ms", "predicted_ms", "error" (of the time),
    "bound", "use", "host"}."""
    from .. import gpus

    us, host = host_us(row, rows)
    t = _step(row, published_calibration(gpus.get(row.gpu), "float16", host_us=us, rows=rows))
    published = 1e3 / row.value
    return {"row": row, "published_ms": published, "predicted_ms": t["predicted_forward_time_ms"],
            "error": t["predicted_forward_time_ms"] / published - 1, "bound": t["bound"], "use": row.use,
            "host": host}


def check() -> list[dict]:
    """Every row against the time model fitted to them all (predicted), each row not used to fit said to be a copy of
    a fitted one where it is (copy_of: host-bound on a machine whose host a row of the same step fits, so that its
    prediction is that row's, whatever its GPU)."""
    out = [predicted(row) for row in ROWS]
    for f in out:
        r = f["row"]
        fitted = next((g for g in out if g["use"] == "host" and g["row"].machine == r.machine and
                       g["row"].pipeline == r.pipeline and g["row"].images == r.images), None)
        f["copy_of"] = None if f["use"] or f["bound"] != "host" or fitted is None or \
            abs(f["predicted_ms"] / fitted["predicted_ms"] - 1) > 1e-9 else fitted["row"]
    return out


def leave_one_gpu_out() -> list[dict]:
    """Each GPU's rows predicted from a fit to every other GPU's rows alone (its factor, its machine's host where its
    rows fitted it, naive's factor where its naive row fitted it, each from the others: gpu_scale, host_us,
    naive_row): predicted() per row, with "left_out" the GPU."""
    out = []
    for gpu in dict.fromkeys(r.gpu for r in ROWS):
        others = tuple(r for r in ROWS if r.gpu != gpu)
        out += [{**predicted(row, others), "left_out": gpu} for row in ROWS if row.gpu == gpu]
    return out


def format_check(found: list[dict], logo: list[dict] | None = None) -> str:
    """The table of docs/timing.md (python -m profiler.bench --only published): each row's figures fitted to all
    rows, what it was used for or what it copies, and with logo the same row predicted with its GPU left out."""
    lines = ["published timings against the time model (a U-Net step, ms; error: of the time, predicted over "
             "published; without its GPU: the row predicted from a fit to the other GPUs' rows alone):",
             f"  {'what':30s} {'GPU':10s} {'images':>6s} {'published':>9s} {'predicted':>9s} {'error':>6s}  "
             f"{'bound':5s} {'without its GPU':>15s}  used to fit"]
    away = {id(f["row"]): f for f in logo or []}
    for f in found:
        r, held = f["row"], away.get(id(f["row"]))
        use = {"gpu": "yes: the GPU's factor", "host": "yes: the machine's host",
               "naive": "yes: naive's factor"}.get(f["use"], "no")
        if f["use"] == "naive" and naive_factor() < 0:
            use += f" (fitted x{naive_factor():.2f}, taken at 0: its roofline)"
        if f.get("copy_of"):
            use += f" (not independent: host-bound, its prediction the {f['copy_of'].gpu} host row's)"
        what, without = r.what + (" (derived)" if r.derived else ""), f"{100 * held['error']:+.0f}%" if held else "-"
        lines.append(f"  {what:30s} {r.gpu:10s} {r.images:6d} {f['published_ms']:9.1f} {f['predicted_ms']:9.1f} "
                     f"{100 * f['error']:+5.0f}%  {f['bound']:5s} {without:>15s}  {use}")
    return "\n".join(lines + _summary_lines(found, logo))


def _summary_lines(found: list[dict], logo: list[dict] | None) -> list[str]:
    """The table's last lines: the rows not used to fit (and of those the independent ones: no copy of a fitted row,
    not derived), the worst error each; with its GPU left out, every row's worst; the derived rows and the sources."""
    held = [f for f in found if not f["use"]]
    independent = [f for f in held if not f.get("copy_of") and not f["row"].derived]
    worst = lambda rows: max(abs(f["error"]) for f in rows)  # noqa: E731
    lines = [f"  not used to fit: {len(held)} rows, worst {100 * worst(held):.0f}%; of them independent (no copy of a "
             f"fitted row, not derived): {len(independent)} rows, worst {100 * worst(independent):.0f}%"]
    if logo:
        lines.append(f"  each GPU's rows predicted without any of its rows (leave one GPU out): {len(logo)} rows, "
                     f"worst {100 * worst(logo):.0f}% ({_worst_text(logo)})")
    derived = sorted({f["row"].derived for f in found if f["row"].derived})
    return lines + [f"  derived, not published as such: {d}" for d in derived] + \
        [f"  sources: {DIFFUSERS_DOC}; {FAL}; {BLOG}"]


def _worst_text(rows: list[dict]) -> str:
    f = max(rows, key=lambda f: abs(f["error"]))
    return f"{f['row'].what}, {f['row'].gpu}, {f['row'].images} image(s)"


def sources_of(gpu: dict) -> dict:
    """Where a GPU's time model comes from, without fitting anything (attnprof gpus): its attention kernels', its rest
    of a forward's and its host's."""
    from .. import gpus
    from .kernels import DATA_ARCH

    if gpu["arch"] == DATA_ARCH:
        kernels = "fitted on the H200 run's kernel times (configs/kernels/), this architecture's"
    else:
        carried = sorted({src for k in gpus.ATTENTION for a, (_, src) in gpus.ATTENTION[k].items()
                          if a in (gpu["arch"], DATA_ARCH) and k == "flash"})
        kernels = (f"fitted on the H200 run's kernel times ({DATA_ARCH}), carried to {gpu['arch']} by "
                   + ("; ".join(carried) if len(carried) > 1 else "no published figure (assumed as sm90's)")
                   + "; naive's by [3]")
    row, how = gpu_row(gpu)
    return {"kernels": kernels, "rest": f"{how} row of {row.source.split(' ', 1)[0]} at {row.images} images",
            "host": "a typical host fitted to published timings (typical_host), or --host-us-per-op"}


PUBLISHED_SHORT = "published limits, kernel times of GPUs"


def published_calibration(gpu: dict, dtype: str, results: Path | None = None, host_us: float | None = None,
                          scaled: bool = True, naive: bool = True, rows: tuple = ROWS) -> dict:
    """The time model of a GPU of the table, in the shape of a calibration (planner/timing.py): "kernels" each
    attention kernel's coefficients fitted to the kernel times of the GPU's architecture, or carried over from the
    data's by published efficiencies (planner/kernels.py); "per_backend" a backend whose kernel has no such data at
    its kernel's published efficiency (or of the bandwidth for an unfused one), the projections at the matmul's and
    the fitted kernel time a call beyond them; "rest" the rest of a forward's kernels per op class at their
    efficiencies and the fitted kernel time an op; "host" the host's time per op (planner/host.py); "published" where
    each figure came from. scaled: the rest's kernels at the GPU's factor fitted to published timings
    (planner/published.py; False: at the assumed efficiencies, as that fit needs them); naive: naive's kernels
    carried off the data's architecture by published.naive_factor (False: as that fit needs); rows: the published
    rows the factors are fitted to (leave_one_gpu_out leaves some out)."""
    from .. import devices
    from ..attention import backends
    from ..gpus import FUSED, efficiency
    from .host import host_us_per_op
    from .kernels import gpu_kernels

    arch = gpu["arch"]
    kern = gpu_kernels(gpu, dtype, results)  # a dtype without kernel times at float16's, said in its source
    if naive and "naive" in kern["kernels"] and kern["data_arch"] != arch:
        kern = _naive_carried(kern, rows)
    memory, matmul, conv = efficiency("memory", arch), efficiency("matmul", arch), efficiency("convolution", arch)
    sources = {"memory-bound ops": memory, "matmul": matmul, "convolution": conv}
    per_backend = {}
    for name in backends.BACKENDS:
        kernel = FUSED.get(name, "memory")
        if name == "sdpa":
            kernel = devices.sdpa_rule(dtype, 64, 4096, devices.gpu_target(arch))
            kernel = {"cudnn": "flash", "math": "memory"}.get(kernel, kernel)
        core = efficiency(kernel, arch) or efficiency("efficient", arch) if kernel != "memory" else memory
        said = f"{name} attention at {core[0]:.0%} of " + (f"the peak ({kernel} kernel: {core[1]})"
                                                             if kernel != "memory" else
                                                             "the bandwidth (unfused: memory-bound)")
        per_backend[name] = {"coefficients": {"core_self": 1 / core[0], "core_cross": 1 / core[0],
                                              "projections": 1 / matmul[0], "overhead": kern["overhead"]},
                             "cells": 0, "runs": 0, "loo_error_pct": None, "published": said}
    m, m_source = gpu_scale(gpu, rows) if scaled else (1.0, "not scaled")
    rest = {"coefficients": {"convolution": m / conv[0], "matmul": m / matmul[0], "norm": m / memory[0],
                             "other": m / memory[0], "ops": kern["op_ms"]}}
    us, host_source = typical_host() if host_us is None else host_us_per_op(host_us)
    said = "; ".join(f"{k} at {v[0]:.0%} ({v[1]})" for k, v in sources.items())
    refused = "".join(f"; {line}" for line in kern["refused"])
    text = (f"an estimate, not a measurement: the {gpu['name']}'s published figures ({gpu['source']}); its attention "
            f"calls' kernels from {kern['source']}{refused}; the rest of a forward's kernels at {m:.2f}x the time "
            f"these efficiencies of {arch} give ({m_source}): {said}, and {kern['op_ms'] * 1e3:.2f} us an op (the "
            f"fitted kernel time a call beyond its roofline, over a call's {kern['overhead'] / kern['op_ms']:.0f} ops)")
    summary = (f"{PUBLISHED_SHORT}: attention kernels fitted on {kern['data']}" +
               (f", carried to {arch}" if arch != kern["data_arch"] else "") +
               (f" ({kern['dtype_note']})" if kern["dtype_note"] else "") +
               f"; the rest at {m:.2f}x the assumed efficiencies' time ({m_source})")
    return {"published": text, "summary": summary, "per_backend": per_backend, "kernels": kern["kernels"],
            "kernel_data": kern["data"],
            "backends": {},
            "rest": {dtype: rest}, "generation": None, "host": {"us_per_op": us, "source": host_source}}


def _naive_carried(kern: dict, rows: tuple = ROWS) -> dict:
    """The kernel fit with naive's cores at naive_factor (module docstring, "naive"), never below 0 (a factor below 0
    would put naive's calls under their roofline: they are taken at it, said)."""
    raw, row = naive_factor(rows), naive_row(rows)
    f = max(0.0, raw)
    said = f"x{f:.2f}" if raw >= 0 else f"x0 (fitted {raw:.2f}: the row is under naive's roofline, taken at it)"
    c = kern["kernels"]["naive"]["coefficients"]
    naive = {**kern["kernels"]["naive"], "coefficients": {**c, "core_self": c["core_self"] * f,
                                                         "core_cross": c["core_cross"] * f},
             "scaled": f"{said}: fitted to the {row.gpu}'s derived naive row ([3]'s SDPA over vanilla attention)"}
    return {**kern, "kernels": {**kern["kernels"], "naive": naive},
            "source": kern["source"] + f"; naive {said} beyond that, fitted to the {row.gpu}'s derived naive row "
                                       "([3]; 0: its roofline)"}
