"""A processor map: one attention backend per block, as attnprof tune writes it and `attnprof run --backend
tuned.json`, `record --backend tuned.json`, profiler.apply and profiler.processors read it.

The file is JSON: {"blocks": {block path: {"backend": NAME, "options": {...}, ...}}, "default": {"backend": NAME,
"options": {...}}, ...}; a block path is the recorder's (down_blocks.0.attentions.0.transformer_blocks.0.attn1), the
default runs every block the map does not list, and every other key (a block's time, its runner-up, why it was
chosen; the proof of the tune that wrote it) is for people and is not read here; the model and size it was tuned for
are read only to warn where it runs on others (elsewhere). A measured cell of
a map has the backend `tuned` and two options: `file` (the file's name, what its label shows: 'tuned (tuned.json)')
and `map` (what runs, as canonical JSON: {"blocks": {block: [name, options, head_dim]}, "default": [name, options]}),
so that the map travels with the cell to any worker and the cell's id is the same in every run of the same map.

This module reads and resolves maps and imports no other of attnprof's: backends.py checks each entry's backend and
makes its processors."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

from ..errors import InputError

NAME = "tuned"  # the backend of a map's cells
FILE_SUFFIX = ".json"


def is_map(name) -> bool:
    """Whether a backend name is a processor map: `tuned` (a cell's, with the map in its options) or a .json file."""
    return isinstance(name, str) and (name == NAME or name.endswith(FILE_SUFFIX))


def read(path) -> dict:
    """The map file's document, its structure checked (not its backends: backends.check_options does that); one line
    naming the file and the fix where it is not a map."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise InputError(f"processor map {path}: cannot be read ({e.strerror}): give a map that attnprof tune "
                         "wrote (tuned.json beside its run)") from None
    except ValueError as e:
        raise InputError(f"processor map {path}: not valid JSON ({e}): fix the file or tune again") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("blocks"), dict):
        raise InputError(f"processor map {path}: no \"blocks\" mapping (block path -> {{\"backend\": NAME}}): give a "
                         "map that attnprof tune wrote")
    return doc


def elsewhere(doc: dict, path, model: str, sizes) -> str | None:
    """One warning line where a map tuned for one model and size (the model, width and height attnprof tune wrote in
    it) is asked to run another model or size, naming both; None where it is the same, or the map does not say. A
    map profiler.tune made of a user's pipeline names its classes ('StableDiffusionPipeline UNet2DConditionModel'),
    not a model of the registry: its size alone is compared."""
    made, size = doc.get("model"), (doc.get("width"), doc.get("height"))
    if not isinstance(made, str) or not all(isinstance(v, int) for v in size):
        return None
    other = [f"{w}x{h}" for w, h in sizes if (w, h) != size]
    if (made == model or " " in made) and not other:
        return None
    asked = ", ".join(other or [f"{w}x{h}" for w, h in sizes])
    return (f"warning: processor map {path} was made for {made} at {size[0]}x{size[1]}; this is {model} at {asked}: "
            f"its blocks' choices were timed on other shapes (attnprof tune --model {model} --size WxH for these)")


def _entry(value, where: str) -> list:
    """[name, options, head_dim or None] of one entry of a map file."""
    if isinstance(value, str):
        value = {"backend": value}
    if not isinstance(value, dict) or not isinstance(value.get("backend"), str):
        raise InputError(f"{where}: {value!r} is not {{\"backend\": NAME, \"options\": {{...}}}}")
    options = value.get("options") or {}
    if not isinstance(options, dict):
        raise InputError(f"{where}: options {options!r} are not a mapping")
    head_dim = value.get("head_dim")
    return [value["backend"], options, head_dim if isinstance(head_dim, int) else None]


def entries(doc: dict, where: str) -> dict:
    """What runs, from a map file's document: {"blocks": {block: [name, options, head_dim]}, "default": [name,
    options, None] or None}."""
    blocks = {b: _entry(v, f"{where}: block {b}") for b, v in sorted(doc["blocks"].items())}
    default = _entry(doc["default"], f"{where}: default") if doc.get("default") is not None else None
    if not blocks and default is None:
        raise InputError(f"{where}: the map names no block and no default: give at least one")
    return {"blocks": blocks, "default": default}


def canonical(table: dict) -> str:
    """The map's entries as one canonical JSON text: a cell's option `map`."""
    return json.dumps(table, sort_keys=True, separators=(",", ":"))


def table_of(text: str) -> dict:
    """A cell's option `map` read back: {"blocks", "default"} as canonical() wrote them."""
    try:
        table = json.loads(text)
        if isinstance(table, dict) and isinstance(table.get("blocks"), dict) and "default" in table:
            return table
    except (TypeError, ValueError):
        pass
    raise InputError("backend tuned: option map is not a processor map's entries: give --backend FILE.json")


parsed = functools.lru_cache(maxsize=64)(table_of)  # the same, cached (never to be changed): every call of a
# forward asks for its block's entry


def of_block(text: str, block: str) -> tuple[str, dict]:
    """(backend, options) of one block under the map (its entry, else the map's default)."""
    table = parsed(text)
    found = table["blocks"].get(block) or table["default"]
    if found is None:
        raise InputError(f"processor map: block {block} is not in it and it has no default: tune this model again, "
                         "or add \"default\": {\"backend\": NAME} to the file")
    return found[0], dict(found[1])


def parts(text: str) -> dict[str, dict]:
    """{backend: options} of every backend the map runs (its default too)."""
    table = parsed(text)
    found = [*table["blocks"].values(), *([table["default"]] if table["default"] else [])]
    return {name: dict(options) for name, options, _ in found}


def head_dims(text: str, name: str) -> tuple[int, ...] | None:
    """The head dims of the blocks the map gives this backend, where every one of them says (a tuned map's do);
    None where some do not (or it is the default: any block)."""
    table = parsed(text)
    if table["default"] and table["default"][0] == name:
        return None
    dims = [d for n, _, d in table["blocks"].values() if n == name]
    return tuple(sorted(set(dims))) if dims and None not in dims else None


def label(name: str, options: dict) -> str:
    """'tuned (tuned.json)': how every text names a map's cell."""
    file = options.get("file") if name == NAME else Path(name).name
    return f"{NAME} ({file or 'map'})"


class Unplaced:
    """What backends.make_processor gives for a map: a processor per block, which recorder.swapped and apply ask
    for by the block's path (for_block); called as a processor itself, it says how to put it in place."""

    def __init__(self, text: str, make: Callable):
        self.text, self.make = text, make

    def for_block(self, block: str):
        name, options = of_block(self.text, block)
        return self.make(name, **options)

    def __call__(self, *args, **kwargs):
        raise InputError("a processor map runs one backend per block: put it in place with profiler.apply(pipe, MAP) "
                         "or pipe.unet.set_attn_processor(profiler.processors(MAP))")
