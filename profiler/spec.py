"""What to measure: sizes, dtypes and the frozen cell spec. Parsing here raises InputError with one clear line."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

import torch


class InputError(ValueError):
    """Bad input from the user: the CLI prints the message as one line and exits with code 2."""


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


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def parse_dtype(name: str) -> str:
    """Canonical dtype name ('float16', 'bfloat16', 'float32') from a name or common alias."""
    canon = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canon not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return canon


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[parse_dtype(name)]


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


def parse_batch(value) -> int:
    try:
        batch = int(value)
    except (TypeError, ValueError):
        raise InputError(f"batch {value!r} is not a whole number: use 1 or more") from None
    if batch < 1 or str(value).strip() != str(batch):
        raise InputError(f"batch {value!r} is below 1 or not a whole number: use 1 or more")
    return batch


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
    settings: tuple[tuple[str, object], ...] = field(default=())  # the model's (workload.SETTINGS), non-default only

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
