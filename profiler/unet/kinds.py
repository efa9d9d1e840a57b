"""Model kinds: one record each, beside the backend registry (backends.py). A kind says which diffusers class its
models are, the config keys a config of it must hold, how one is made from a config on the meta device (weights come
after: models.build), its example inputs at a size, batch and frame count, what one forward returns, and whether its
inputs carry frames. models.py, workload.py, the planner and the readers ask the record instead of branching on
kind names; adding a kind is one record (register) and its configs.

- unet: UNet2DConditionModel. Its inputs follow its config: class labels where it has class embeddings, the added
  conditions its addition_embed_type asks for, the encoder states its encoder_hid_dim_type projects, GLIGEN's boxes
  where its attention is gated. A config no pipeline can run (cross-attention widths that differ per block: diffusers
  passes one encoder_hidden_states to every block) is refused in one line naming the key.
- vae: AutoencoderKL (its part, decoder or encoder, is a setting: workload.VaePart).
- controlnet: ControlNetModel from its own config (a folder ControlNetModel.save_pretrained wrote, or its
  config.json: its blocks, depth and heads its own), or ControlNetModel.from_unet of a registry U-Net (its config:
  `controlnet: {unet: NAME}`). A U-Net's `controlnet` setting runs one beside it: the registry's (true), or one's
  own (its folder or config.json), whose residuals must fit the U-Net's down blocks.
- animatediff: UNetMotionModel, a 2-D U-Net with motion modules (UNetMotionModel.from_unet2d of a registry U-Net and a
  MotionAdapter config: `animatediff: {unet: NAME, motion_adapter: {...}}`, or a UNetMotionModel config of a folder).
  Its input is (batch, channels, frames, h, w): spatial attention sees batch x frames images, temporal attention
  (its motion modules) batch x h x w sequences of `frames` tokens.
- svd: UNetSpatioTemporalConditionModel (Stable Video Diffusion). Its input is (batch, frames, channels, h, w), one
  image embedding token and three added time ids per video; its temporal transformer blocks attend over frames.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from ..spec import InputError


class Shape(NamedTuple):
    """What one forward's inputs are made for: images (videos) in the batch, pixels, frames (video kinds), the text
    tokens of the encoder states, the seed of their values."""

    batch: int
    width: int
    height: int
    frames: int = 1
    tokens: int = 77
    seed: int = 0


@dataclass(frozen=True)
class Kind:
    name: str  # the YAML key of its configs, and what its cells' settings apply to
    cls: str  # the diffusers class of its models
    what: str
    required: tuple[str, ...]
    make: Callable[[dict], torch.nn.Module]  # a config -> the model, under torch.device("meta")
    inputs: Callable[[torch.nn.Module, Shape, dict], dict]  # its own model, a shape, the cell's settings -> one
    # forward's keyword arguments
    output: Callable[[object], torch.Tensor] = lambda out: out.sample  # the forward's output compared with the fp32
    # reference
    wrap: Callable = lambda model, settings, part: model  # its model -> what a cell runs (a VAE's part, a step with
    # its ControlNet: part("controlnet") builds one)
    parts: Callable[[dict], tuple[str, ...]] = lambda settings: ("model",)  # the parts wrap asks for
    apply: Callable = lambda model, settings: contextlib.nullcontext()  # its settings on its model for a forward
    on_unet: bool = False  # its registry config names a registry U-Net whose config it builds on (`unet: NAME`)
    frames: bool = False  # a video kind: its inputs carry frames (the `frames` setting)
    temporal: tuple[str, ...] = ()  # module path parts of its attention over frames (the recorder's kind: temporal)
    loads: bool = True  # real weights from a folder or hub id (cls.from_pretrained)
    folder_classes: tuple[str, ...] = field(default=())  # other _class_name values of its folders' configs


def _maker(model: torch.nn.Module, seed: int):
    """make(*shape): random values on the model's device and dtype (empty on meta), from one seeded generator."""
    param = next(model.parameters())
    if param.device.type == "meta":
        return lambda *s: torch.empty(*s, device="meta", dtype=param.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=gen).to(device=param.device, dtype=param.dtype)


def _timestep(model: torch.nn.Module, batch: int) -> torch.Tensor:
    return torch.full((batch,), 500, dtype=torch.int64, device=next(model.parameters()).device)  # 1-D: no [None] on
    # fake CUDA


def cross_width(config) -> int:
    """The width of the encoder states every cross-attention takes; one line naming the key where a config asks
    for widths that differ per block, which no pipeline can feed (one encoder_hidden_states for every block)."""
    cross = config["cross_attention_dim"] if isinstance(config, dict) else config.cross_attention_dim
    if isinstance(cross, (list, tuple)):
        if len(set(cross)) > 1:
            raise InputError(f"cross_attention_dim {list(cross)}: widths that differ per block take an encoder state "
                             "each, and diffusers passes one encoder_hidden_states to every block: give one width")
        return cross[0]
    return cross


def check_unet(config: dict, where: str) -> None:
    """What a U-Net config asks that attnprof can feed, checked before anything is built (one line naming the key)."""
    cross_width(config)
    gated = config.get("attention_type", "default")
    if gated not in ("default", "gated"):
        raise InputError(f"{where}: attention_type {gated!r}: attnprof feeds 'default' and 'gated' (GLIGEN's boxes), "
                         "not this one")
    known = {"addition_embed_type": (None, "text", "text_image", "text_time", "image", "image_hint"),
             "encoder_hid_dim_type": (None, "text_proj", "text_image_proj", "image_proj"),
             "class_embed_type": (None, "timestep", "identity", "projection", "simple_projection")}
    for key, values in known.items():
        if config.get(key) not in values:
            raise InputError(f"{where}: {key} {config.get(key)!r}: attnprof makes the inputs of "
                             f"{', '.join(str(v) for v in values)}, not this one")


HINT_CHANNELS = 4  # what an image_hint U-Net's hint block gives, concatenated to the latents before conv_in
GLIGEN_OBJECTS = 30  # the boxes a GLIGEN pipeline passes (max_objs): each gated self-attention attends to them too


def unet_inputs(model: torch.nn.Module, s: Shape, settings: dict | None = None) -> dict:
    """One forward of a UNet2DConditionModel, as its pipeline calls it: the latents, a timestep, the encoder states
    its cross-attention (or its encoder_hid_proj) takes, and whatever its config adds: class labels, the added
    conditions of its addition_embed_type, GLIGEN's boxes."""
    cfg, make, b = model.config, _maker(model, s.seed), s.batch
    cross = cross_width(cfg)
    hid = cfg.encoder_hid_dim_type
    channels = cfg.in_channels - (HINT_CHANNELS if cfg.addition_embed_type == "image_hint" else 0)
    out = {"sample": make(b, channels, s.height // 8, s.width // 8), "timestep": _timestep(model, b),
           "encoder_hidden_states": make(b, s.tokens, cfg.encoder_hid_dim if hid in ("text_proj", "text_image_proj")
                                         else cross)}
    added = {}
    if cfg.addition_embed_type == "text_time":
        added = {"text_embeds": make(b, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim),
                 "time_ids": make(b, 6)}
    if cfg.addition_embed_type in ("image", "image_hint") or hid == "image_proj":
        added["image_embeds"] = make(b, cfg.encoder_hid_dim)
    if cfg.addition_embed_type == "text_image" or hid == "text_image_proj":
        added["image_embeds"] = make(b, cross)
    if cfg.addition_embed_type == "text_image":  # the pooled prompt, as Kandinsky 2.1 passes it
        added["text_embeds"] = make(b, cross)
    if cfg.addition_embed_type == "image_hint":
        added["hint"] = make(b, 3, s.height, s.width)
    if added:
        out["added_cond_kwargs"] = added
    if model.class_embedding is not None:  # num_class_embeds: a label each; timestep: a time; else an embedding
        kind = cfg.class_embed_type
        if kind is None:
            out["class_labels"] = torch.zeros(b, dtype=torch.int64, device=out["timestep"].device)
        elif kind == "timestep":
            out["class_labels"] = _timestep(model, b)
        else:
            out["class_labels"] = make(b, model.time_embedding.linear_1.out_features if kind == "identity" else
                                       cfg.projection_class_embeddings_input_dim)
    if getattr(model, "position_net", None) is not None:  # GLIGEN: boxes, their text embeddings, their masks
        n, param = GLIGEN_OBJECTS, next(model.parameters())
        out["cross_attention_kwargs"] = {"gligen": {
            "boxes": make(b, n, 4), "positive_embeddings": make(b, n, cross),
            "masks": torch.ones(b, n, device=param.device, dtype=param.dtype)}}
    settings = settings or {}
    if settings.get("ip_adapter_tokens"):  # the image tokens after the text tokens (adapters.IPCross splits them)
        extra = _maker(model, s.seed + 1)(b, settings["ip_adapter_tokens"], out["encoder_hidden_states"].shape[-1])
        out["encoder_hidden_states"] = torch.cat([out["encoder_hidden_states"], extra], dim=1)
    if settings.get("controlnet"):
        out["controlnet_cond"] = _maker(model, s.seed + 2)(b, 3, s.height, s.width)
    return out


def _unet(config: dict) -> torch.nn.Module:
    import diffusers

    return diffusers.UNet2DConditionModel.from_config(config)


def _controlnet_inputs(model: torch.nn.Module, s: Shape, settings: dict) -> dict:
    channels = getattr(model.config, "conditioning_channels", 3)  # the conditioning image's (3: RGB)
    return {**unet_inputs(model, s), "controlnet_cond": _maker(model, s.seed + 2)(s.batch, channels, s.height,
                                                                                 s.width)}


def controlnet_part(settings: dict) -> str | None:
    """The part name of a U-Net cell's ControlNet: 'controlnet' (the registry's, from the U-Net's config), or
    'controlnet=PATH' (a ControlNet's own folder or config.json), so that parts kept by name are never mixed up;
    None without one."""
    given = settings.get("controlnet")
    return None if not given else "controlnet" if given is True else f"controlnet={given}"


class Step(torch.nn.Module):
    """A pipeline's denoising step with a ControlNet: the ControlNet first (on the text tokens only), its residuals
    into the U-Net."""

    def __init__(self, unet: torch.nn.Module, controlnet: torch.nn.Module, text_tokens: int):
        super().__init__()
        self.unet, self.controlnet, self.text_tokens = unet, controlnet, text_tokens
        self.config = unet.config

    @property
    def own(self) -> torch.nn.Module:
        return self.unet

    def forward(self, controlnet_cond, encoder_hidden_states, **inputs):
        down, mid = self.controlnet(**inputs, controlnet_cond=controlnet_cond, return_dict=False,
                                    encoder_hidden_states=encoder_hidden_states[:, :self.text_tokens])
        return self.unet(**inputs, encoder_hidden_states=encoder_hidden_states, down_block_additional_residuals=down,
                         mid_block_additional_residual=mid).sample


def _unet_wrap(model, settings: dict, part):
    which = controlnet_part(settings)
    return Step(model, part(which), settings.get("text_tokens", 77)) if which else model


@contextlib.contextmanager
def _unet_apply(model, settings: dict):
    """ToMe and IP-Adapter (profiler/unet/adapters.py) on the U-Net for the duration."""
    from .adapters import applied

    with applied(model, settings.get("tome", 0.0), settings.get("ip_adapter_tokens", 0)):
        yield model


class VaePart(torch.nn.Module):
    """The VAE's decoder (latents to an image) or encoder (an image to the latents' mean), as a pipeline runs it."""

    def __init__(self, vae: torch.nn.Module, part: str):
        super().__init__()
        self.vae, self.part = vae, part
        self.config = vae.config

    @property
    def own(self) -> torch.nn.Module:
        return self.vae

    def forward(self, sample):
        if self.part == "encoder":
            return self.vae.encode(sample).latent_dist.mean
        return self.vae.decode(sample).sample


def _vae_inputs(model: torch.nn.Module, s: Shape, settings: dict) -> dict:
    """A VAE part's input: an image to encode, or latents (1/8 of it) to decode."""
    make = _maker(model, s.seed)
    if settings.get("vae_part") == "encoder":
        return {"sample": make(s.batch, 3, s.height, s.width)}
    return {"sample": make(s.batch, model.config.latent_channels, s.height // 8, s.width // 8)}


@contextlib.contextmanager
def _vae_apply(model, settings: dict):
    """Tiling and slicing (AutoencoderKL.enable_tiling / enable_slicing) as the settings say, then as they were."""
    before = model.use_tiling, model.use_slicing
    model.use_tiling, model.use_slicing = settings.get("vae_tiling", False), settings.get("vae_slicing", False)
    try:
        yield model
    finally:
        model.use_tiling, model.use_slicing = before


def _animatediff(config: dict) -> torch.nn.Module:
    import diffusers

    if "motion_adapter" not in config:  # a UNetMotionModel config, as a folder holds it
        return diffusers.UNetMotionModel.from_config(config)
    adapter = diffusers.MotionAdapter.from_config(config["motion_adapter"])
    unet = _unet({k: v for k, v in config.items() if k != "motion_adapter"})
    return diffusers.UNetMotionModel.from_unet2d(unet, adapter, load_weights=False)


def _animatediff_inputs(model: torch.nn.Module, s: Shape, settings: dict) -> dict:
    """AnimateDiff's U-Net call, as its pipelines make it: latents of (batch, channels, frames, h, w), the prompt's
    states repeated for every frame (the pipeline's repeat_interleave: the model does not), SDXL's added conditions
    once per video where its U-Net has them."""
    cfg, make, b = model.config, _maker(model, s.seed), s.batch
    out = {"sample": make(b, cfg.in_channels, s.frames, s.height // 8, s.width // 8), "timestep": _timestep(model, b),
           "encoder_hidden_states": make(b, s.tokens, cross_width(cfg)).repeat_interleave(s.frames, dim=0)}
    if cfg.addition_embed_type == "text_time":
        out["added_cond_kwargs"] = {
            "text_embeds": make(b, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim),
            "time_ids": make(b, 6)}
    return out


def _svd(config: dict) -> torch.nn.Module:
    import diffusers

    return diffusers.UNetSpatioTemporalConditionModel.from_config(config)


def _svd_inputs(model: torch.nn.Module, s: Shape, settings: dict) -> dict:
    """Stable Video Diffusion's U-Net call: latents of (batch, frames, channels, h, w) (its 8 channels: the noisy
    latents and the conditioning image's), one image embedding token per video, and three added time ids (fps,
    motion bucket, noise augmentation)."""
    cfg, make, b = model.config, _maker(model, s.seed), s.batch
    return {"sample": make(b, s.frames, cfg.in_channels, s.height // 8, s.width // 8), "timestep": _timestep(model, b),
            "encoder_hidden_states": make(b, 1, cross_width(cfg)), "added_time_ids": make(b, 3)}


def _vae(config: dict) -> torch.nn.Module:
    import diffusers

    return diffusers.AutoencoderKL.from_config(config)


def _controlnet(config: dict) -> torch.nn.Module:
    """A ControlNet: from its own config (ControlNetModel.save_pretrained's: no up blocks; its depth, heads and
    blocks its own, as SDXL's small and mid ControlNets), or as ControlNetModel.from_unet builds one from a U-Net's
    config (the registry's `controlnet: {unet: NAME}`)."""
    import diffusers

    if "up_block_types" not in config:
        return diffusers.ControlNetModel.from_config(config)
    return diffusers.ControlNetModel.from_unet(_unet(config), load_weights_from_unet=False)


_UNET_KEYS = ("down_block_types", "up_block_types", "block_out_channels", "cross_attention_dim")
KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    KINDS[kind.name] = kind
    return kind


for _k in (
    Kind("unet", "UNet2DConditionModel", "a U-Net", _UNET_KEYS, _unet, unet_inputs, wrap=_unet_wrap,
         parts=lambda settings: ("model", controlnet_part(settings)) if settings.get("controlnet") else ("model",),
         apply=_unet_apply),
    Kind("vae", "AutoencoderKL", "a VAE",
         ("down_block_types", "up_block_types", "block_out_channels", "latent_channels"), _vae, _vae_inputs,
         output=lambda out: out, wrap=lambda model, settings, part: VaePart(model, settings["vae_part"]),
         apply=_vae_apply),
    Kind("controlnet", "ControlNetModel", "a ControlNet", ("down_block_types", "block_out_channels",
                                                           "cross_attention_dim"),
         _controlnet, _controlnet_inputs, output=lambda out: out.mid_block_res_sample, on_unet=True),
    Kind("animatediff", "UNetMotionModel", "a video U-Net: AnimateDiff (a U-Net with motion modules)", _UNET_KEYS,
         _animatediff, _animatediff_inputs, on_unet=True, frames=True, temporal=("motion_modules.",)),
    Kind("svd", "UNetSpatioTemporalConditionModel", "a video U-Net: Stable Video Diffusion",
         ("down_block_types", "up_block_types", "block_out_channels", "num_attention_heads"), _svd, _svd_inputs,
         frames=True, temporal=("temporal_transformer_blocks.",)),
):
    register(_k)


def temporal_paths() -> tuple[str, ...]:
    """The path parts that mark a module's attention as over frames, of every kind registered."""
    return tuple(dict.fromkeys(p for k in KINDS.values() for p in k.temporal))


def of_class(cls: str) -> Kind | None:
    """The kind whose models are of this diffusers class (a folder's config._class_name)."""
    return next((k for k in KINDS.values() if k.cls == cls or cls in k.folder_classes), None)


def check(kind: Kind, config: dict, where: str) -> dict:
    """The config with diffusers' private keys dropped, once it holds what its kind requires (one line naming what it
    lacks, else)."""
    if not isinstance(config, dict):
        raise InputError(f"{where} does not describe {kind.what}: expected a mapping of config keys")
    missing = [k for k in kind.required if k not in config]
    if missing:
        raise InputError(f"{where} does not describe {kind.what} ({kind.cls}: it lacks {', '.join(missing)})")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if kind.name in ("unet", "controlnet", "animatediff"):
        check_unet(config, where)
    return config
