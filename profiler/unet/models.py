"""Model registry: named configs in configs/models/*.yaml, local diffusers folders and hub ids; meta, random or
real-weight builds, and the example inputs of one U-Net forward. A model is of one kind (kinds.py: unet, vae,
controlnet, animatediff, svd, ...): its record says its class, the keys its config needs, how it is made and fed."""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint, kinds, weights_init
from ..env import configs
from ..spec import InputError, load_yaml, torch_dtype

WEIGHTS = "diffusion_pytorch_model"  # diffusers' file name of a model's weights
_SAFETENSORS = re.compile(rf"{WEIGHTS}(?:\.(\w+))?\.safetensors|{WEIGHTS}\.safetensors\.index(?:\.(\w+))?\.json")


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user typed: a registry name, a folder or a hub id
    config: dict  # the model's diffusers config (a ControlNet's: its U-Net's)
    text_tokens: int = 77
    weights: str | None = None  # folder or hub id holding real weights; None for registry configs
    subfolder: str | None = None
    kind: str = "unet"  # a record of kinds.KINDS
    variant: str | None = None  # the weights file's variant ('fp16': diffusion_pytorch_model.fp16.safetensors)
    checkpoint: object = None  # a single-file checkpoint's checkpoint.Checkpoint (weights: its path)

    @property
    def levels(self) -> int:
        """Resolution levels (downsamplings + 1): what a block's level counts from."""
        return len(self.config["block_out_channels"])


def known_models() -> dict[str, Path]:
    return {p.stem: p for p in sorted((configs() / "models").glob("*.yaml"), key=lambda p: p.stem)}


def _check_unet_config(config, where: str) -> dict:
    """A U-Net config (kinds.check), or one line saying what it is instead."""
    cls = config.get("_class_name", "UNet2DConditionModel") if isinstance(config, dict) else None
    kind = kinds.of_class(cls) if cls else None
    if kind is None:
        raise InputError(f"{where} does not describe a model attnprof builds (its class is {cls}): point at the "
                         f"config of one of {', '.join(k.cls for k in kinds.KINDS.values())}")
    return kinds.check(kind, config, where)


def _read_yaml(path: Path) -> ModelSource:
    """A registry config: its top-level key names its kind; a kind built on a U-Net (controlnet, animatediff) names a
    registry U-Net (`unet: NAME`) whose config it takes, with its own keys beside (a MotionAdapter's)."""
    doc = load_yaml(path.read_text(), str(path))
    kind = next((k for k in kinds.KINDS.values() if isinstance(doc, dict) and k.name in doc), None)
    if kind is None:
        raise InputError(f"{path} describes no model: expected a top-level mapping named by its kind, one of "
                         f"{', '.join(f'{k}:' for k in kinds.KINDS)}")
    name, tokens, body = doc.get("name", path.stem), int(doc.get("text_tokens", 77)), doc[kind.name] or {}
    if kind.on_unet:
        base = body.get("unet") if isinstance(body, dict) else None
        if base not in known_models() or base == path.stem or resolve(base).kind != "unet":
            raise InputError(f"{path}: {kind.name}.unet must name a U-Net of the registry, not {base!r}")
        unet = resolve(base)
        extra = {k: v for k, v in body.items() if k != "unet"}
        return ModelSource(name, {**unet.config, **extra}, unet.text_tokens, kind=kind.name)
    return ModelSource(name, kinds.check(kind, body, str(path)), tokens, kind=kind.name)


def _read_config(cfg_path: Path) -> tuple[dict, str]:
    """(the checked config, its kind) of a diffusers config.json."""
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{cfg_path}: not valid JSON ({e}): fix the file") from None
    kind = _kind_of(config)
    return _check_unet_config(config, str(cfg_path)), kind


def _read_folder(path: Path) -> ModelSource:
    for sub in (None, "unet"):
        cfg_path = path / sub / "config.json" if sub else path / "config.json"
        if cfg_path.is_file():
            config, kind = _read_config(cfg_path)
            return ModelSource(str(path), config, weights=str(path), subfolder=sub,
                               variant=_weights_variant(cfg_path.parent), kind=kind)
    raise InputError(f"{path} holds no config.json nor unet/config.json: point at a diffusers model folder")


def _weights_variant(folder: Path) -> str | None:
    """The variant of the U-Net's safetensors weights in a folder (None: the plain file; else 'fp16' where there is
    one, or the first by name); an InputError naming what the folder holds where it has none."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    variants = {m.group(1) or m.group(2) for m in map(_SAFETENSORS.fullmatch, names) if m}
    if variants:
        return None if None in variants else "fp16" if "fp16" in variants else sorted(variants)[0]
    found = [n for n in names if n.endswith((".bin", ".safetensors", ".ckpt", ".pt", ".pth"))]
    raise InputError(f"model folder {folder} holds {'only ' + ', '.join(found) if found else 'no weights'}: attnprof "
                     f"loads the U-Net's weights from {WEIGHTS}.safetensors (or a variant such as "
                     f"{WEIGHTS}.fp16.safetensors); re-save the model with save_pretrained(folder, "
                     "safe_serialization=True)")


def resolve(name: str) -> ModelSource:
    """A registry name, a YAML file, a diffusers config.json, a single-file checkpoint (checkpoint.py), a local
    diffusers folder (with or without unet/) or a hub id."""
    known = known_models()
    if name in known:
        return _read_yaml(known[name])
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise InputError(f"model file {name} does not exist: check the path")
        return _read_yaml(path)
    if path.suffix == ".json":  # a model's config.json alone: its shapes, no weights
        if not path.is_file():
            raise InputError(f"config file {name} does not exist: check the path")
        config, kind = _read_config(path)
        return ModelSource(name, config, kind=kind)
    if path.suffix in checkpoint.SUFFIXES:
        found, config = checkpoint.resolve(path, registry_configs)
        return ModelSource(name, config, weights=str(path), checkpoint=found)
    if path.is_dir():
        return _read_folder(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InputError(f"no such folder {name!r}: check the path to the diffusers model folder (or give a "
                         "single-file checkpoint, .safetensors)")
    if "/" not in name:
        near = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise InputError(f"unknown model {name!r}: {hint}known models are {', '.join(known)}; or give a folder or "
                         "hub id")
    return _read_hub(name)


def _read_hub(repo_id: str) -> ModelSource:
    """A hub id's U-Net config (unet/config.json, else config.json): from the local Hugging Face cache first, as
    HF_HUB_OFFLINE would; where it is not cached, from the hub, after one quick request says the hub answers."""
    from huggingface_hub import constants, try_to_load_from_cache

    for sub in ("unet", None):
        cached = try_to_load_from_cache(repo_id, f"{sub}/config.json" if sub else "config.json")
        if isinstance(cached, str):
            return _hub_source(repo_id, json.loads(Path(cached).read_text()), sub)
    fix = (f"download it where there is network (hf download {repo_id}) into this cache ({constants.HF_HUB_CACHE}), "
           "or give a local diffusers folder")
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}")
    unreachable = _hub_unreachable(repo_id)
    if unreachable:
        raise InputError(f"model {repo_id!r} is not in the local Hugging Face cache and {unreachable}: {fix}")
    from diffusers import UNet2DConditionModel

    for sub in ("unet", None):
        try:
            config = UNet2DConditionModel.load_config(repo_id, subfolder=sub)
        except Exception as e:  # hub/network errors come in many types; report the last one as one line
            err = e
            continue
        return _hub_source(repo_id, dict(config), sub)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise InputError(f"model {repo_id!r} is not a known name, a folder, or a reachable hub id ({first})")


def _kind_of(config: dict) -> str:
    kind = kinds.of_class(config.get("_class_name", "UNet2DConditionModel")) if isinstance(config, dict) else None
    return kind.name if kind else "unet"


def _hub_source(repo_id: str, config: dict, sub: str | None) -> ModelSource:
    return ModelSource(repo_id, _check_unet_config(config, repo_id), weights=repo_id, subfolder=sub,
                       kind=_kind_of(config))


def _hub_unreachable(repo_id: str, timeout_s: float = 5.0) -> str | None:
    """Why the hub cannot give this repository, from one request without retries (None: it answers and has it)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        status = get_session().head(f"{constants.ENDPOINT}/api/models/{repo_id}", timeout=timeout_s).status_code
    except Exception as e:  # the HTTP client's connection and timeout errors: no hub from here
        return f"the hub ({constants.ENDPOINT}) cannot be reached ({type(e).__name__}: {str(e)[:120]})"
    if status in (401, 403, 404):
        return f"the hub ({constants.ENDPOINT}) has no repository {repo_id} that this machine may read (HTTP {status})"
    return None


def _from_config(source: ModelSource) -> torch.nn.Module:
    """The model of the source's kind, on the meta device (every parameter: a module that makes one with the legacy
    torch.Tensor([...]) constructor, as SVD's AlphaBlender does, gets it on the CPU whatever the default device)."""
    with torch.device("meta"):
        model = kinds.KINDS[source.kind].make(source.config)
    return torch.nn.Module.to(model, "meta")


def build(source: ModelSource | str, weights: str = "random", device: str = "cpu", dtype: str = "float32",
          seed: int = 0) -> torch.nn.Module:
    """Build the model. weights: 'meta' (shapes only, no memory), 'random' (fast seeded init) or 'pretrained'."""
    import diffusers

    if isinstance(source, str):
        source = resolve(source)
    if weights == "pretrained":
        if source.weights is None:
            raise InputError(f"model {source.name!r} is a config only: "
                             "give a diffusers folder or hub id for real weights")
        if source.checkpoint is not None:
            return checkpoint.load_unet(source.checkpoint, source.config, device, torch_dtype(dtype))
        cls = getattr(diffusers, kinds.KINDS[source.kind].cls)
        unet = cls.from_pretrained(source.weights, subfolder=source.subfolder, use_safetensors=True,
                                   variant=source.variant, low_cpu_mem_usage=False, torch_dtype=torch_dtype(dtype))
        return unet.to(device).eval()
    unet = torch.nn.Module.to(_from_config(source), torch_dtype(dtype))  # on meta (no memory): diffusers' .to() warns
    if weights == "meta":
        return unet.eval()
    if weights != "random":
        raise ValueError(f"weights must be meta, random or pretrained, not {weights!r}")
    unet = unet.to_empty(device=device)
    weights_init.random_init(unet, seed)
    weights_init.remake_buffers(unet)
    return unet.eval()


def example_inputs(unet: torch.nn.Module, batch: int, width: int, height: int, text_tokens: int = 77,
                   seed: int = 0) -> dict:
    """Keyword arguments of one U-Net forward at an image size of width x height pixels (latent = 1/8), as its
    pipeline gives them (kinds.unet_inputs: what its config asks for)."""
    return kinds.unet_inputs(unet, kinds.Shape(batch, width, height, 1, text_tokens, seed), {})


def weights_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers, each storage once (a weight shared by two modules too)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in [*model.parameters(),
                                                                                    *model.buffers()]}
    return sum(storages.values())


def param_counts(unet: torch.nn.Module) -> dict:
    """params_total, params_transformer_blocks (inside Transformer2DModel) and params_attention (inside Attention)."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    def inside(cls) -> int:
        return sum(p.numel() for m in unet.modules() if isinstance(m, cls) for p in m.parameters())

    total = sum(p.numel() for p in unet.parameters())
    tb, attn = inside(Transformer2DModel), inside(Attention)
    return {"params_total": total, "params_transformer_blocks": tb, "params_attention": attn,
            "share_transformer_blocks": tb / total, "share_attention": attn / total}


def registry_configs() -> list[tuple[str, str, dict]]:
    """(name, kind, config) of every registry model, in name order: what a single file's U-Net is matched to."""
    return [(name, source.kind, source.config) for name in known_models() for source in [resolve(name)]]


def facts_of(model: str) -> dict:
    """checkpoint.Checkpoint.facts of a model that is a single file; {} for the others (never resolved here: a hub id is not
    asked again) and for a file gone since its cell was measured (the cell's error says what failed)."""
    if Path(model).suffix not in checkpoint.SUFFIXES:
        return {}
    try:
        return resolve(model).checkpoint.facts()
    except InputError:
        return {}


def model_files(cells) -> dict:
    """{model: facts_of(model)} of the cells' models that are single files: the run's manifest records them."""
    facts = {m: facts_of(m) for m in dict.fromkeys(c.model for c in cells)}
    return {m: f for m, f in facts.items() if f}
