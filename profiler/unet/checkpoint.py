"""Single-file checkpoints (`--model PATH.safetensors`): the original (LDM) layout that A1111, Forge and ComfyUI load,
a whole pipeline or a U-Net alone. `.ckpt` / `.pt` / `.pth` files are pickles, which run code when loaded: they are
read only after `--allow-pickle` (or a sweep's `allow_pickle: true`), which sets ATTNPROF_ALLOW_PICKLE=1 for the
workers.

What the file is comes from its header alone (safetensors: the 8-byte length and the JSON listing of tensor names,
dtypes and shapes; no weight is read), told by diffusers' own `infer_diffusers_model_type`. Its U-Net config is the
registry's (configs/models) whose U-Net has exactly the file's tensor names and shapes, after the three figures the
header shows are taken from it (input and output channels, cross-attention width, SDXL's added-embedding width);
heads are not in the weights and stay the config's. Nothing is fetched. `run` loads the U-Net's weights with
diffusers' `convert_ldm_unet_checkpoint` (what `UNet2DConditionModel.from_single_file` runs) and a strict
`load_state_dict`: from_single_file without `accelerate` loads non-strictly, so a tensor the file lacks would stay
random without a word."""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..spec import InputError

SAFE, PICKLES = (".safetensors",), (".ckpt", ".pt", ".pth")
SUFFIXES = SAFE + PICKLES
PICKLE_ENV = "ATTNPROF_ALLOW_PICKLE"
PREFIX = "model.diffusion_model."  # diffusers' LDM_UNET_KEY: the U-Net's tensors in a whole-pipeline file
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header

# diffusers' model type: (what it is, the registry config of that kind tried first)
SUPPORTED = {"v1": ("SD 1.x", "sd15"), "v2": ("SD 2.x", "sd21-base"), "xl_base": ("SDXL base", "sdxl-base"),
             "inpainting": ("SD 1.x inpainting", "sd15"), "inpainting_v2": ("SD 2.x inpainting", "sd21-base"),
             "xl_inpaint": ("SDXL inpainting", "sdxl-base"), "instruct-pix2pix": ("SD 1.x InstructPix2Pix", "sd15"),
             "playground-v2-5": ("Playground v2.5 (SDXL's U-Net)", "sdxl-base"),
             "xl_refiner": ("SDXL refiner", "sdxl-refiner")}
_NAMED = {"upscale": "the SD x4 upscaler",
          "controlnet": "a ControlNet", "sd3": "SD 3 (a DiT)", "sd35": "SD 3.5 (a DiT)", "flux": "Flux (a DiT)",
          "stable_cascade": "Stable Cascade", "animatediff": "an AnimateDiff motion module",
          "auraflow": "AuraFlow (a DiT)", "ltx": "LTX-Video (a DiT)", "hunyuan": "HunyuanVideo (a DiT)",
          "wan": "Wan (a DiT)", "sana": "Sana (a DiT)", "autoencoder": "an autoencoder"}


@dataclass(frozen=True)
class Checkpoint:
    path: str
    model_type: str  # diffusers' name: v1, v2, xl_base, inpainting, ...
    kind: str  # what people call it: SD 1.x, SDXL base, ...
    config_name: str  # the registry config its U-Net matches
    bytes: int
    header_sha256: str  # of the header's bytes (a pickle's: of its sorted tensor listing)
    unet_only: bool  # a U-Net alone (bare LDM keys or only model.diffusion_model.*), not a whole pipeline

    def facts(self) -> dict:
        """What a run records of the file: its name, size and header hash (equal for two copies of one file)."""
        return {"model_file": Path(self.path).name, "model_file_bytes": self.bytes,
                "model_header_sha256": self.header_sha256, "model_file_kind": self.kind,
                "model_file_config": self.config_name}


def describe(facts: dict) -> str:
    """' (SDXL base, single file sd_xl_base_1.0.safetensors; U-Net config sdxl-base)', or '' for no file."""
    if not facts:
        return ""
    return (f" ({facts['model_file_kind']}, single file {facts['model_file']}; "
            f"U-Net config {facts['model_file_config']})")


def allow_pickle() -> None:
    os.environ[PICKLE_ENV] = "1"  # workers (subprocesses, Ray tasks) inherit it


def read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], bytes]:
    """({tensor name: shape}, the header's bytes) of a safetensors file: the first 8 + N bytes only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
            raise InputError(f"{path} is not a safetensors file (its first 8 bytes give no header length that fits "
                             "the file): check the file, or re-save it with safetensors")
        blob = f.read(n)
    try:
        doc = json.loads(blob)
        shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in doc.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise InputError(f"{path}: its safetensors header is not a JSON listing of tensors: check the file") from None
    return shapes, head + blob


def _read_pickle(path: Path) -> tuple[dict[str, tuple[int, ...]], bytes]:
    state = _pickle_state(path, "meta")
    shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return shapes, json.dumps(sorted(shapes.items())).encode()


def _pickle_state(path: Path, device: str) -> dict:
    try:
        try:
            state = torch.load(path, map_location=device, weights_only=False, mmap=True)
        except RuntimeError as e:  # a file of torch's legacy format (before 1.6) cannot be mapped: read it whole
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # a pickle fails in many ways (not a zip, a class it names is missing): one line
        raise InputError(f"{path} could not be read as a torch checkpoint ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}): check the file") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else None
    if not isinstance(state, dict):
        raise InputError(f"{path} holds no state dict (a mapping of tensor names): check the file")
    return state


def _unet_view(shapes: dict) -> tuple[dict, bool]:
    """The shapes with the U-Net's under their whole-pipeline names (a U-Net alone may hold bare LDM keys), and
    whether the file is a U-Net alone."""
    if not any(k.startswith(PREFIX) for k in shapes) and "input_blocks.0.0.weight" in shapes:
        return {PREFIX + k: v for k, v in shapes.items()}, True
    return shapes, all(k.startswith(PREFIX) for k in shapes)


def model_type(shapes: dict) -> str:
    """diffusers' infer_diffusers_model_type on the header's shapes (meta tensors: no memory). A U-Net alone holds
    no text encoder, by which diffusers tells SDXL: one with SDXL's added embedding (label_emb) is told by its width
    (2816 base, 2560 refiner)."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    try:
        found = infer_diffusers_model_type(meta)
    except Exception as e:  # diffusers' probes of some DiT files read values or raise on shapes it does not know
        raise InputError(f"diffusers could not tell what this checkpoint is ({type(e).__name__}: {e})") from None
    label = shapes.get(PREFIX + "label_emb.0.0.weight")
    if found in ("v1", "inpainting") and label is not None:
        inpaint = found == "inpainting"
        found = {2816: "xl_inpaint" if inpaint else "xl_base", 2560: "xl_refiner"}.get(label[1], found)
    return found


def _refused(path: Path, found: str) -> InputError:
    named = max((k for k in _NAMED if found.startswith(k)), key=len, default=None)  # sd35_large: SD 3.5, not 3
    what = _NAMED.get(named)
    return InputError(f"{path.name} is {what or repr(found)} (diffusers calls it {found!r}), not a U-Net attnprof "
                      f"profiles: give an SD 1.x, SD 2.x or SDXL base or refiner checkpoint ({', '.join(SUPPORTED)})")


def resolve(path: Path, registry) -> tuple[Checkpoint, dict]:
    """(what the file is, its U-Net's diffusers config) from the header alone; registry() gives the known configs,
    (name, kind, config) each (the registry's: models.registry_configs)."""
    if not path.is_file():
        raise InputError(f"checkpoint file {path} does not exist: check the path")
    if path.suffix in PICKLES and os.environ.get(PICKLE_ENV) != "1":  # asked each time: never from the cache
        raise InputError(f"{path} is a pickle ({path.suffix}), and loading a pickle can run any code it holds: give "
                         "--allow-pickle (a sweep: allow_pickle: true) if you trust the file, or convert it to "
                         ".safetensors")
    stat = path.stat()
    found, config = _resolve(str(path), stat.st_size, stat.st_mtime_ns, registry)
    return found, dict(config)  # the cached config stays as read


@functools.lru_cache(maxsize=16)
def _resolve(path: str, size: int, mtime_ns: int, registry) -> tuple[Checkpoint, dict]:
    p = Path(path)
    shapes, header = read_header(p) if p.suffix == ".safetensors" else _read_pickle(p)
    shapes, unet_only = _unet_view(shapes)
    found = model_type(shapes)
    if found not in SUPPORTED:
        raise _refused(p, found)
    kind, first = SUPPORTED[found]
    name, config = _matching_config(p, shapes, first, registry())
    return Checkpoint(path, found, kind, name, size, hashlib.sha256(header).hexdigest(), unet_only), config


def _from_header(config: dict, shapes: dict) -> dict:
    """The config with what the header shows: input and output channels, cross-attention width, SDXL's
    added-embedding width."""
    out = dict(config)
    get = lambda k: shapes.get(PREFIX + k)  # noqa: E731
    if get("input_blocks.0.0.weight"):
        out["in_channels"] = get("input_blocks.0.0.weight")[1]
    if get("out.2.weight"):
        out["out_channels"] = get("out.2.weight")[0]
    cross = next((s[-1] for k, s in shapes.items() if k.startswith(PREFIX) and k.endswith("attn2.to_k.weight")), None)
    if cross:
        out["cross_attention_dim"] = cross
    if get("label_emb.0.0.weight") and out.get("addition_embed_type") == "text_time":
        out["projection_class_embeddings_input_dim"] = get("label_emb.0.0.weight")[1]
    return out


def _matching_config(path: Path, shapes: dict, first: str, known: list) -> tuple[str, dict]:
    """The registry U-Net config (the kind's own first, then the others of the same first-level width) whose U-Net
    has exactly the file's U-Net tensors; else an InputError naming the first difference from the kind's own."""
    mine = {k[len(PREFIX):]: s for k, s in shapes.items() if k.startswith(PREFIX)}
    if not mine:
        raise InputError(f"{path.name} holds no U-Net tensors (none under {PREFIX}, nor bare LDM names such as "
                         "input_blocks.0.0.weight): give a checkpoint with a U-Net")
    width = (mine.get("input_blocks.0.0.weight") or (None,))[0]
    by_name = {name: (kind, config) for name, kind, config in known}
    problem = None
    for name in [first] + [n for n in by_name if n != first]:
        kind, base = by_name[name]
        if kind != "unet" or base["block_out_channels"][0] != width:
            continue
        config = _from_header(base, shapes)
        diff = _difference(mine, ldm_shapes(config))
        if diff is None:
            return name, config
        problem = problem or (name, diff)
    where = f"the {problem[0]} config ({problem[1]})" if problem else f"any config (its first level is {width} wide)"
    raise InputError(f"{path.name}: its U-Net does not match {where}: attnprof knows the U-Nets of "
                     "configs/models; add a config of this U-Net there")


def _difference(mine: dict, expected: dict) -> str | None:
    for key, shape in expected.items():
        if key not in mine:
            return f"the file lacks {key}"
        if tuple(mine[key]) != tuple(shape):
            return f"{key} is {list(mine[key])} in the file, {list(shape)} in the config"
    extra = sorted(set(mine) - set(expected))
    return f"the file has {extra[0]}, which the config's U-Net lacks" if extra else None


def ldm_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """{LDM name: shape} of the U-Net a config builds (on the meta device: no memory)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    return {k: tuple(v.shape) for k, v in ldm_state_dict(unet.state_dict(), config, prefix="").items()}


def ldm_state_dict(state: dict, config: dict, prefix: str = PREFIX) -> dict:
    """A diffusers U-Net's state dict under its LDM names, as a whole-pipeline file holds it (prefix) or a U-Net
    alone ('')."""
    return {prefix + ldm_key(k, config): v for k, v in state.items()}


_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}


def ldm_key(key: str, config: dict) -> str:
    """The LDM (original layout) name of a diffusers UNet2DConditionModel tensor: the inverse of diffusers'
    convert_ldm_unet_checkpoint, without the 'model.diffusion_model.' prefix."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = {**DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"], **DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"]}
    if key in fixed:
        return fixed[key]
    n = config["layers_per_block"] + 1  # LDM's layers per level: the resnets and the down / up sampler
    part = key.split(".")
    resnet = lambda rest: ".".join([_RESNET.get(rest[0], rest[0]), *rest[1:]])  # noqa: E731
    if part[0] == "mid_block":  # middle_block.0 resnet, .1 attention, .2 resnet
        j = int(part[2])
        return f"middle_block.{2 * j}.{resnet(part[3:])}" if part[1] == "resnets" else \
            f"middle_block.{2 * j + 1}.{'.'.join(part[3:])}"
    b, what, j, rest = int(part[1]), part[2], int(part[3]), part[4:]
    if part[0] == "down_blocks":
        if what == "downsamplers":
            return f"input_blocks.{1 + b * n + n - 1}.0.op.{rest[-1]}"
        return f"input_blocks.{1 + b * n + j}." + (f"0.{resnet(rest)}" if what == "resnets" else f"1.{'.'.join(rest)}")
    if what == "upsamplers":  # after the attention where the block has one
        with_attention = config["up_block_types"][b].startswith("CrossAttn")
        return f"output_blocks.{b * n + n - 1}.{2 if with_attention else 1}.{'.'.join(rest)}"
    return f"output_blocks.{b * n + j}." + (f"0.{resnet(rest)}" if what == "resnets" else f"1.{'.'.join(rest)}")


def load_unet(checkpoint: Checkpoint, config: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The file's U-Net with its weights, on `device` in `dtype`: only the U-Net's tensors are read."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    path = Path(checkpoint.path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys() if checkpoint.unet_only or k.startswith(PREFIX)}
    else:
        state = {k: v for k, v in _pickle_state(path, "cpu").items() if checkpoint.unet_only or k.startswith(PREFIX)}
    if not any(k.startswith(PREFIX) for k in state):
        state = {PREFIX + k: v for k, v in state.items()}
    weights = convert_ldm_unet_checkpoint(state, config)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    unet.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()}, strict=True, assign=True)
    return unet.eval()
