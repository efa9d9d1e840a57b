"""attnprof fit --pipeline: the largest image a whole generation fits, phase by phase.

A Stable Diffusion generation runs three phases, each with what stays resident on the device beside it:
- text: the text encoders (CLIP-L; for SDXL also OpenCLIP bigG), built from their real classes (transformers) on
  fake tensors, at 77 tokens, twice the batch under classifier-free guidance (the prompt and the negative prompt);
- denoise: the U-Net (with its ControlNet, IP-Adapter tokens, ToMe as asked), twice the batch under CFG;
- decode: the VAE's decoder at the batch (one image at a time with slicing), in float32 where the VAE's config
  forces an upcast (SDXL's), tiled where asked.
What is resident follows the offload (diffusers' names): none keeps every model on the device (its default);
model (enable_model_cpu_offload) keeps only the phase's own models; sequential (enable_sequential_cpu_offload)
streams the phase's weights one module at a time, so about its largest module is resident.

A phase's need at a size is what is resident beside its model plus its forward's peak (planner/forward.py, the same
fake-tensor trace as attnprof plan). The largest image is found per phase with attnprof fit's search (every 64-pixel
step screened, the answer traced exactly), against the budget less what the other phases leave resident, and the
smallest of those is the answer; a tiled decode (whose ops change with the size) is traced exactly at that answer
and a step at a time below it. Left out: the CUDA context and library workspaces (as for attnprof plan), the
scheduler's and the latents' few MiB, IP-Adapter's image encoder.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..unet import models
from ..fmt import human_bytes, table
from ..spec import InputError
from .fit import BUCKETS, grid
from .fit import fit as fit_one
from .forward import LEFT_OUT, LiveBytes, fake_mode, trace

PIPELINES = {
    "sd15": {"unet": "sd15", "vae": "sd15-vae", "controlnet": "sd15-controlnet", "text": ("clip-l",)},
    "sdxl": {"unet": "sdxl-base", "vae": "sdxl-vae", "controlnet": "sdxl-controlnet",
             "text": ("clip-l", "openclip-bigg")},
    # docs/examples/generate.py's offline pipeline: SD 1.5's topology with few channels (tests, CPU calibration)
    "tiny-sd15": {"unet": "tiny-sd15", "vae": "tiny-vae", "controlnet": "tiny-sd15-controlnet", "text": ("tiny-clip",)},
}
PIPELINE_ALIASES = {"sdxl-base": "sdxl", "sd15-pipeline": "sd15"}  # the U-Net's registry name names its pipeline


def pipeline_name(name: str, also: tuple[str, ...] = ()) -> str:
    """A pipeline by its name or its U-Net's (sdxl-base: sdxl), or one of `also` (the video pipelines, where the
    command takes them); one line naming every one it takes otherwise."""
    found = name if name in PIPELINES or name in also else PIPELINE_ALIASES.get(name)
    if found is None:
        raise InputError(f"unknown pipeline {name!r}: use {', '.join([*PIPELINES, *also])} (or sdxl-base for sdxl)")
    return found
# ../shared/reference/pipeline_configs.json: text_encoders
TEXT_ENCODERS = {
    "clip-l": ("CLIPTextModel", dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                     num_hidden_layers=12, max_position_embeddings=77, vocab_size=49408,
                                     projection_dim=768, hidden_act="quick_gelu")),
    "openclip-bigg": ("CLIPTextModelWithProjection", dict(hidden_size=1280, intermediate_size=5120,
                                                          num_attention_heads=20, num_hidden_layers=32,
                                                          max_position_embeddings=77, vocab_size=49408,
                                                          projection_dim=1280, hidden_act="gelu")),
    # docs/examples/generate.py's (TEXT there): CLIPTextConfig's defaults for the rest
    "tiny-clip": ("CLIPTextModel", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_hidden_layers=2, vocab_size=100, max_position_embeddings=77,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1)),
}
OFFLOADS = ("none", "model", "sequential")


@functools.lru_cache(maxsize=4)
def text_encoder(name: str, dtype: str) -> torch.nn.Module:
    """A text encoder from its real class and config, with fake weights."""
    import transformers
    from torch._subclasses.fake_tensor import FakeTensor

    cls, config = TEXT_ENCODERS[name]
    with torch.device("meta"):
        model = getattr(transformers, cls)(transformers.CLIPTextConfig(**config))
    model = torch.nn.Module.to(model, models.torch_dtype(dtype))
    mode = fake_mode()
    with mode:
        return model._apply(lambda t: FakeTensor(mode, t, torch.device("cpu"))).eval()


def text_phase(names: tuple[str, ...], dtype: str, batch: int) -> dict:
    """The text encoders' weights and the highest transient of their forwards (one after another), on fake
    tensors."""
    weights = transient = 0
    for name in names:
        model = text_encoder(name, dtype)
        weights += models.weights_bytes(model)
        with fake_mode(), torch.no_grad():
            ids = torch.zeros(batch, 77, dtype=torch.int64)
            live = LiveBytes([*model.parameters(), *model.buffers(), ids])
            with live:
                model(input_ids=ids)
        transient = max(transient, live.peak)
    return {"weights_bytes": weights, "transient_bytes": transient}


@functools.lru_cache(maxsize=16)
def text_ops(name: str, dtype: str, batch: int):
    """Every op of one forward of the text encoder at 77 tokens (forward.OpCount's rows: FLOPs, bytes, new output,
    class), on fake tensors: the time model's features of the text phase. Counted once per encoder, dtype and batch
    (read-only): the dashboard's generation chart asks it for every GPU and backend (48 times for 12 GPUs and 4
    backends: generation.by_gpu took 12.4 s of CPU counting it each time, 6.7 s so)."""
    import numpy as np

    from .forward import OpCount

    model = text_encoder(name, dtype)
    with fake_mode(), torch.no_grad():
        ids = torch.zeros(batch, 77, dtype=torch.int64)
        with OpCount() as count:
            model(input_ids=ids)
    ops = np.array(count.rest, float).reshape(-1, 4)
    ops.setflags(write=False)
    return ops


def _largest_module(model: torch.nn.Module) -> int:
    """The bytes of the model's largest leaf module's own weights: what sequential offload holds at a time."""
    return max((models.weights_bytes(m) for m in model.modules() if not list(m.children())), default=0)


@dataclass(frozen=True)
class PipelineSpec:
    """What attnprof fit --pipeline asks of a whole generation: the pipeline, the budget, the attention backend that
    every phase runs, the batch (doubled for the U-Net under classifier-free guidance), the offload, the settings
    (VAE tiling, ControlNet, IP-Adapter tokens, ToMe), the aspect (or SDXL's buckets) and the device it plans for."""

    pipeline: str
    budget: int
    backend: str = "sdpa"
    dtype: str = "float16"
    batch: int = 1
    cfg: bool = True
    offload: str = "none"
    vae_tiling: bool = False
    controlnet: bool = False
    ip_adapter_tokens: int = 0
    tome: float = 0.0
    aspect: tuple[int, int] = (1, 1)
    buckets: bool = False
    device: str = "cuda"
    gpu_arch: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "pipeline", pipeline_name(self.pipeline))
        if self.offload not in OFFLOADS:
            raise InputError(f"--offload {self.offload!r}: use none, model or sequential")

    def summary(self) -> dict:
        """The fields every answer starts with, before the phases' models."""
        return {"pipeline": self.pipeline, "budget_bytes": self.budget, "backend": self.backend, "dtype": self.dtype,
                "batch": self.batch, "cfg": self.cfg, "offload": self.offload, "vae_tiling": self.vae_tiling,
                "controlnet": self.controlnet, "ip_adapter_tokens": self.ip_adapter_tokens, "tome": self.tome,
                "device": self.device}


class Generation:
    """The three phases of one generation under a spec: each phase's models, settings and weights, what stays
    resident beside it, and its need at a size."""

    def __init__(self, spec: PipelineSpec, say=lambda line: None):
        from ..unet.workload import check_settings

        self.spec, p = spec, PIPELINES[spec.pipeline]
        self.unet, self.vae = p["unet"], p["vae"]
        self.unet_settings = check_settings(p["unet"], {"controlnet": spec.controlnet,
                                                        "ip_adapter_tokens": spec.ip_adapter_tokens,
                                                        "tome": spec.tome})
        self.vae_settings = check_settings(p["vae"], {"vae_tiling": spec.vae_tiling})
        self.step_batch = spec.batch * (2 if spec.cfg else 1)
        say(f"text encoders {', '.join(p['text'])}")
        self.text = text_phase(p["text"], spec.dtype, self.step_batch)
        self.weights = {"text": self.text["weights_bytes"], "denoise": _weights(p["unet"], spec.dtype,
                                                                                 self.unet_settings),
                        "decode": _weights(p["vae"], spec.dtype, self.vae_settings)}
        self.largest = {"text": self.text["weights_bytes"],
                        "denoise": _largest_module(_meta(p["unet"], spec.dtype, self.unet_settings)),
                        "decode": _largest_module(_meta(p["vae"], spec.dtype, self.vae_settings))}
        self.models = {"text": list(p["text"]),
                       "denoise": [p["unet"]] + ([p["controlnet"]] if spec.controlnet else []), "decode": [p["vae"]]}

    def beside(self, phase: str) -> int:
        """What the other phases leave resident on the device while this one runs."""
        return 0 if self.spec.offload != "none" else sum(w for k, w in self.weights.items() if k != phase)

    def own(self, phase: str) -> int:
        """The phase's own weights, as its trace counts them, less what offload streams."""
        return self.weights[phase] - self.largest[phase] if self.spec.offload == "sequential" else 0

    def runs(self) -> list[tuple[str, str, tuple, int]]:
        """(phase, model, settings, batch) of the phases that run a traced forward: denoise and decode."""
        return [("denoise", self.unet, self.unet_settings, self.step_batch),
                ("decode", self.vae, self.vae_settings, self.spec.batch)]

    def text_need(self) -> int:
        return self.beside("text") + self.text["weights_bytes"] + self.text["transient_bytes"] - self.own("text")

    def need(self, phase: str, size: tuple[int, int]) -> int:
        """The phase's need at the size: what is resident beside it plus its forward's peak."""
        if phase == "text":
            return self.text_need()
        s = self.spec
        _, model, settings, b = next(r for r in self.runs() if r[0] == phase)
        t = trace(model, size[0], size[1], b, s.dtype, s.device, [s.backend], settings=settings,
                  gpu=_gpu(s.device, s.gpu_arch))
        if s.backend not in t["backends"]:
            raise InputError(f"backend {s.backend!r} does not run on {s.device}: choose another (--backend)")
        return self.beside(phase) + t["backends"][s.backend]["predicted_forward_peak_bytes"] - self.own(phase)


def fit_pipeline(spec: PipelineSpec, say=lambda line: None) -> dict:
    """The largest image (square, or of the aspect; or each of SDXL's buckets) whose every phase fits the budget:
    {"pipeline", ..., "phases": [{"phase", "models", "resident_bytes", "need_bytes", "next_need_bytes"}],
    "largest", "next", "limited_by"} (with buckets: "buckets": [{"width", "height", "needs": {phase: bytes},
    "fits"}])."""
    g = Generation(spec, say)
    base = {**spec.summary(), "models": g.models}
    if spec.buckets:
        return {**base, "buckets": _buckets(g, say)}
    return {**base, **_largest(g, say)}


def _buckets(g: Generation, say) -> list[dict]:
    """Each of SDXL's buckets: every phase's need there, and whether all fit."""
    rows = []
    for w, h in BUCKETS:
        needs = {ph: g.need(ph, (w, h)) for ph in ("text", "denoise", "decode")}
        rows.append({"width": w, "height": h, "needs": needs, "fits": max(needs.values()) <= g.spec.budget})
        say(f"bucket {w}x{h}")
    return rows


def _phase_limits(g: Generation, sizes: list, say) -> int:
    """The index in sizes of the largest that every phase fits (-1: none): the denoise and decode phases each found
    with attnprof fit's search against the budget less what the others leave resident; a tiled decode (whose ops
    change with the size) traced exactly at that answer and a step at a time below it."""
    s, found = g.spec, {}
    for phase, model, settings, b in g.runs():
        if phase == "decode" and s.vae_tiling:
            continue  # a tiled decode is checked exactly at the others' answer, below
        say(f"the {phase} phase ({model})")
        room = s.budget - g.beside(phase) + g.own(phase)
        f = fit_one(model, room, [s.backend], s.dtype, b, s.aspect, False, s.device, 8192, say, s.gpu_arch, settings)
        found[phase] = f["backends"][0]["largest"]
    if g.text_need() > s.budget:
        return -1
    index = {tuple(size): i for i, size in enumerate(sizes)}
    i = min((index[tuple(v)] if v else -1 for v in found.values()), default=len(sizes) - 1)
    while s.vae_tiling and i >= 0 and g.need("decode", sizes[i]) > s.budget:
        i -= 1
    return i


def _largest(g: Generation, say) -> dict:
    """The largest image of the aspect that every phase fits, the next step, each phase's need at both, and the phase
    that the next step overflows most."""
    sizes = grid(g.spec.aspect, 8192)
    i = _phase_limits(g, sizes, say)
    answer = sizes[i] if i >= 0 else None
    nxt = sizes[i + 1] if i + 1 < len(sizes) else None
    phases = [{"phase": phase, "models": g.models[phase],
               "resident_bytes": g.beside(phase) + g.weights[phase] - g.own(phase),
               "need_bytes": g.need(phase, answer) if answer else None,
               "next_need_bytes": g.need(phase, nxt) if nxt else None} for phase in ("text", "denoise", "decode")]
    over = [ph for ph in phases if ph["next_need_bytes"] is not None and ph["next_need_bytes"] > g.spec.budget]
    limited = max(over, key=lambda ph: ph["next_need_bytes"])["phase"] if over else None
    text_fits = g.text_need() <= g.spec.budget
    return {"largest": list(answer) if answer else None, "next": list(nxt) if nxt else None,
            "phases": phases, "limited_by": "text" if not text_fits else limited, "not_counted": LEFT_OUT +
            "; the scheduler's and the latents' few MiB; IP-Adapter's image encoder"}


def pipeline_by_budget(pipeline: str, budgets: list[int], backend: str = "sdpa", dtype: str = "float16",
                       batch: int = 1, cfg: bool = True, offload: str = "none", device: str = "cuda") -> list[dict]:
    """Per budget, the largest square image whose every phase fits, from the screen alone (fit_many with
    verify=False; no exact trace at the answers): [{"budget_bytes", "largest", "limited_by", "phases": {phase:
    largest square}}]: the dashboard's table of common GPU sizes. No tiling, ControlNet or settings."""
    from .fit import fit_many

    g = Generation(PipelineSpec(pipeline, 0, backend, dtype, batch, cfg, offload, device=device))
    found = {}
    for phase, model, _, b in g.runs():
        rooms = [budget - g.beside(phase) + g.own(phase) for budget in budgets]
        found[phase] = [r["backends"][0]["largest"] for r in fit_many(model, rooms, [backend], dtype, b,
                                                                        device=device, verify=False)]
    rows = []
    for i, budget in enumerate(budgets):
        text_fits = g.text_need() <= budget
        limits = {ph: found[ph][i] for ph in found}
        width = lambda s: s[0] if s else 0  # noqa: E731
        limited = "text" if not text_fits else min(limits, key=lambda ph: width(limits[ph]))
        rows.append({"budget_bytes": budget, "largest": None if not text_fits else limits[limited],
                     "limited_by": limited, "phases": limits})
    return rows


def _weights(model: str, dtype: str, settings: tuple) -> int:
    w, module = _meta_workload(model, dtype, settings)
    with w.applied(module):
        return models.weights_bytes(module)


def _meta(model: str, dtype: str, settings: tuple) -> torch.nn.Module:
    return _meta_workload(model, dtype, settings)[1]


def _meta_workload(model: str, dtype: str, settings: tuple):
    from .calls import meta_model

    return meta_model(model, dtype, settings)


def _gpu(device: str, gpu_arch: str | None):
    from ..attention import kernel_choice

    return kernel_choice.gpu_target(gpu_arch) if device == "cuda" else None


def format_pipeline(f: dict) -> str:
    how = (f"{f['pipeline']} pipeline, {f['dtype']}, batch {f['batch']}"
           f"{' (classifier-free guidance: the U-Net at batch ' + str(2 * f['batch']) + ')' if f['cfg'] else ''}, "
           f"offload {f['offload']}, {f['backend']} attention on {f['device']}"
           + "".join(f", {x}" for x, on in (("ControlNet", f["controlnet"]), ("VAE tiling", f["vae_tiling"]),
                                           (f"IP-Adapter {f['ip_adapter_tokens']} tokens", f["ip_adapter_tokens"]),
                                           (f"ToMe {f['tome']:g}", f["tome"])) if on))
    if "buckets" in f:
        rows = [{"bucket": f"{b['width']}x{b['height']}", **{ph: human_bytes(n) for ph, n in b["needs"].items()},
                 "fits": "yes" if b["fits"] else "NO"} for b in f["buckets"]]
        return "\n".join([f"{how}: each phase's need in SDXL's aspect buckets against {human_bytes(f['budget_bytes'])}",
                          table(rows, [(c, c) for c in ("bucket", "text", "denoise", "decode", "fits")])])
    size = lambda s: f"{s[0]}x{s[1]}" if s else "-"  # noqa: E731
    head = (f"{how}: the largest image whose every phase fits {human_bytes(f['budget_bytes'])} is "
            f"{size(f['largest']) if f['largest'] else 'none'}")
    rows = [{"phase": ph["phase"], "models": ", ".join(ph["models"]), "resident": human_bytes(ph["resident_bytes"]),
             f"needs at {size(f['largest'])}": human_bytes(ph["need_bytes"]),
             f"at {size(f['next'])}": human_bytes(ph["next_need_bytes"])} for ph in f["phases"]]
    cols = ["phase", "models", "resident", f"needs at {size(f['largest'])}", f"at {size(f['next'])}"]
    limit = (f"limited by: the {f['limited_by']} phase (the next step, {size(f['next'])}, needs more than the budget "
             "there)" if f["limited_by"] else "limited by: no phase below 8192 pixels")
    return "\n".join([head, table(rows, [(c, c) for c in cols]), "", limit,
                      "resident: the weights on the device while the phase runs (its own included)",
                      f"not counted: {f['not_counted']}"])

