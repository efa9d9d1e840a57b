"""A processor map put in place on a user's model: profiler.apply(pipe, "tuned.json") and profiler.processors(...)
(pipe.unet.set_attn_processor(profiler.processors("tuned.json")), diffusers' own seam). apply keeps the model's own
processors and puts them back on apply(pipe, None)."""
from __future__ import annotations

from pathlib import Path

import torch

from . import backends, mix
from ..errors import InputError
from .processor import for_module
from .recorder import attention_modules

OWN = "_attnprof_own_processors"  # on the model while a map is applied: its own processors, by block


def map_options(processor_map) -> dict:
    """A map as a cell's options ({"file", "map"}: backends.check_options): from its file's path, its document (a
    dict as the file holds it), or what profiler.tune returned (its `map`)."""
    doc = getattr(processor_map, "map", processor_map)
    if isinstance(doc, (str, Path)):
        return backends.check_options(str(doc), {})
    if not isinstance(doc, dict) or not isinstance(doc.get("blocks"), dict):
        raise InputError(f"profiler.apply: {type(doc).__name__} is not a processor map: give the path of one "
                         "(tuned.json), its JSON as a dict, or what profiler.tune returned")
    text = mix.canonical(mix.entries(doc, "processor map"))
    return backends.check_options(mix.NAME, {"file": doc.get("file") or "map", "map": text})


def elsewhere(options: dict, modules: dict) -> str | None:
    """One line where a map was tuned for another model than the one it is put on: blocks it lists that the model
    lacks, or whose head dim (tune writes it per block) is not the module's (a map of tiny-sd15 on SD 1.5: the same
    blocks, head dims 4 and 8 against 40 to 160); None where every listed block is the model's own shape."""
    blocks = mix.parsed(options["map"])["blocks"]
    off = [b for b, (_, _, dim) in blocks.items()
           if b not in modules or (dim and dim != modules[b].inner_dim // modules[b].heads)]
    if not off:
        return None
    b = off[0]
    why = "not in this model" if b not in modules else \
        f"head dim {blocks[b][2]} there, {modules[b].inner_dim // modules[b].heads} here"
    return (f"processor map {options['file']}: {len(off)} of its {len(blocks)} blocks are not this model's ({b}: "
            f"{why}): it was tuned for another model, its choices timed on other shapes (profiler.tune this one)")


def denoiser(target) -> torch.nn.Module:
    """The model a map is for: the target if it is a module (pipe.unet), else a pipeline's U-Net."""
    if isinstance(target, torch.nn.Module):
        return target
    found = getattr(target, "unet", None)
    if not isinstance(found, torch.nn.Module):
        raise InputError(f"profiler.apply: {type(target).__name__} has no U-Net (pipe.unet): give the pipeline or "
                         "its U-Net")
    return found


def processors(processor_map, model: torch.nn.Module | None = None) -> dict:
    """{'<block>.processor': a new processor} for diffusers' set_attn_processor: one per block the map lists, or
    with `model` one per Attention module of it (the map's default where it lists none), each fitted to its module."""
    options = map_options(processor_map)
    made = mix.Unplaced(options["map"], backends.make_processor)
    if model is None:
        return {f"{block}.processor": made.for_block(block) for block in mix.parsed(options["map"])["blocks"]}
    out = {}
    for block, module in attention_modules(model).items():
        out[f"{block}.processor"] = for_module(made.for_block(block), module)
        if out[f"{block}.processor"] is None:
            raise InputError(f"processor map: {mix.of_block(options['map'], block)[0]} cannot stand in for {block} "
                             "(added-KV attention: naive and sdpa run there): give that block naive or sdpa")
    return out


def apply(target, processor_map) -> None:
    """Put the map's processors on the target's U-Net (every Attention module: its block's backend, the map's
    default where it lists none); None puts back the processors it had before the first apply."""
    model = denoiser(target)
    modules = attention_modules(model)
    own = getattr(model, OWN, None)
    if processor_map is None:
        for block, module in modules.items():
            if own and block in own:
                module.set_processor(own[block])
        if own is not None:
            delattr(model, OWN)
        return
    made = processors(processor_map, model)  # every one made before any is set: a bad map changes nothing
    line = elsewhere(map_options(processor_map), modules)
    if line:
        import warnings

        warnings.warn(line, stacklevel=2)
    if own is None:
        setattr(model, OWN, {block: m.processor for block, m in modules.items()})
    for block, module in modules.items():
        module.set_processor(made[f"{block}.processor"])
