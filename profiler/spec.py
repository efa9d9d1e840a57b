"""What to measure: sizes, dtypes, memory sizes and the frozen cell spec. Parsing here raises InputError with one clear
line."""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

from .errors import InputError  # noqa: F401 (what the parsers here raise; importers take it from here)


def load_yaml(text: str, where: str):
    """The YAML document of a config's text; a syntax error as one line naming the file, line and column."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(f"{where}: not valid YAML{at} ({problem}): fix the file") from None


DTYPES = ("float16", "bfloat16", "float32")  # names only: spec imports no torch, so that building the command line's
# parser (every command, --help too) does not cost its second of CPU
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # bytes per element, as torch.dtype.itemsize says
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def parse_dtype(name: str) -> str:
    """Canonical dtype name ('float16', 'bfloat16', 'float32') from a name or common alias."""
    canon = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canon not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return canon


def torch_dtype(name: str):
    import torch

    return getattr(torch, parse_dtype(name))


def _flag(v):
    if isinstance(v, bool) or str(v).lower() in ("true", "false"):
        return str(v).lower() == "true"


def _flag_or_path(v):
    """true or false, or a path (a ControlNet of one's own: its folder or config.json, checked where models are
    known: workload.check_settings)."""
    flag = _flag(v)
    return flag if flag is not None else v if isinstance(v, str) and v.strip() else None


def _controlnet_words(v) -> str:
    return "controlnet" if v is True else f"controlnet {os.path.basename(str(v).rstrip('/'))}" if v else \
        "no controlnet"


def _count(v):
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0 or str(v).isdigit():
        return int(v)


def _ratio(v):
    try:
        ratio = float(v)
    except (TypeError, ValueError):
        return None
    return ratio if 0 <= ratio < 1 and not isinstance(v, bool) else None


def _one_of(choices: tuple):
    return lambda v: v if v in choices else None


class Setting(NamedTuple):
    kinds: tuple[str, ...]  # the kinds of model it applies to (kinds.KINDS: unet, vae, ...; VIDEO: those with frames)
    default: object
    takes: str  # what it takes, as its error says
    read: Callable[[object], object]  # a value as given (YAML, the command line) in its own type; None: refused
    words: Callable[[object], str]  # a value as people read it (settings_label)
    config_key: str | None = None  # where the model's config gives the default, its key (default: where it has none)
    always: bool = False  # kept in a cell's settings at its default too (a video model's frames: what its cells are)


COMPILE_MODES = ("none", "regional", "full")
VAE_PARTS = ("decoder", "encoder")
VIDEO = "video"  # in a Setting's kinds: every kind whose record takes frames (kinds.Kind.frames)
SETTINGS = {  # everything the code knows of a model's setting, one entry each
    "controlnet": Setting(("unet",), False, "true or false (the registry's ControlNet of the U-Net), or a "
                          "ControlNet's own folder or config.json", _flag_or_path, _controlnet_words),
    "ip_adapter_tokens": Setting(("unet",), 0, "a whole number of image tokens >= 0 (4: IP-Adapter, 16: IP-Adapter "
                                 "plus)", _count, lambda v: f"ip-adapter {v} tokens"),
    "tome": Setting(("unet",), 0.0, "a merge ratio from 0 up to (not including) 1, e.g. 0.5", _ratio,
                    lambda v: f"tome {v:g}"),
    "compile": Setting(("unet",), "none", "none, regional (diffusers' compile_repeated_blocks) or full "
                       "(torch.compile)", _one_of(COMPILE_MODES), lambda v: f"compiled ({v})" if v != "none"
                       else "eager"),
    "frames": Setting((VIDEO,), 16, "a whole number of frames >= 1 (default: the model's, 16 for AnimateDiff, its config's "
                      "num_frames for SVD)", lambda v: _count(v) or None, lambda v: f"{v} frames", "num_frames",
                      always=True),
    "vae_part": Setting(("vae",), "decoder", " or ".join(VAE_PARTS), _one_of(VAE_PARTS), lambda v: f"vae {v}"),
    "vae_tiling": Setting(("vae",), False, "true or false", _flag, lambda v: "tiling" if v else "no tiling"),
    "vae_slicing": Setting(("vae",), False, "true or false", _flag, lambda v: "slicing" if v else "no slicing"),
    "vae_upcast": Setting(("vae",), False, "true or false (default: the VAE config's force_upcast)", _flag,
                          lambda v: "upcast to float32" if v else "no upcast", "force_upcast"),
}


def setting_value(name: str, value):
    """A setting's value as given (YAML, the command line) in its own type, checked: what the grid and
    check_settings both read."""
    read = SETTINGS[name].read(value)
    if read is None:
        raise InputError(f"setting {name}={value!r}: use {SETTINGS[name].takes}")
    return read


def settings_label(settings_json: str | None) -> str:
    """A cell's settings as people read them: 'controlnet, ip-adapter 16 tokens, tome 0.5', or '' for none."""
    s = json.loads(settings_json) if isinstance(settings_json, str) and settings_json else {}
    return ", ".join(SETTINGS[k].words(v) for k, v in sorted(s.items()))


_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height); both positive multiples of 8 (the VAE's downscale)."""
    m = _SIZE.match(str(text))
    if not m:
        raise InputError(f"malformed size {text!r}: write WIDTHxHEIGHT in pixels, e.g. 512x512 or 832x1216")
    width, height = int(m.group(1)), int(m.group(2))
    for what, v in (("width", width), ("height", height)):
        if v <= 0 or v % 8:
            raise InputError(f"size {text!r}: {what} {v} is not a positive multiple of 8 "
                             "(the latent is 1/8 of the image)")
    return width, height


def parse_options(pairs) -> dict:
    """--option KEY=VALUE (repeatable) as a dict: each value JSON where it reads as JSON, else the text."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"backend option {pair!r} is not KEY=VALUE: e.g. --option slice_size=4")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_batch(value) -> int:
    try:
        batch = int(value)
    except (TypeError, ValueError):
        raise InputError(f"batch {value!r} is not a whole number: use 1 or more") from None
    if batch < 1 or str(value).strip() != str(batch):
        raise InputError(f"batch {value!r} is below 1 or not a whole number: use 1 or more")
    return batch


MiB, GiB = 2**20, 2**30
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": MiB, "gib": GiB,
          "tib": 2**40}
SIZE_HINT = ("write a unit, e.g. 24GiB (2^30 bytes each) or 24GB (10^9), or a GPU by name, e.g. 4090 (attnprof gpus "
             "lists them)")


def parse_bytes(value, where: str) -> int:
    """A memory size: a number with its unit (B, KB / MB / GB / TB in powers of 10, KiB / MiB / GiB / TiB in powers of
    2), or a GPU's name from the GPU table (profiler/gpus.py: its memory). A number without a unit is refused: 8 would
    be 8 bytes."""
    from . import gpus

    gpu = gpus.find(value) if isinstance(value, str) else None
    if gpu is not None:
        return gpu["memory_bytes"]
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, bool) or not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise InputError(f"{where}: {value!r} is not a size: {SIZE_HINT}")
    if not m.group(2):
        raise InputError(f"{where}: {value!r} has no unit (it would mean {value} bytes): {SIZE_HINT}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_text(value) -> str:
    """What a size given to parse_bytes means, in words: '24GB = 24.0e9 bytes = 22.35 GiB', '4090 = the RTX-4090's
    24 GiB (source)'."""
    from . import gpus

    n = parse_bytes(value, "size")
    gpu = gpus.find(value) if isinstance(value, str) else None
    if gpu is not None:
        return f"{value} = the {gpu['name']}'s {gpu['memory_gib']} GiB ({gpu['source']})"
    return f"{str(value).strip()} = {n:,} bytes = {n / GiB:.2f} GiB = {n / 1e9:.2f} GB"


@dataclass(frozen=True)
class CellSpec:
    """One measurement: what to run. Results never mutate it; `cell_id` keys grouping, resume and comparison."""

    model: str
    width: int
    height: int
    batch: int
    dtype: str
    backend: str
    device: str
    backend_options: tuple[tuple[str, object], ...] = field(default=())
    settings: tuple[tuple[str, object], ...] = field(default=())  # the model's (SETTINGS), non-default only

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def cell_id(self) -> str:
        spec = asdict(self)
        if not self.settings:  # a cell with no settings keeps the id it had before settings existed
            del spec["settings"]
        blob = json.dumps(spec, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    @property
    def options(self) -> dict:
        return dict(self.backend_options)

    @classmethod
    def from_row(cls, row: dict) -> "CellSpec":
        """The spec of a stored or sent row (as_row's inverse)."""
        fields = {k: row[k] for k in cls.__dataclass_fields__ if k not in ("backend_options", "settings")}
        settings = json.loads(row.get("settings") or "{}")
        return cls(**fields, backend_options=tuple(sorted(json.loads(row["backend_options"]).items())),
                   settings=tuple(sorted(settings.items())))

    def as_row(self) -> dict:
        row = asdict(self)
        row["backend_options"] = json.dumps(self.options, sort_keys=True)
        row["settings"] = json.dumps(dict(self.settings), sort_keys=True)
        row["cell_id"] = self.cell_id
        return row
