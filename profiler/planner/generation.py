"""A whole generation's time before it runs: attnprof plan --pipeline NAME --size WxH --steps N.

A generation of a Stable Diffusion pipeline (planner/pipeline.py's parts, those fit --pipeline knows) is: the text
encoders, each once for the prompt and once for the negative prompt under classifier-free guidance (guidance > 1);
N denoising steps, each a U-Net forward (with its ControlNet's where asked) at the images' batch, twice it under
guidance; one VAE decode at the images' batch; and the pipeline's own work around them (the scheduler's steps, the
latents, the image's post-processing). Each forward's time is the time model's (planner/timing.py: its attention
calls per backend and the rest of its ops per op class, on this device calibrated on its stored runs and recorded
generations, or on a GPU of the table by its published figures and efficiencies), the pipeline's own work the
recorded generations' (planner/calibration.py; not counted where there are none). Every figure names its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..fmt import long_ms, table, wrapped
from ..spec import InputError
from . import timing
from .calibration import LOADED_AS, images, named, public_config, published_calibration, record_backend
from .pipeline import PIPELINES, pipeline_name, text_ops

VIDEO_PIPELINES = {"animatediff-sd15": {"unet": "animatediff-sd15", "vae": "sd15-vae", "text": ("clip-l",),
                                        "frames": 16}}


@dataclass(frozen=True)
class GenerationSpec:
    """What one generation runs: the pipeline, the image size, the steps, the guidance (above 1: classifier-free
    guidance, the U-Net and the text encoders at twice the batch), the video frames (a video pipeline's), the
    attention backend every part runs, the dtype, the images per prompt, a ControlNet."""

    pipeline: str
    width: int
    height: int
    steps: int = 30
    guidance: float = 7.5
    frames: int | None = None
    backend: str = "sdpa"
    options: dict = field(default_factory=dict)
    dtype: str = "float16"
    batch: int = 1
    controlnet: bool = False
    vae_upcast: bool | None = None  # the decode in float32 (None: as diffusers does: the config's force_upcast where
    # the dtype is float16)

    def __post_init__(self):
        name = pipeline_name(self.pipeline, tuple(VIDEO_PIPELINES))
        object.__setattr__(self, "pipeline", name)
        if self.steps < 1:
            raise InputError(f"--steps {self.steps}: a generation takes at least one step")
        if self.frames is not None and name not in VIDEO_PIPELINES:
            raise InputError(f"--frames: the {name} pipeline makes images; use a video pipeline "
                             f"({', '.join(VIDEO_PIPELINES)})")
        if self.controlnet and "controlnet" not in self.parts:
            raise InputError(f"--controlnet: the {name} pipeline has no ControlNet in the registry")

    @property
    def parts(self) -> dict:
        return {**PIPELINES, **VIDEO_PIPELINES}[self.pipeline]

    @property
    def cfg(self) -> bool:
        return self.guidance > 1

    @property
    def images(self) -> int:
        """What the VAE decodes: the images, times the frames of a video."""
        return self.batch * (self.frames or self.parts.get("frames") or 1)


PUBLISHED = "published limits and efficiencies"


def predict_generation(spec: GenerationSpec, limits: dict, calibration: dict | None, gpu: dict | None,
                       device: str) -> dict:
    """{"spec", "parts": [{"part", "model", "forwards", "each_ms", "total_ms", "total_s", "attention_ms", "source", and
    on a GPU "gpu_ms", "host_ms", "graph_ms" (each forward's), "bound"}], "total_ms", "total_s", "attention_ms",
    "attention_share", "largest_blocks", "device"}, and on a GPU "graph_total_ms" / "graph_total_s": the same
    generation with its denoiser replayed from CUDA graphs (torch.compile's reduce-overhead on the U-Net), "bound"
    (the denoiser's) and "host" (where the host figure comes from)."""
    p, step_batch = spec.parts, spec.batch * (2 if spec.cfg else 1)
    frames = spec.frames or p.get("frames")
    unet_settings = (("frames", frames),) if frames else ()
    parts = [_text_part(name, spec, limits, calibration, gpu) for name in p["text"]]
    unet = _forward_part("denoise", p["unet"], spec, step_batch, unet_settings, limits, calibration, gpu, device)
    parts.append(unet)
    if spec.controlnet:
        parts.append(_forward_part("denoise", p["controlnet"], spec, step_batch, (), limits, calibration, gpu, device))
    vae = () if spec.vae_upcast is None else (("vae_upcast", spec.vae_upcast),)
    parts.append(_forward_part("decode", p["vae"], spec, spec.images, vae, limits, calibration, gpu, device))
    parts.append(_overhead_part(spec, calibration))
    total = sum(x["total_ms"] for x in parts)
    attention = sum(x["attention_ms"] or 0.0 for x in parts)
    blocks = sorted(unet.pop("blocks"), key=lambda r: -r["predicted_time_ms"])[:5]
    ends = {end: sum(x[f"total_{end}_ms"] for x in parts) if all(x[f"total_{end}_ms"] is not None for x in parts)
            else None for end in ("low", "high")}
    out = {"spec": {**spec.__dict__, "cfg": spec.cfg, "step_batch": step_batch, "images": spec.images},
           "parts": [{k: v for k, v in x.items() if k != "blocks"} for x in parts], "total_ms": total,
           "total_s": total / 1e3, **{f"total_{e}_{u}": v if v is None else v / d for e, v in ends.items()
                                      for u, d in (("ms", 1), ("s", 1e3))},
           "attention_ms": attention, "attention_share": attention / total if total else None,
           "largest_blocks": [{"block": r["block"], "kind": r["kind"], "tokens_q": r["tokens_q"],
                               "tokens_k": r["tokens_k"], "each_ms": r["predicted_time_ms"],
                               "total_ms": r["predicted_time_ms"] * spec.steps} for r in blocks],
           "device": gpu["name"] if gpu else f"this machine's {device}",
           "published": (calibration or {}).get("published")}
    if "bound" in unet:  # a GPU: the host priced apart, and what CUDA graphs on the denoiser would save
        graphed = total - sum(x["total_ms"] - x["graph_ms"] * x["forwards"] for x in parts if x["part"] == "denoise")
        out.update(graph_total_ms=graphed, graph_total_s=graphed / 1e3, bound=unet["bound"],
                   host=calibration["host"]["source"], time_basis=unet.get("time_basis"))
    return out


def _ends(out: dict, t: dict) -> dict:
    """A part's range (total_low_ms, total_high_ms, each_*), from its prediction's: a GPU's range, else a calibrated
    time within its expected error, a roofline floor from itself up (high None), none where its error is unknown."""
    each = out["each_ms"]
    if "predicted_forward_low_ms" in t:
        low, high = t["predicted_forward_low_ms"], t["predicted_forward_high_ms"]
    elif t.get("time_kind") == "floor":
        low, high = each, None
    elif t.get("time_error_pct") is not None and t["time_error_pct"] == t["time_error_pct"]:
        e = t["time_error_pct"] / 100
        low, high = each / (1 + e), each * (1 + e)
    else:
        low = high = None
    n = out["forwards"]
    return {"each_low_ms": low, "each_high_ms": high, "total_low_ms": None if low is None else low * n,
            "total_high_ms": None if high is None else high * n}


def _forward_part(part: str, model: str, spec: GenerationSpec, batch: int, settings: tuple, limits: dict,
                  calibration: dict | None, gpu: dict | None, device: str) -> dict:
    p = timing.walked_plan(model, spec.width, spec.height, batch, spec.dtype, settings)
    t = timing.predict(p, spec.backend, spec.options, limits, calibration, gpu, device)
    forwards = spec.steps if part == "denoise" else 1
    out = {"part": part, "model": model, "batch": batch, "forwards": forwards,
           "each_ms": t["predicted_forward_time_ms"], "total_ms": t["predicted_forward_time_ms"] * forwards,
           "attention_ms": t["predicted_attention_time_ms"] * forwards,
           "source": calibration["summary"] if t["time_published"] else t["time_source"],
           "time_kind": t["time_kind"], "time_error_pct": t["time_error_pct"],
           "time_error_why": t.get("time_error_why"), "blocks": p["blocks"]}
    if "bound" in t:
        out.update(gpu_ms=t["predicted_gpu_time_ms"], host_ms=t["predicted_host_time_ms"],
                   graph_ms=t["predicted_graph_time_ms"], bound=t["bound"], time_basis=t.get("time_basis"))
    return _seconds({**out, **_ends(out, t)})


def _seconds(out: dict) -> dict:
    """A part's totals in seconds beside its ms: total_s, total_low_s, total_high_s."""
    return {**out, **{f"total{e}_s": None if out[f"total{e}_ms"] is None else out[f"total{e}_ms"] / 1e3
                      for e in ("", "_low", "_high")}}


def _text_part(name: str, spec: GenerationSpec, limits: dict, calibration: dict | None, gpu: dict | None) -> dict:
    """A text encoder, once per prompt (and once more for the negative prompt under guidance): its ops at the rest's
    calibration (its attention is CLIP's own, counted among its ops); on a GPU of the table op by op with its host
    (planner/physics.py), on a GPU box its host apart."""
    dev = timing.Device.of(limits, spec.dtype)
    ops = text_ops(name, spec.dtype, spec.batch)
    fit = (calibration or {}).get("rest", {}).get(spec.dtype)
    each = timing.apply(fit, dev.rest_features(ops), timing.roof_ms(ops, dev))
    forwards = 2 if spec.cfg else 1
    published = (calibration or {}).get("published")
    source = ((calibration.get("summary") or PUBLISHED) if published else
              f"the rest of the forwards' calibration ({fit['cells']} forwards), on its ops" if fit else
              "roofline bound of its ops")
    out = {"part": "text", "model": name, "batch": spec.batch, "forwards": forwards, "each_ms": each,
           "attention_ms": None, "source": source}
    t = {"time_kind": "calibrated" if fit else "floor", "time_error_pct": None}
    w = {"rows": [], "calls": [], "rest": ops, "at": []}
    if (calibration or {}).get("physics"):
        from .physics import price

        t = price({"blocks": [], "dtype": spec.dtype}, w, spec.backend, spec.options, gpu, calibration)
    elif (calibration or {}).get("host"):
        t = timing.host_times(calibration["host"], [], each, fit, w, dev, spec.backend, spec.options, spec.dtype)
    if "bound" in t:
        out.update(each_ms=t["predicted_forward_time_ms"], gpu_ms=t["predicted_gpu_time_ms"],
                   host_ms=t["predicted_host_time_ms"], graph_ms=t["predicted_graph_time_ms"], bound=t["bound"])
    out["total_ms"] = out["each_ms"] * forwards
    return _seconds({**out, **_ends(out, t)})


def _overhead_part(spec: GenerationSpec, calibration: dict | None) -> dict:
    """The pipeline's own work: the recorded generations' fit, or nothing counted."""
    fit = (calibration or {}).get("generation")
    features = {"steps": float(spec.steps), "pixels": float(spec.width * spec.height * spec.images), "one": 1.0}
    ms = timing.apply(fit, features, 0.0) if fit else 0.0
    source = (f"calibrated on {fit['cells']} recorded generations of this device" if fit else
              "not counted: no recorded generation of this device to calibrate on (attnprof record)")
    out = {"part": "pipeline", "model": "scheduler, latents, images", "batch": spec.batch, "forwards": spec.steps,
           "each_ms": ms / spec.steps, "total_ms": ms, "attention_ms": None, "source": source}
    if not fit:  # nothing counted
        return _seconds({**out, "each_low_ms": 0.0, "each_high_ms": 0.0, "total_low_ms": 0.0, "total_high_ms": 0.0})
    return _seconds({**out, **_ends(out, {"time_kind": "calibrated", "time_error_pct": fit.get("loo_error_pct")})})


def by_gpu(pipeline: str, width: int, height: int, steps: int, names: list[str], dtype: str = "float16",
           batch: int = 1) -> list[dict]:
    """A generation's predicted time on every GPU of the table, per backend, from the published figures and
    efficiencies (the dashboard's Planner page): one row per (GPU, backend) whose dtype and kernels the GPU has."""
    from .. import gpus

    rows = []
    for name in gpus.names():
        gpu = gpus.get(name)
        if gpu["tflops"].get(dtype) is None:
            continue
        limits, calibration = gpus.limits(gpu, dtype), published_calibration(gpu, dtype)
        for backend in names:
            spec = GenerationSpec(pipeline, width, height, steps, backend=backend, dtype=dtype, batch=batch)
            g = predict_generation(spec, limits, calibration, gpu, "cuda")
            rows.append({"gpu": name, "backend": backend, "total_s": g["total_ms"] / 1e3,
                         "attention_share": g["attention_share"], "steps": steps, "size": f"{width}x{height}"})
    return rows


def format_generation(g: dict) -> str:
    s = g["spec"]
    how = (f"{s['pipeline']} pipeline, {s['width']}x{s['height']}, {s['steps']} steps, guidance {s['guidance']:g}"
           + (f" (classifier-free: the U-Net at batch {s['step_batch']})" if s["cfg"] else " (no classifier-free "
              "guidance)") + (f", {s['frames']} frames" if s.get("frames") else "")
           + f", {s['dtype']}, {s['backend']} attention on {g['device']}")
    gpu = "bound" in g
    rows = [_part_row(x, g, gpu) for x in g["parts"]]
    cols = [(c, c) for c in ("part", "model", "runs", "each", "total", "likely", "attention", "share")] + \
        ([("GPU each", "GPU"), ("host each", "host"), ("bound", "bound")] if gpu else [])
    top = [{"block": b["block"], "kind": b["kind"], "tokens": f"{b['tokens_q']} x {b['tokens_k']}",
            "each step": long_ms(b["each_ms"]), "all steps": long_ms(b["total_ms"])} for b in g["largest_blocks"]]
    sources = [f"  {x['part']} ({x['model']}): {x['source']}" for x in g["parts"]]
    sources += [f"  host: {g['host']}"] if gpu else []
    sources += [f"  {PUBLISHED}: {g['published']}"] if g.get("published") else []
    return "\n".join([how, "", table(rows, cols), "", *_total_lines(g, gpu), "", "largest attention calls of the U-Net:",
                      table(top, [(c, c) for c in top[0]]) if top else "-", "", "each figure from:",
                      *wrapped(sources)])


def _total_lines(g: dict, gpu: bool) -> list[str]:
    """'predicted total: 3.99 s (likely 3.40 to 4.59 s; 35.9% of it attention)' as far as the U-Net's evidence goes
    (timing.said_time), and on a GPU its bound and what CUDA graphs save."""
    s = g["spec"]
    share = f"{100 * g['attention_share']:.1f}% of it attention" if g["attention_share"] is not None else ""
    low, high = g.get("total_low_s"), g.get("total_high_s")
    span = f"likely {low:,.2f} to {high:,.2f} s" if low is not None and high is not None else ""
    extra = "; ".join(x for x in (span, share) if x)
    denoise = next(x for x in g["parts"] if x["part"] == "denoise")  # its evidence is the total's (timing.said_time)
    said = timing.said_time(f"{g['total_s']:,.2f} s", denoise, floor_note=False)
    if not said:
        return [f"predicted total: none: the U-Net's time has no evidence to print it by: {timing.wrong_text(denoise)}"]
    lines = [f"predicted total: {said}" + (f" ({extra})" if extra else "") +
             ("; the U-Net's time is its roofline floor, a lower bound (no stored run of this device and backend to "
              "calibrate on)" if denoise["time_kind"] == "floor" else "")]
    if gpu:
        saves = "" if g["bound"] == "host" else ", nothing saved: its kernels set the pace"
        lines.append(f"  eager {g['total_s']:,.2f} s, {g['bound']}-bound at batch {s['step_batch']} (the U-Net); with "
                     f"CUDA graphs on the U-Net about {g['graph_total_s']:,.2f} s{saves} (torch.compile "
                     f"mode=reduce-overhead, or torch.cuda.CUDAGraph: the host's launches gone, its kernels as they are)"
                     + (f"; its time rests on {g['time_basis']}" if g.get("time_basis") else ""))
    return wrapped(lines)


def _part_row(x: dict, g: dict, gpu: bool) -> dict:
    """A part's row: its forwards, each one's time and all of them, as far as its evidence goes (a roofline floor
    'at least', none where its calibration's error is over timing.MAX_ERROR_PCT)."""
    wrong, floor = timing.too_wrong(x), "at least " if x.get("time_kind") == "floor" else ""
    ms = lambda v: "-" if wrong else floor + long_ms(v) if v is not None else "-"  # noqa: E731
    return {"part": x["part"], "model": x["model"], "runs": f"{x['forwards']} x batch {x['batch']}",
            "each": ms(x["each_ms"]), "total": ms(x["total_ms"]), "attention": ms(x["attention_ms"]),
            "likely": "-" if wrong or x.get("total_low_ms") is None or x.get("total_high_ms") is None else
            f"{long_ms(x['total_low_ms'])} to {long_ms(x['total_high_ms'])}",
            "share": f"{100 * x['total_ms'] / g['total_ms']:.1f}%" if g["total_ms"] and not wrong else "-",
            **({"GPU": ms(x.get("gpu_ms")), "host": ms(x.get("host_ms")), "bound": x.get("bound", "-")} if gpu
               else {})}


def generation_spec(run, manifest: dict, cell: dict):
    """The GenerationSpec (planner/generation.py) a recorded generation ran: its pipeline the registry's whose U-Net
    its denoiser is, its size, steps, guidance, backend, dtype and images; None where its pipeline is not one the
    planner knows."""

    facts = manifest.get("record") or {}
    configs = ((facts.get("cells") or {}).get(cell["cell_id"]) or facts).get("configs") or {}  # the cell's own
    unet = named(configs["unet"]["class"], configs["unet"]["config"]) if "unet" in configs else None
    name = next((n for n, p in PIPELINES.items() if p["unet"] == unet), None)
    backend = record_backend(cell)
    if not name or not backend:
        return None
    _, blocks = run.read()
    return GenerationSpec(name, int(cell["width"]), int(cell["height"]), int(cell["steps"]),
                          float(cell["guidance"] or 1.0), backend=backend, dtype=cell["dtype"],
                          batch=images(cell, blocks))


def pipeline_spec(pipe, args: tuple, kwargs: dict, backend: str | None):
    """The GenerationSpec of a diffusers pipeline call about to run (its size, steps, guidance and images as the
    pipeline's own defaults give them where the call does not), or None where its U-Net is not a registry model's."""
    unet = getattr(pipe, "unet", None)
    model = named(type(unet).__name__, public_config(unet)) if unet is not None else None
    name = next((n for n, p in PIPELINES.items() if p["unet"] == model), None)
    if name is None:
        return None
    if backend is None:
        kinds = {type(p).__name__ for p in unet.attn_processors.values()}
        backend = LOADED_AS.get(kinds.pop()) if len(kinds) == 1 else None
    if backend is None:
        return None
    size = unet.config.sample_size * getattr(pipe, "vae_scale_factor", 8)
    prompt = kwargs.get("prompt", args[0] if args else None)
    prompts = len(prompt) if isinstance(prompt, list) else 1
    return GenerationSpec(name, int(kwargs.get("width") or size), int(kwargs.get("height") or size),
                          int(kwargs.get("num_inference_steps") or 50), float(kwargs.get("guidance_scale", 7.5)),
                          backend=backend, dtype=str(unet.dtype).removeprefix("torch."),
                          batch=prompts * int(kwargs.get("num_images_per_prompt") or 1))
