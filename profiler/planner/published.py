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
  the 3090's is predicted. On the A100 it puts naive at its roofline (factor 0: the floor, 4 passes over each score
  table at the bandwidth).
- "": predicted, never fitted: the check.
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

    @property
    def what(self) -> str:
        return f"{'SDXL' if self.pipeline == 'sdxl' else 'SD 1.5'} {self.size}, {self.backend}"


_CLOUD, _DESK = "[1]'s machine", "[1]'s 4090 machine"
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
    Row(BLOG, _CLOUD, "sd15", 512, 4, 7.5, "naive", "A100-40GB", 11.6 / VANILLA, "naive"),
    Row(BLOG, _CLOUD, "sd15", 512, 4, 7.5, "naive", "RTX-3090", 6.46 / VANILLA),
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


def gpu_row(gpu: dict) -> tuple[Row, str]:
    """(the "gpu" row whose factor the GPU takes, how): its own, else that of a GPU of its architecture, else
    FALLBACK_GPU's (module docstring)."""
    from .. import gpus

    rows = [r for r in ROWS if r.use == "gpu"]
    own = [r for r in rows if r.gpu == gpu["name"]]
    same = [r for r in rows if gpus.get(r.gpu)["arch"] == gpu["arch"]]
    row = (own or same or [r for r in rows if r.gpu == FALLBACK_GPU])[0]
    how = "its own" if own else f"assumed as the {row.gpu}'s" + (" (the same architecture)" if same else
                                                                 " (no published row of its architecture)")
    return row, how


def gpu_scale(gpu: dict) -> tuple[float, str]:
    """(the factor of the GPU's rest-of-forward kernels, its source): fitted to the row gpu_row names; cached with the
    kernel fits."""
    row, how = gpu_row(gpu)
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


def naive_factor() -> float:
    """The unfused attention's factor off the H200's architecture (module docstring, "naive"): its calls' cores scaled
    so that the model's step of the "naive" row takes what the row says (the step is linear in it: two predictions)."""
    from dataclasses import replace

    from .. import gpus
    from ..env import cache_dir
    from ..store import add_to_cache, read_cache
    from .kernels import FITS_FILE, model_key

    row = next(r for r in ROWS if r.use == "naive")
    gpu = gpus.get(row.gpu)
    cal = published_calibration(gpu, "float16", host_us=1.0, naive=False)
    key = json.dumps(["naive-factor", *model_key(), repr(row), cal["kernel_data"], gpu_scale(gpu)[0]])
    path = cache_dir() / FITS_FILE
    if key in read_cache(path):
        return read_cache(path)[key]
    steps = []
    for f in (0.0, 1.0):
        c = dict(cal["kernels"]["naive"]["coefficients"], core_self=0.0, core_cross=0.0) if not f else \
            cal["kernels"]["naive"]["coefficients"]
        mine = {**cal, "kernels": {**cal["kernels"], "naive": {**cal["kernels"]["naive"], "coefficients": c}}}
        steps.append(_step(replace(row), mine)["predicted_gpu_time_ms"])
    factor = max(0.0, (1e3 / row.value - steps[0]) / (steps[1] - steps[0]))  # the floor below it
    add_to_cache(path, key, factor)
    return factor


def host_us(row: Row) -> tuple[float, str]:
    """The host of the row's machine, in us an op: fitted to that machine's "host" row (its step all host)."""
    from .host import forward_ops
    from .pipeline import PIPELINES
    from .forward import walk

    fit = next(r for r in ROWS if r.machine == row.machine and r.use == "host")
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


def check() -> list[dict]:
    """Every row against the time model: {"row", "published_ms", "predicted_ms", "error" (of the time), "bound",
    "use", "host"}."""
    from .. import gpus

    out = []
    for row in ROWS:
        us, host = host_us(row)
        t = _step(row, published_calibration(gpus.get(row.gpu), "float16", host_us=us))
        published = 1e3 / row.value
        out.append({"row": row, "published_ms": published, "predicted_ms": t["predicted_forward_time_ms"],
                    "error": t["predicted_forward_time_ms"] / published - 1, "bound": t["bound"],
                    "use": row.use, "host": host})
    return out


def format_check(found: list[dict]) -> str:
    lines = ["published timings against the time model (a U-Net step, ms; error: of the time, predicted over "
             "published):",
             f"  {'what':22s} {'GPU':10s} {'images':>6s} {'published':>10s} {'predicted':>10s} {'error':>7s}  "
             f"{'bound':5s}  used to fit"]
    for f in found:
        r = f["row"]
        use = {"gpu": "yes: the GPU's factor", "host": "yes: the machine's host",
               "naive": "yes: naive's factor"}.get(f["use"], "no")
        lines.append(f"  {r.what:22s} {r.gpu:10s} {r.images:6d} {f['published_ms']:10.1f} {f['predicted_ms']:10.1f} "
                     f"{100 * f['error']:+6.0f}%  {f['bound']:5s}  {use}")
    held = [abs(f["error"]) for f in found if not f["use"]]
    lines.append(f"  not used to fit: {len(held)} rows, worst {100 * max(held):.0f}%; sources: "
                 f"{DIFFUSERS_DOC}; {FAL}; {BLOG}")
    return "\n".join(lines)


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
                          scaled: bool = True, naive: bool = True) -> dict:
    """The time model of a GPU of the table, in the shape of a calibration (planner/timing.py): "kernels" each
    attention kernel's coefficients fitted to the kernel times of the GPU's architecture, or carried over from the
    data's by published efficiencies (planner/kernels.py); "per_backend" a backend whose kernel has no such data at
    its kernel's published efficiency (or of the bandwidth for an unfused one), the projections at the matmul's and
    the fitted kernel time a call beyond them; "rest" the rest of a forward's kernels per op class at their
    efficiencies and the fitted kernel time an op; "host" the host's time per op (planner/host.py); "published" where
    each figure came from. scaled: the rest's kernels at the GPU's factor fitted to published timings
    (planner/published.py; False: at the assumed efficiencies, as that fit needs them); naive: naive's kernels
    carried off the data's architecture by published.naive_factor (False: as that fit needs)."""
    from .. import devices
    from ..attention import backends
    from ..gpus import FUSED, efficiency
    from .host import host_us_per_op
    from .kernels import gpu_kernels

    arch = gpu["arch"]
    kern = gpu_kernels(gpu, dtype, results)  # a dtype without kernel times at float16's, said in its source
    if naive and "naive" in kern["kernels"] and kern["data_arch"] != arch:
        kern = _naive_carried(kern)
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
    m, m_source = gpu_scale(gpu) if scaled else (1.0, "not scaled")
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


def _naive_carried(kern: dict) -> dict:
    """The kernel fit with naive's cores at naive_factor() (module docstring, "naive")."""
    f = naive_factor()
    c = kern["kernels"]["naive"]["coefficients"]
    naive = {**kern["kernels"]["naive"], "coefficients": {**c, "core_self": c["core_self"] * f,
                                                         "core_cross": c["core_cross"] * f},
             "scaled": f"x{f:.2f}: fitted to [3]'s SDPA over vanilla attention in fp16 on the A100"}
    return {**kern, "kernels": {**kern["kernels"], "naive": naive},
            "source": kern["source"] + f"; naive x{f:.2f} beyond that, fitted to [3] on the A100 (0: its roofline)"}
