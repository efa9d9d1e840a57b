"""A GPU of the table's time model: each architecture's achieved efficiencies fitted to published timings and the
kernel times kept with the project, how sure a prediction is, and the table that checks it (python -m profiler.bench
--only published; docs/timing.md).

Each row is what its source printed: a denoising loop's rate (U-Net steps a second, each step one forward at twice
the images under classifier-free guidance), or a whole generation's seconds. The sources (SOURCES):
- diffusers' torch 2.0 benchmark: diffusers docs, optimization/torch2.0.mdx (huggingface/diffusers at 07dc8feb, its
  Benchmark section): SD 1.5 txt2img, fp16, channels-last U-Net, torch 2.0 without compile (SDPA), 512x512, 50 steps;
  A100 (40 GB), V100, T4, RTX 3090 and RTX 4090 at 1, 4 and 16 images (T4's 16 in seconds an iteration); and the same
  with a ControlNet (checks: predicted, never fitted).
- fal's benchmark: fal-ai/stable-diffusion-benchmarks README (at 0490f695): an A100 80G SXM, torch 2.1, diffusers
  0.21.4, fp16, 50 steps, the pipelines' defaults (SD 1.5 512x512 guidance 7.5, SDXL 1024x1024 guidance 5): its
  median seconds a pipeline call, whole generations (its it/s column is 50 over them: the text encoders and the
  decode are in it; diffusers 0.21 kept the upcast SDXL VAE's mid block in float16 under SDPA and xformers, which the
  model, as diffusers runs it today, decodes in float32: about 0.19 s of its 5.9 s over, the mid block's
  attention at 202 ms in float32 against 13 ms in float16; SD 1.5's safety checker, a CLIP ViT-L/14 on the 224-pixel
  image, is left out).
- diffusers' fast-diffusion tutorial: diffusers docs, tutorials/fast_diffusion.md (= huggingface/diffusion-fast): SDXL
  1024x1024, 30 steps, one image, an A100 80GB 400 W, torch nightly 2.3: bfloat16 with the vanilla attention processor
  (naive) 4.63 s, with SDPA 3.31 s, whole generations (the text encoders, the steps and the decode, in bfloat16); and
  its float32 baseline (vanilla attention) 7.36 s, a check: its benchmark (huggingface/diffusion-fast run_benchmark.py)
  sets torch.set_float32_matmul_precision("high"), so its float32 matmuls ran at TF32 (Row.tf32).

Each step is planner/physics.py's forward: every kernel at its architecture's achieved share of the GPU's peaks
(convolution, matmul, memory-bound ops, the fused attention kernels' factor over their kernel fit), the host's
dispatch per op, the two overlapped op by op. The rows marked "fit" fit, jointly (least squares on the log of
predicted over published), each architecture's four shares and each machine's host: a share is at most
physics.CEILING, each architecture's shares are pulled toward their line's (gpus.py: datacenter or GeForce cards) by
a weak prior (LAMBDA) and the lines' toward the assumed ones (gpus.EFFICIENCY), so that an architecture with few rows
leans on the others. The kernel table of sm90 (configs/kernels/, planner/kernels.py) gives that architecture's fused
kernels, its matmul and memory shares (the attention calls' projections and layouts, at most CEILING), a kernel's
minimum time (every architecture's, assumed) and the unfused kernels' share of the bandwidth (naive's: every
architecture's until a GPU measures it, assumed). A GPU takes (shares_for): its architecture's fitted shares; sm90
its kernel table's, its convolutions the datacenter line's; another architecture its line's, said so.

How sure: a GPU whose architecture has rows is within the fit's worst miss of its own rows (u_fit); one carried is
within the worst miss of leave one GPU out (u_carried: each GPU's rows, fitted and checks, predicted from a fit to the
other GPUs' rows alone, every machine's host as fitted on all rows: a host is its machine's, not its GPU's). A range
sized on the rows it is checked on holds them by construction; the check also sizes each GPU's range on the other
GPUs' misses alone (check(): "inside_without_its_gpu"). The host is its published
machine's where the GPU has one (within the fit's worst miss), else anywhere between the fastest and the slowest
published machine (each within the fit's worst miss). A prediction's range is the forward at the fast ends of both and
at the slow ends of both.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from .physics import CEILING, Shares, kernel_ms, overlap, stream

DIFFUSERS_DOC, FAL, FAST = "diffusers' torch 2.0 benchmark", "fal's benchmark", "diffusers' fast-diffusion tutorial"
GUIDE = "diffusers' speed-up guide"
SOURCES = {DIFFUSERS_DOC: "diffusers docs, optimization/torch2.0.mdx (huggingface/diffusers at 07dc8feb): SD 1.5, "
                          "fp16, torch 2.0 without compile, SDPA; steps a second",
           FAL: "fal-ai/stable-diffusion-benchmarks README (at 0490f695): A100 80G SXM, torch 2.1, fp16, 50 steps; "
                "median seconds a generation",
           FAST: "diffusers docs, tutorials/fast_diffusion.md (huggingface/diffusion-fast): SDXL, 30 steps, A100 80GB "
                 "400 W, torch 2.3 nightly, bfloat16 (float32: matmuls at TF32); seconds a generation",
           GUIDE: "diffusers docs v0.30, optimization/fp16.md: SD 1.5 512x512, 50 DDIM steps, one image, \"a NVIDIA "
                  "A100\" (taken as the 40 GB card), SDPA; fp16, and float32 with and without TF32 matmuls; seconds "
                  "a generation"}
LAMBDA, MU, HOST_PRIOR = 0.1, 0.1, 0.01  # prior weights: an architecture toward its line, a line toward assumed
HOST_US = 35.0  # the host prior's centre, us an op, about the published machines' middle (weak: each machine's rows
# pin its own)


@dataclass(frozen=True)
class Row:
    source: str  # a name of SOURCES
    machine: str  # whose host: rows of one machine share it
    pipeline: str
    size: int
    images: int
    guidance: float
    backend: str
    gpu: str
    value: float  # steps a second, or a whole generation's seconds where steps is given
    use: str = "fit"  # fit, or check: predicted, never fitted
    dtype: str = "float16"
    steps: int = 0  # a whole generation's steps (value its seconds); 0: value is steps a second
    controlnet: bool = False
    tf32: bool = False  # float32 matmuls at TF32 (the source sets torch.set_float32_matmul_precision("high"))

    @property
    def what(self) -> str:
        name = "SDXL" if self.pipeline == "sdxl" else "SD 1.5" + (" + ControlNet" if self.controlnet else "")
        return (f"{name} {self.size}, {self.backend}" + ("" if self.dtype == "float16" else f", {self.dtype}")
                + (" tf32" if self.tf32 else ""))

    @property
    def published_ms(self) -> float:
        return self.value * 1e3 if self.steps else 1e3 / self.value


_CLOUD, _DESK, _FAL, _FAST = ("the torch 2.0 benchmark's cloud machine", "the torch 2.0 benchmark's desktop",
                              "fal's machine", "the fast-diffusion tutorial's machine")
_GUIDE = "the speed-up guide's machine"
_MACHINE = {"A100-40GB": _CLOUD, "V100-32GB": _CLOUD, "T4": _CLOUD, "RTX-3090": _DESK, "RTX-4090": _DESK}


def _one(gpu: str, images: int, value: float, use: str = "fit", controlnet: bool = False) -> Row:
    return Row(DIFFUSERS_DOC, _MACHINE[gpu], "sd15", 512, images, 7.5, "sdpa", gpu, value, use, controlnet=controlnet)


_RATES = {"A100-40GB": (21.66, 11.6, 3.04, 15.02, 8.28, 2.15), "V100-32GB": (18.99, 5.96, 1.66, 13.48, 4.26, 1.19),
          "T4": (6.9, 1.79, 1 / 2.34, 4.89, 1.34, None), "RTX-3090": (22.56, 6.46, 1.7, 16.03, 4.59, 1.23),
          "RTX-4090": (40.5, 12.62, 3.17, 29.27, 9.1, 2.23)}  # txt2img at 1, 4, 16 images; ControlNet's
ROWS = tuple(_one(g, n, v[i]) for g, v in _RATES.items() for i, n in enumerate((1, 4, 16))) + (
    Row(FAL, _FAL, "sd15", 512, 1, 7.5, "sdpa", "A100-80GB", 1.590, steps=50),
    Row(FAL, _FAL, "sd15", 512, 1, 7.5, "xformers", "A100-80GB", 1.759, steps=50),
    Row(FAL, _FAL, "sdxl", 1024, 1, 5.0, "sdpa", "A100-80GB", 5.933, steps=50),
    Row(FAL, _FAL, "sdxl", 1024, 1, 5.0, "xformers", "A100-80GB", 5.724, steps=50),
) + tuple(_one(g, n, v[3 + i], "check", True) for g, v in _RATES.items() for i, n in enumerate((1, 4, 16))
          if v[3 + i]) + (
    Row(FAST, _FAST, "sdxl", 1024, 1, 5.0, "naive", "A100-80GB", 4.63, "fit", "bfloat16", 30),
    Row(FAST, _FAST, "sdxl", 1024, 1, 5.0, "sdpa", "A100-80GB", 3.31, "fit", "bfloat16", 30),
    Row(FAST, _FAST, "sdxl", 1024, 1, 5.0, "naive", "A100-80GB", 7.36, "check", "float32", 30, tf32=True),
    Row(GUIDE, _GUIDE, "sd15", 512, 1, 7.5, "sdpa", "A100-40GB", 3.51, "fit", "float16", 50),
    Row(GUIDE, _GUIDE, "sd15", 512, 1, 7.5, "sdpa", "A100-40GB", 5.27, "check", "float32", 50),
    Row(GUIDE, _GUIDE, "sd15", 512, 1, 7.5, "sdpa", "A100-40GB", 4.14, "check", "float32", 50, tf32=True),
)


def _streams(row: Row) -> list[tuple]:
    """The row's forwards as physics streams: (stream, times run) per part, each GPU-priced with its GPU's kernels."""
    from .. import gpus
    from .forward import walk
    from .kernels import gpu_kernels
    from .pipeline import PIPELINES

    gpu = gpus.get(row.gpu)
    kern = gpu_kernels(gpu, row.dtype)["kernels"]
    p = PIPELINES[row.pipeline]
    batch, steps = 2 * row.images if row.guidance > 1 else row.images, row.steps or 1
    out = [(stream(walk(p["unet"], row.size, row.size, batch, row.dtype), row.backend, {}, row.dtype, gpu, kern,
                   row.tf32), steps)]
    if row.controlnet:
        out.append((stream(walk(p["controlnet"], row.size, row.size, batch, row.dtype), row.backend, {}, row.dtype,
                           gpu, kern, row.tf32), steps))
    if row.steps:  # a whole generation: its text encoders and its decode too
        from .pipeline import text_ops

        for name in p["text"]:
            ops = text_ops(name, row.dtype, row.images)
            w = {"rows": [], "calls": [], "rest": ops, "at": []}
            out.append((stream(w, row.backend, {}, row.dtype, gpu, kern, row.tf32), 2 if row.guidance > 1 else 1))
        out.append((stream(_decode_walk(p["vae"], row.size, row.images, row.dtype), row.backend, {}, row.dtype, gpu,
                           kern, row.tf32), 1))
    return out


def _decode_walk(vae: str, size: int, images: int, dtype: str, upcast: bool | None = None) -> dict:
    """The VAE decode's walk as diffusers runs it (unet/workload.vae_dtype: a float16 VAE whose config forces an
    upcast decodes in float32; bfloat16 as it is)."""
    from .forward import walk

    settings = () if upcast is None else (("vae_upcast", upcast),)
    return walk(vae, size, size, images, dtype, settings)


def row_ms(row: Row, shares: Shares, us: float, streams: list | None = None, factor: float = 1.0) -> dict:
    """The row's time on these shares and host (its kernels `factor` times as long: a range's end): each part
    overlapped (physics.overlap), summed over its runs."""
    out = {"eager_ms": 0.0, "gpu_ms": 0.0, "host_ms": 0.0}
    for s, n in streams or _streams(row):
        o = overlap(s.host, kernel_ms(s, shares) * factor, us)
        for k in out:
            out[k] += o[k] * n
    return out


def assumed() -> Shares:
    """The shares gpus.EFFICIENCY assumes, and sm90's kernel-table figures for the attention, unfused and minimum."""
    from .. import gpus

    k = kernel_shares()
    return Shares(gpus.efficiency("convolution", "sm90")[0], gpus.efficiency("matmul", "sm90")[0],
                  gpus.efficiency("memory", "sm90")[0], 1.0, 1.0, k["op_ms"])


def kernel_shares() -> dict:
    """What sm90's kernel table says beyond its fused kernels (planner/kernels.py's fit, its shares capped): its calls'
    projections and layouts as matmul and memory share, a kernel's minimum (its calls' minimum over their ops) and
    naive's share of the bandwidth (its self calls' cores, which its tables' passes bound)."""
    from .kernels import DATA_ARCH, arch_fit

    f = arch_fit(DATA_ARCH, "float16")["fit"]
    return {"projections": min(CEILING, 1 / f["projections"]), "op_ms": f["overhead"] / f["ops_per_call"],
            "unfused": min(CEILING, 1 / f["kernels"]["naive"]["core_self"])}


def _arch(gpu_name: str) -> str:
    from .. import gpus

    return gpus.get(gpu_name)["arch"]


def _lines(rows) -> dict[str, str]:
    """Each architecture with rows and its line (gpus.py: its GPUs' line)."""
    from .. import gpus

    return {_arch(r.gpu): gpus.get(r.gpu)["line"] for r in rows}


_ATT_LOW, _ATT_HIGH = 0.25, 4.0  # the attention factor's bounds: a quarter to four times the carried kernel fit


def _unpack(x: np.ndarray, names: list, base: Shares) -> tuple[dict, dict, dict]:
    """The parameter vector as ({arch: Shares}, {line: {share: log}}, {machine: us})."""
    d = dict(zip(names, x))
    sig = lambda z: 1 / (1 + np.exp(-np.clip(z, -30, 30)))  # noqa: E731
    archs = {}
    for a in sorted({n[1] for n in names if n[0] == "arch"}):
        att = _ATT_LOW * (_ATT_HIGH / _ATT_LOW) ** sig(d[("arch", a, "attention")])
        conv, matmul, memory = (CEILING * sig(d[("arch", a, k)]) for k in ("convolution", "matmul", "memory"))
        archs[a] = Shares(conv, matmul, memory, att, 1.0, base.op_ms)
    lines = {}
    for n in names:
        if n[0] == "line":
            lines.setdefault(n[1], {})[n[2]] = d[n]
    hosts = {n[1]: float(np.exp(d[n])) for n in names if n[0] == "host"}
    return archs, lines, hosts


def _solve(residuals, x: np.ndarray, iterations: int = 80) -> np.ndarray:
    """Levenberg-Marquardt on residuals(x) (a numeric Jacobian): the x of least squares."""
    r0, lam = residuals(x), 1e-2
    for _ in range(iterations):
        step_x = 1e-5
        jac = np.stack([(residuals(x + step_x * e) - r0) / step_x for e in np.eye(len(x))], 1)
        g, h = jac.T @ r0, jac.T @ jac
        while lam < 1e8:
            step = np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-9), -g)
            r1 = residuals(x + step)
            if r1 @ r1 < r0 @ r0:
                x, r0, lam = x + step, r1, lam / 3
                break
            lam *= 4
        if lam >= 1e8 or np.abs(step).max() < 1e-6:
            break
    return x


def fit(rows: tuple = ROWS, hosts: dict | None = None) -> dict:
    """The shares of every architecture of the rows used to fit, their lines' and (unless given) every machine's host
    (module docstring): {"archs": {arch: shares}, "lines": {line: shares}, "hosts": {machine: us}}."""
    from .. import gpus

    base, used = assumed(), [r for r in rows if r.use == "fit"]
    lines_of = _lines(used)
    names = [("arch", a, k) for a in sorted(lines_of) for k in ("convolution", "matmul", "memory", "attention")]
    names += [("line", li, k) for li in sorted(set(lines_of.values())) for k in ("convolution", "matmul", "memory",
                                                                               "attention")]
    names += [("host", m) for m in sorted({r.machine for r in used})] if hosts is None else []
    prior = {k: np.log(getattr(base, k)) for k in ("convolution", "matmul", "memory", "attention")}
    start = {("arch",): lambda n: -np.log(CEILING / (gpus.efficiency(n[2], "sm90")[0] * 0.99) - 1)
             if n[2] != "attention" else 0.0, ("line",): lambda n: prior[n[2]], ("host",): lambda n: np.log(HOST_US)}
    x0 = np.array([start[n[:1]](n) for n in names])
    streams = {id(r): _streams(r) for r in used}

    def residuals(x):
        archs, lines, fitted_hosts = _unpack(x, names, base)
        h = hosts or fitted_hosts
        out = [np.log(row_ms(r, archs[_arch(r.gpu)], h[r.machine], streams[id(r)])["eager_ms"] / r.published_ms)
               for r in used]
        for a, li in lines_of.items():
            out += [np.sqrt(LAMBDA) * (np.log(getattr(archs[a], k)) - lines[li][k]) for k in prior]
        out += [np.sqrt(MU) * (v - prior[k]) for li in lines.values() for k, v in li.items()]
        out += [np.sqrt(HOST_PRIOR) * np.log(us / HOST_US) for us in fitted_hosts.values()]
        return np.array(out)

    archs, lines, fitted_hosts = _unpack(_solve(residuals, x0), names, base)
    pooled = {li: Shares(*(float(np.exp(v[k])) for k in ("convolution", "matmul", "memory", "attention")),
                         1.0, base.op_ms)
              for li, v in lines.items()}
    return {"archs": {a: asdict(s) for a, s in archs.items()}, "lines": {li: asdict(s) for li, s in pooled.items()},
            "hosts": hosts or fitted_hosts}


def shares_for(gpu: dict, fitted: dict) -> tuple[Shares, str, bool]:
    """(the GPU's shares, where they come from, whether its own rows fitted them): its architecture's fitted shares
    (another card's said so); sm90's kernel table (its convolutions the datacenter line's); else its line's."""
    from .kernels import DATA_ARCH

    arch = gpu["arch"]
    own = any(r.gpu == gpu["name"] and r.use == "fit" for r in ROWS)
    if arch in fitted["archs"]:
        cards = sorted({r.gpu for r in ROWS if r.use == "fit" and _arch(r.gpu) == arch})
        how = "fitted on its rows" if own else f"carried from the {', '.join(cards)} (its architecture, another card)"
        return Shares(**fitted["archs"][arch]), f"{arch}'s shares {how}", own
    line = fitted["lines"].get(gpu["line"]) or fitted["lines"]["datacenter"]
    if arch == DATA_ARCH:
        k = kernel_shares()
        return (Shares(line["convolution"], k["projections"], k["projections"], 1.0, 1.0, k["op_ms"]),
                f"{arch}'s kernel table (its matmul and memory shares from its attention calls' own kernels), its "
                f"convolutions the {gpu['line']} line's (no convolution in its kernel table)", False)
    return Shares(**line), f"the {gpu['line']} line's shares (no row of {arch}: carried, assumed)", False


def _cached(what: str, make):
    """make()'s answer, kept in the kernel fits' cache under what it rests on (the rows, the fit's version, the tables
    and kernel data the model reads)."""
    from ..env import cache_dir
    from ..store import add_to_cache, read_cache
    from .kernels import DATA_ARCH, FITS_FILE, arch_fit, model_key

    key = json.dumps([what, _code(), *model_key(), [asdict(r) for r in ROWS], arch_fit(DATA_ARCH, "float16")["data"]])
    path = cache_dir() / FITS_FILE
    found = read_cache(path).get(key)
    if found is None:
        found = make()
        add_to_cache(path, key, found)
    return found


def _code() -> str:
    """The fit's code, hashed (this module, physics.py, kernels.py, host.py): an edit is a new fit."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("published.py", "physics.py", "kernels.py",
                                                                      "host.py"))).hexdigest()[:16]


def predicted(row: Row, fitted: dict, factor: float = 1.0, us: float | None = None) -> dict:
    """The row on the GPU's shares of the fit (shares_for) and its machine's host (else the published machines'
    middle, host_range), or us: {"predicted_ms", "error", "bound", "gpu_ms", "host_ms", "how"}; factor scales its
    kernels (a range's end)."""
    from .. import gpus

    shares, how, _ = shares_for(gpus.get(row.gpu), fitted)
    us = us or fitted["hosts"].get(row.machine) or host_range(gpus.get(row.gpu), fitted)[0]
    t = row_ms(row, shares, us, factor=factor)
    return {"row": row, "predicted_ms": t["eager_ms"], "error": t["eager_ms"] / row.published_ms - 1,
            "bound": "host" if t["host_ms"] > t["gpu_ms"] else "gpu", "gpu_ms": t["gpu_ms"], "host_ms": t["host_ms"],
            "how": how, "host_us": us}


def model() -> dict:
    """The fit of every row used to fit, with how sure it is: "u_fit" (the fit's worst miss of its own rows) and
    "u_carried" (the worst miss of leave one GPU out, over every row of a GPU with rows used to fit), and that leave
    one GPU out's predictions ("logo": per row index, its predicted ms and how its shares were carried)."""
    def make():
        full = fit()
        u_fit = max(_miss(predicted(r, full)["predicted_ms"], r.published_ms) for r in ROWS if r.use == "fit")
        logo, fits = {}, {}
        for gpu in dict.fromkeys(r.gpu for r in ROWS if r.use == "fit"):
            mine = fits[gpu] = fit(tuple(r for r in ROWS if r.gpu != gpu), full["hosts"])
            for i, r in enumerate(ROWS):
                if r.gpu == gpu:
                    p = predicted(r, mine)
                    logo[i] = {"predicted_ms": p["predicted_ms"], "how": p["how"], "bound": p["bound"]}
        u_carried = max(_miss(logo[i]["predicted_ms"], r.published_ms) for i, r in enumerate(ROWS) if i in logo)
        return {**full, "u_fit": _up(u_fit), "u_carried": _up(u_carried), "logo": {str(i): v for i, v in logo.items()},
                "logo_fits": fits}

    return _cached("published-model", make)


def _up(u: float) -> float:
    """A miss rounded up to the next 5%, as a range is printed."""
    return float(np.ceil(u * 20 - 1e-9) / 20)


def _miss(predicted_ms: float, published_ms: float) -> float:
    """How far a prediction is from the figure, as a factor less 1 either way (0.33: a third over or under)."""
    return max(predicted_ms / published_ms, published_ms / predicted_ms) - 1


def host_range(gpu: dict | None, fitted: dict) -> tuple[float, float, float, str]:
    """(the host's us an op, its low and high, where it comes from): the GPU's published machines' where its rows fit
    some (their middle, geometric, with the fastest and the slowest, each within the fit's worst miss), else (or with
    no GPU) every published machine's so."""
    hosts, u = fitted["hosts"], 1 + fitted.get("u_fit", 0.0)
    mine = sorted({r.machine for r in ROWS if gpu and r.gpu == gpu["name"] and r.use == "fit"})
    if mine:
        us = [hosts[m] for m in mine]
        mid = float(np.exp(np.mean(np.log(us))))
        return mid, min(us) / u, max(us) * u, (
            f"{' and '.join(mine)}'s host, {' and '.join(f'{x:.1f}' for x in us)} us an op (fitted to its rows; "
            f"{min(us) / u:.1f} to {max(us) * u:.1f})")
    lo, hi = min(hosts.values()) / u, max(hosts.values()) * u  # the fastest and the slowest, each within the fit's miss
    mid = float(np.exp(np.mean(np.log(list(hosts.values())))))
    each = ", ".join(f"{m} {us:.1f}" for m, us in sorted(hosts.items(), key=lambda kv: kv[1]))
    return mid, lo, hi, (f"a published machine's host: {lo:.1f} to {hi:.1f} us an op ({each}; {mid:.1f} the middle); "
                         "--host-us-per-op US for yours, --host-us-per-op here for this machine's")


def uncertainty(gpu: dict, fitted: dict, dtype: str = "float16") -> tuple[float, str]:
    """(how far the GPU's kernels may be from their prediction, as a share, why): the fit's worst miss of its own
    rows where its own rows fitted its shares, else (or in float32, whose kernels are half precision's carried: no
    row is fitted in it) the worst miss of leave one GPU out."""
    if dtype == "float32":
        return fitted["u_carried"], (f"+-{fitted['u_carried']:.0%}: float32's kernels carried from half precision's "
                                     "(no float32 row fitted), as far as a GPU predicted without its own rows misses")
    if shares_for(gpu, fitted)[2]:
        return fitted["u_fit"], f"+-{fitted['u_fit']:.0%}: the fit's worst miss of its own rows"
    return fitted["u_carried"], (f"+-{fitted['u_carried']:.0%}: the worst miss of a GPU predicted without its own rows "
                                 "(leave one GPU out)")


PUBLISHED_SHORT = "published limits, shares fitted to published timings"


def published_calibration(gpu: dict, dtype: str, results=None, host_us: float | str | None = None) -> dict:
    """The time model of a GPU of the table, in the shape of a calibration (planner/timing.py): "physics" its shares
    (shares_for), how sure (uncertainty) and its host with its range (host_range, or host_us given:
    host.host_us_per_op);
    "kernels" each fused attention kernel's fit (planner/kernels.gpu_kernels: its architecture's kernel times, kept
    with the project and under results, else carried); "rest" its shares as the rest fit's coefficients; "published"
    where each figure came from."""
    from . import kernels
    from .host import host_us_per_op

    fitted = model()
    shares, how, own = shares_for(gpu, fitted)
    u, u_how = uncertainty(gpu, fitted, dtype)
    rest_basis = ("fitted rows" if own else "another card's fitted rows" if gpu["arch"] in fitted["archs"] else
                  "measured kernels (its convolutions carried)" if gpu["arch"] == kernels.DATA_ARCH else "carried shares")
    if host_us is None:
        us, lo, hi, host_source = host_range(gpu, fitted)
    else:
        us, host_source = host_us_per_op(host_us)
        lo = hi = us
    kern = kernels.gpu_kernels(gpu, dtype, results)
    said = ", ".join(f"{k} {getattr(shares, k):.0%}" for k in ("convolution", "matmul", "memory"))
    unfused = f"x{shares.unfused:.2f}" if shares.unfused != 1.0 else "as measured"
    carried = f"attention kernel times fitted on {kern['data']}" if kern["data_arch"] == gpu["arch"] else \
        f"attention kernels fitted on {kern['data']}, carried to {gpu['arch']} by published shares"
    dtype_note = f"; {kern['dtype_note']}" if kern["dtype_note"] else ""
    text = (f"an estimate, not a measurement: the {gpu['name']}'s published figures ({gpu['source']}), at "
            f"{gpus_sustained(gpu)}; {how} ({said}); its fused {carried}, x{shares.attention:.2f}; unfused ones "
            f"(their table traffic) at the shares of the bandwidth sm90's reached, {unfused}; kernels {u_how}"
            f"{dtype_note}")
    summary = f"{PUBLISHED_SHORT}: {how}; {carried}; kernels {u_how}{dtype_note}"
    return {"physics": {"shares": asdict(shares), "u": u, "how": how, "host_us": us, "host_low": lo, "host_high": hi,
                        "host_source": host_source, "rest_basis": rest_basis, "data_arch": kernels.DATA_ARCH},
            "gpu": gpu["name"], "kernels": kern["kernels"], "kernel_data": kern["data"], "published": text,
            "summary": summary,
            "per_backend": {}, "backends": {}, "rest": {dtype: {"coefficients": shares.coefficients()}},
            "generation": None, "host": {"us_per_op": us, "source": host_source}}


def gpus_sustained(gpu: dict) -> str:
    from .. import gpus

    return gpus.sustained(gpu)[1]


def check() -> list[dict]:
    """Every row against the fit of the rows used to fit (predicted) and, with its GPU left out (model()'s "logo"),
    its prediction, error and range: the kernels within u_carried, the host its machine's, and with the host unknown
    too (host_range's: the fastest to the slowest published machine): whether the published time is inside both; and
    inside the range sized on the other GPUs' misses alone ("inside_without_its_gpu": the range's own out-of-sample
    check)."""
    from .. import gpus

    m, out = model(), []
    lo_host, hi_host = host_range(None, m)[1:3]
    misses = {i: (ROWS[int(i)].gpu, _miss(v["predicted_ms"], ROWS[int(i)].published_ms)) for i, v in m["logo"].items()}
    for i, r in enumerate(ROWS):
        f = predicted(r, m)
        logo = m["logo"].get(str(i))
        if logo:
            h = m["hosts"].get(r.machine)
            fast, slow = (h / (1 + m["u_fit"]), h * (1 + m["u_fit"])) if h else (lo_host, hi_host)
            u_own = 1 + _up(max(x for g, x in misses.values() if g != r.gpu))
            ends = [predicted(r, m["logo_fits"][r.gpu], factor=k, us=us)["predicted_ms"]
                    for k, us in ((1 / (1 + m["u_carried"]), fast), (1 + m["u_carried"], slow),
                                  (1 / (1 + m["u_carried"]), lo_host), (1 + m["u_carried"], hi_host),
                                  (1 / u_own, fast), (u_own, slow))]
            f.update(logo_ms=logo["predicted_ms"], logo_error=logo["predicted_ms"] / r.published_ms - 1,
                     logo_how=logo["how"], low_ms=ends[0], high_ms=ends[1], unknown_low_ms=ends[2],
                     unknown_high_ms=ends[3], gpu_arch=gpus.get(r.gpu)["arch"])
            f["inside"] = ends[0] <= r.published_ms <= ends[1]
            f["inside_unknown_host"] = ends[2] <= r.published_ms <= ends[3]
            f["inside_without_its_gpu"] = ends[4] <= r.published_ms <= ends[5]
        out.append(f)
    return out


def format_check(found: list[dict]) -> str:
    """docs/timing.md's table (python -m profiler.bench --only published): each row fitted and with its GPU left out,
    its range, the fit's shares per architecture, and the summary."""
    head = (f"  {'what':34s} {'GPU':10s} {'img':>3s} {'published':>9s} {'fitted':>8s} {'error':>6s} {'bound':5s} "
            f"{'without its GPU':>16s} {'its range':>19s} {'in':>3s}  use")
    lines = ["published timings against the time model (a U-Net step, or a whole generation, ms; error: predicted "
             "over published; without its GPU: predicted from a fit to the other GPUs' rows alone, every machine's "
             "host as fitted; its range: that prediction's kernels within the worst such miss):", head]
    for f in found:
        r = f["row"]
        logo = f"{f['logo_ms']:9.1f} {100 * f['logo_error']:+5.0f}%" if "logo_ms" in f else "-"
        span = f"{f['low_ms']:8.1f}-{f['high_ms']:<9.1f}" if "low_ms" in f else "-"
        inside = ("yes" if f["inside"] else "NO") if "inside" in f else "-"
        lines.append(f"  {r.what:34s} {r.gpu:10s} {r.images:3d} {r.published_ms:9.1f} {f['predicted_ms']:8.1f} "
                     f"{100 * f['error']:+5.0f}%  {f['bound']:5s} {logo:>16s} {span:>19s} {inside:>3s}  "
                     f"{'fit' if r.use == 'fit' else 'check: not fitted'} {r.source}")
    return "\n".join(lines + _shares_lines() + _summary_lines(found))


def _shares_lines() -> list[str]:
    """The fit's shares per architecture and line, and the hosts: each share at most the ceiling, said where at it."""
    m = model()
    out = ["", f"the fit's shares (of the sustained peak; at most {CEILING:.0%}, * at it), attention factor over the "
               "carried kernel fit:"]
    for name, s in [*m["archs"].items(), *((f"{k} line", v) for k, v in m["lines"].items())]:
        said = "  ".join(f"{k} {s[k]:.0%}{'*' if s[k] >= CEILING - 1e-6 else ''}"
                         for k in ("convolution", "matmul", "memory"))
        out.append(f"  {name:16s} {said}  attention x{s['attention']:.2f}")
    k = kernel_shares()
    out.append(f"  sm90 (kernel table) matmul and memory {k['projections']:.0%}, naive's self calls {k['unfused']:.0%} of "
               f"the bandwidth (unfused kernels elsewhere at sm90's shares of the bandwidth, assumed), a kernel at "
               f"least {k['op_ms'] * 1e3:.2f} us")
    out.append("  hosts: " + ", ".join(f"{m_} {us:.1f} us an op" for m_, us in m["hosts"].items()))
    return out


def _summary_lines(found: list[dict]) -> list[str]:
    m = model()
    fit_rows = [f for f in found if f["row"].use == "fit"]
    held = [f for f in found if "logo_error" in f]
    worst = max(held, key=lambda f: abs(f["logo_error"]))
    gpu_bound = [f for f in found if f["row"].use == "check" and f["bound"] == "gpu"]
    lines = ["", f"  fitted: {len(fit_rows)} rows, worst miss {100 * m['u_fit']:.0f}% (u_fit)",
             f"  leave one GPU out: {len(held)} rows, worst {100 * abs(worst['logo_error']):.0f}% ({worst['row'].what}, "
             f"{worst['row'].gpu}, {worst['row'].images} images); inside its range: "
             f"{sum(f['inside'] for f in held)} of {len(held)}; with the host unknown too: "
             f"{sum(f['inside_unknown_host'] for f in held)} of {len(held)} (the range is sized on these misses); "
             f"sized on the other GPUs' misses alone: {sum(f['inside_without_its_gpu'] for f in held)} of {len(held)}"]
    if gpu_bound:
        lines.append(f"  not fitted (checks), gpu-bound: {len(gpu_bound)} rows, worst "
                     f"{100 * max(abs(f['error']) for f in gpu_bound):.0f}%")
    return lines + [f"  {k}: {v}" for k, v in SOURCES.items()]


def sources_of(gpu: dict) -> dict:
    """Where a GPU's time model comes from (attnprof gpus): its attention kernels', its other kernels' and its host's."""
    from .kernels import DATA_ARCH

    m = model()
    shares, how, _ = shares_for(gpu, m)
    kernels = ("fitted on the H200 run's kernel times (configs/kernels/)" if gpu["arch"] == DATA_ARCH else
               f"the H200's kernel fit carried to {gpu['arch']} by published shares, x{shares.attention:.2f}")
    return {"kernels": kernels, "rest": how, "host": host_range(gpu, m)[3]}
