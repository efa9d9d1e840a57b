"""What one cell runs: its model with its settings, the inputs of one forward, and the forward itself. The measured
run (measure/cell.py), its fp32 reference and the planner (plan/) all run a cell through here, so they see the same
attention calls.

Settings, per model kind (a cell's identity; stored as JSON in `settings`, only those that differ from the default;
what each takes and how it reads: spec.SETTINGS):
- unet: `controlnet` (true: the registry's ControlNet of the U-Net, ControlNetModel.from_unet; or a ControlNet's own
  folder or config.json, its blocks its own: it runs first and feeds its residuals to the U-Net, as a pipeline step
  does), `ip_adapter_tokens` (IP-Adapter's image tokens in every
  cross-attention: 4 for the base adapter, 16 for plus), `tome` (ToMe's merge ratio, 0 <= r < 1), `compile` (none;
  regional: diffusers' compile_repeated_blocks of the U-Net, its BasicTransformerBlocks; full: torch.compile of the
  whole U-Net; measure/compiled.py compiles it, the reference and the planner run it eager).
- vae: `vae_part` (decoder, a pipeline's last step; or encoder, img2img's first), `vae_tiling` and `vae_slicing`
  (AutoencoderKL.enable_tiling / enable_slicing), `vae_upcast` (the VAE in float32 whatever the cell's dtype; default:
  the config's force_upcast, for a float16 cell only, as diffusers' pipelines upcast: bfloat16 stays bfloat16).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from . import kinds, models
from ..spec import SETTINGS, VIDEO, InputError, setting_value


def applies(name: str, kind: str) -> bool:
    """Whether setting `name` applies to a model of this kind (spec.SETTINGS: by name, or VIDEO for the kinds whose
    record takes frames)."""
    s = SETTINGS[name]
    return kind in s.kinds or VIDEO in s.kinds and kinds.KINDS[kind].frames


def check_settings(model: str, settings: dict) -> tuple[tuple[str, object], ...]:
    """The settings validated for the model's kind, those that differ from their default, sorted (a cell's key)."""
    source = models.resolve(model)
    out = {}
    for name, value in settings.items():
        if name not in SETTINGS:
            raise InputError(f"unknown setting {name!r}: the settings are {', '.join(SETTINGS)}")
        value = setting_value(name, value)
        if not applies(name, source.kind):
            raise InputError(f"setting {name} is for a {' or '.join(SETTINGS[name].kinds)} model, not {model} (a "
                             f"{source.kind})")
        if name == "controlnet" and isinstance(value, str):
            check_controlnet(source, value)
        if value != _default(source, name) or SETTINGS[name].always:
            out[name] = value
    for name, s in SETTINGS.items():  # what a cell of this kind always says, at the model's default where not given
        if s.always and applies(name, source.kind) and name not in out:
            out[name] = _default(source, name)
    return tuple(sorted(out.items()))


def check_controlnet(unet: models.ModelSource, given: str) -> None:
    """A ControlNet of one's own beside a U-Net, checked before anything is built: a ControlNet, whose residuals fit
    the U-Net's down blocks (their widths and count) and that reads the U-Net's latents and text (one line naming
    the key that differs)."""
    try:
        cn = models.resolve(given)
    except InputError as e:
        raise InputError(f"--controlnet {given}: {e}") from None
    if cn.kind != "controlnet":
        raise InputError(f"--controlnet {given}: a {cn.kind}, not a ControlNet: give the folder that "
                         "ControlNetModel.save_pretrained wrote, or its config.json")
    listed = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731 (YAML lists, JSON lists)
    for key, default in (("block_out_channels", None), ("layers_per_block", 2), ("in_channels", 4)):
        mine, its = listed(cn.config.get(key, default)), listed(unet.config.get(key, default))
        if mine != its:
            raise InputError(f"--controlnet {given}: its {key} {mine} differs from the U-Net's {its}: a ControlNet's "
                             "residuals add to the U-Net's down blocks, so they must match")
    if kinds.cross_width(cn.config) != kinds.cross_width(unet.config):
        raise InputError(f"--controlnet {given}: its cross_attention_dim {cn.config['cross_attention_dim']} differs "
                         f"from the U-Net's {unet.config['cross_attention_dim']}: both read the same text states")


def _default(source: models.ModelSource, name: str):
    s = SETTINGS[name]
    return s.read(source.config.get(s.config_key, s.default)) if s.config_key else s.default


class Workload:
    """A model with its settings: builds it (from parts a cache may keep), gives the inputs of one forward and runs
    it, with the settings applied for the duration."""

    def __init__(self, model: str, settings: tuple | dict = ()):
        self.model, self.source = model, models.resolve(model)
        self.kind = kinds.KINDS[self.source.kind]
        self.given = dict(settings)
        self.settings = {n: self.given.get(n, _default(self.source, n)) for n in SETTINGS
                         if applies(n, self.source.kind)}

    def dtype(self, dtype: str) -> str:
        """The dtype the model computes in: float32 for a VAE upcast as asked, or by default (its config's
        force_upcast) where the cell is float16, as diffusers' pipelines upcast (a bfloat16 VAE decodes in bfloat16);
        else the cell's."""
        asked = "vae_upcast" in self.given
        return "float32" if self.settings.get("vae_upcast") and (asked or dtype == "float16") else dtype

    def build(self, part) -> torch.nn.Module:
        """The model under test, from part(which) -> a built model of this source ('model') or, for a U-Net cell
        with a ControlNet, its ControlNet ('controlnet'): parts a cache may keep for the cells that follow. What a
        cell runs is its kind's (kinds.Kind.wrap: a VAE's part, a step with its ControlNet)."""
        return self.kind.wrap(part("model"), {**self.settings, "text_tokens": self.source.text_tokens}, part)

    def parts(self) -> tuple[str, ...]:
        """The parts build() asks for."""
        return self.kind.parts(self.settings)

    def unet(self, model: torch.nn.Module) -> torch.nn.Module:
        """The built model's own diffusers model (the U-Net of a step, the VAE of a part)."""
        return getattr(model, "own", model)

    def make_part(self, which: str, weights: str, device: str, dtype: str, seed: int = 0) -> torch.nn.Module:
        """One part, built in `dtype` (give it self.dtype(the cell's)): the model, or its ControlNet
        (kinds.controlnet_part: 'controlnet', the registry's from the U-Net's config, random weights; or
        'controlnet=PATH', one's own from its folder or config.json, its weights where the cell loads real ones and
        the folder holds them, else random)."""
        if which.startswith("controlnet"):
            given = which.partition("=")[2]
            source = models.resolve(given) if given else \
                models.ModelSource(f"{self.model}-controlnet", self.source.config, kind="controlnet")
            mode = "meta" if weights == "meta" else \
                "pretrained" if weights == "pretrained" and source.weights else "random"
            return models.build(source, weights=mode, device=device, dtype=dtype, seed=seed + 1)
        return models.build(self.source, weights=weights, device=device, dtype=dtype, seed=seed)

    def inputs(self, model: torch.nn.Module, batch: int, width: int, height: int, seed: int = 0) -> dict:
        """Keyword arguments of one forward at an image of width x height pixels (a latent of 1/8), as the kind's
        record makes them for the cell's settings."""
        shape = kinds.Shape(batch, width, height, self.settings.get("frames", 1), self.source.text_tokens, seed)
        return self.kind.inputs(self.unet(model), shape, self.settings)

    @contextmanager
    def applied(self, model: torch.nn.Module):
        """The settings on the model for the duration (the kind's: ToMe and IP-Adapter on a U-Net, tiling and
        slicing on a VAE); taken back on exit."""
        with self.kind.apply(self.unet(model), self.settings):
            yield model

    def forward(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """One forward (a call of the model: a recorder's pass begins there; apply the settings around it); the
        output that the fp32 reference is compared with."""
        fresh = {k: {n: dict(v) if isinstance(v, dict) else v for n, v in a.items()} if isinstance(a, dict) else a
                 for k, a in inputs.items()}  # a U-Net consumes GLIGEN's arguments from its cross_attention_kwargs
        out = model(**fresh)
        return out if isinstance(out, torch.Tensor) else self.kind.output(out)


