"""The recorder: one flat row per attention call of a model (a U-Net, a U-Net with its ControlNet, a VAE, a user's
pipeline component, its CLIP text encoder), grouped by forward pass, recorded by hooks on every diffusers Attention
module and every transformers CLIP attention module; a backend's processors swapped in (through
Attention.set_processor, diffusers' modules only) for the duration where one is asked for."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

import torch

from .. import devices
from ..spec import InputError
from ..unet.kinds import temporal_paths
from .chunked import score_size

_STAGES = {"down_blocks": "down", "mid_block": "mid", "up_blocks": "up"}


def block_position(block: str, n_levels: int) -> tuple[str, int]:
    """(stage, level) of a module path, under any prefix (controlnet., encoder., decoder.). Level = number of
    downsamplings above the block: down_blocks.i -> i, mid -> n_levels - 1, up_blocks.i -> n_levels - 1 - i."""
    parts = block.split(".")
    at = next((i for i, p in enumerate(parts) if p in _STAGES), None)
    if at is None:
        return "other", 0
    stage = _STAGES[parts[at]]
    if stage == "down":
        return stage, int(parts[at + 1])
    if stage == "up":
        return stage, n_levels - 1 - int(parts[at + 1])
    return stage, n_levels - 1


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every diffusers Attention module of the model by the path the recorder reports: a wrapper's child (ToMe's
    `merged`, IP-Adapter's `text`: profiler.unet.adapters.WRAPPED) under its parent's path, a pipeline step's U-Net
    (`unet.`) and a VAE part's VAE (`vae.`) under their own paths."""
    from diffusers.models.attention_processor import Attention

    from ..unet.adapters import WRAPPED

    out = {}
    for path, module in model.named_modules():
        if isinstance(module, Attention):
            for suffix in WRAPPED:
                path = path.replace(suffix, "")
            out[path.removeprefix("unet.").removeprefix("vae.")] = module
    return out


CLIP_ATTENTION = "CLIPAttention"  # transformers' CLIP attention (text and image encoders); its SDPA and flash
# subclasses (CLIPSdpaAttention, CLIPFlashAttention2 in transformers 4) are found by their class's ancestry


def clip_attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every transformers CLIP attention module of the model by its path (a text encoder's
    `text_model.encoder.layers.0.self_attn`): recorded at its forward as diffusers' modules are, and run as
    transformers runs it (no backend's processor reaches it: it has none)."""
    return {path: m for path, m in model.named_modules()
            if any(k.__name__ == CLIP_ATTENTION for k in type(m).__mro__)}


# An attention module's projections, by attribute: diffusers' Attention (q, k, v; the added-KV / joint ones; fused
# q/k/v where fuse_projections made them), transformers' CLIP attention; the output's (to_out[0]) apart: a ModuleList
PROJECTIONS = ("to_q", "to_k", "to_v", "to_qkv", "to_kv", "add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv",
               "to_add_out", "q_proj", "k_proj", "v_proj", "out_proj")


def projection_modules(attn: torch.nn.Module) -> list[torch.nn.Module]:
    """The projection modules an attention call runs around its core (PROJECTIONS and to_out[0]: nn.Linear, or a
    LoRA layer wrapping one), those the module has."""
    named = [getattr(attn, n, None) for n in PROJECTIONS]
    out = getattr(attn, "to_out", None)
    named.append(out[0] if isinstance(out, torch.nn.ModuleList) and len(out) else out)
    return [m for m in named if isinstance(m, torch.nn.Module)]


def unrecorded_attention(model: torch.nn.Module) -> dict[str, int]:
    """The attention modules of the model that no hook here records, counted by class: the innermost modules whose
    class is named '...Attention' (T5's T5Attention, not its T5LayerSelfAttention around it; FLUX's; torch's
    MultiheadAttention) that are neither diffusers' Attention nor CLIP's (nor hold one)."""
    from diffusers.models.attention_processor import Attention

    named = {id(m) for m in model.modules() if type(m).__name__.endswith("Attention")}
    out: dict[str, int] = {}
    for m in model.modules():
        if id(m) not in named or isinstance(m, Attention) or any(k.__name__ == CLIP_ATTENTION
                                                                  for k in type(m).__mro__):
            continue
        if not any(id(c) in named for c in m.modules() if c is not m):  # the innermost
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def describe_call(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                  block: str = "") -> dict:
    """The shape figures of one attention call, from its inputs (works on the meta device). Its kind: self, cross,
    image (IP-Adapter's image tokens, our adapter's), temporal (a video U-Net's attention over frames: its motion
    modules, its temporal transformer blocks; tokens = frames, batch = videos x positions), added-kv (a SimpleCrossAttn
    block's AttnAddedKVProcessor: its keys are the conditioning tokens and, but with only_cross_attention, every
    position of the block too). diffusers' IP-Adapter passes (text, [image embeddings]) as encoder_hidden_states: the
    text is the call's keys, the image tokens it also attends to (in the same processor call) are `ip_tokens_k`.
    attn is a diffusers Attention module or a transformers CLIP attention (num_heads, head_dim; its eager path takes
    the softmax in float32)."""
    images = None
    if isinstance(encoder_hidden_states, tuple):
        encoder_hidden_states, images = encoder_hidden_states
    batch = hidden_states.shape[0]
    tokens_q = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
    tokens_k = tokens_q if encoder_hidden_states is None else encoder_hidden_states.shape[1]
    added_kv = getattr(attn, "added_kv_proj_dim", None) is not None
    if added_kv and not attn.only_cross_attention and encoder_hidden_states is not None:
        tokens_k += tokens_q  # the block's own positions, concatenated after the conditioning tokens'
    kind = "added-kv" if added_kv else "self" if encoder_hidden_states is None else \
        "image" if block.endswith(".image") else "cross"
    if kind == "self" and any(part in block for part in temporal_paths()):
        kind = "temporal"
    heads = getattr(attn, "heads", None) or attn.num_heads  # diffusers' Attention; transformers' CLIP attention
    head_dim = attn.inner_dim // heads if hasattr(attn, "inner_dim") else attn.head_dim
    eager = getattr(getattr(attn, "config", None), "_attn_implementation", None) == "eager"  # CLIP's own softmax
    upcast = "attention" if getattr(attn, "upcast_attention", False) else \
        "softmax" if getattr(attn, "upcast_softmax", False) or eager else ""  # diffusers' AttnProcessor's float32
    score_elements = batch * heads * tokens_q * tokens_k
    return {
        "kind": kind,
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "tokens_q": tokens_q,
        "tokens_k": tokens_k,
        "score_elements": score_elements,
        "upcast": upcast,
        "score_bytes": score_elements * score_size(upcast, hidden_states.element_size()),
        "flops": 4 * batch * heads * tokens_q * tokens_k * head_dim,
        **({"ip_tokens_k": sum(int(e.shape[-2]) for e in images)} if images is not None else {}),
    }


@contextmanager
def swapped(model: torch.nn.Module, make: Callable[[str, object], object], modules: dict | None = None):
    """Every Attention module's processor (of `modules`, default attention_modules(model)) replaced by make(block
    path, its original processor) for the duration; the originals restored on exit, also when the block raises. A
    processor map's (mix.Unplaced) gives each block its own."""
    from .processor import for_module

    modules = modules or attention_modules(model)
    originals = {block: m.processor for block, m in modules.items()}
    try:
        for block, module in modules.items():
            made = make(block, originals[block])
            made = made.for_block(block) if hasattr(made, "for_block") else made
            fitted = for_module(made, module)
            if fitted is None:  # the preflight refuses such a cell: here only by mistake, never run wrongly
                raise InputError(f"{type(made).__name__} cannot stand in for {block}'s "
                                 f"{type(originals[block]).__name__} (added-KV attention): no backend but naive and "
                                 "sdpa runs there")
            module.set_processor(fitted)
        yield originals
    finally:
        for block, module in modules.items():
            module.set_processor(originals[block])


def call_inputs(args: tuple, kwargs: dict) -> tuple:
    """(hidden_states, encoder_hidden_states) of an Attention module's forward, as diffusers' blocks pass them
    (positionally or by name)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
    return hidden, context


class Recorder:
    """Context manager: `with Recorder(model, processor=factory, around=meter) as rec: model(**inputs)`.

    Records one row per attention call at the call itself: a forward pre-hook and a forward hook on every diffusers
    Attention module (PyTorch's own seam), so that whatever processor runs (the module's own, a backend's, one that a
    pipeline sets mid-call) is recorded and left as it is. processor: None keeps each module's own processor; a
    callable returns a new processor per module (a backend), swapped in through Attention.set_processor and the
    originals restored on exit, also when the forward raises. around: a meter (measure/probes.CallTimer) told as each
    call begins (before(row)) and ends (after(row), also when the call raises). levels: the model's resolution levels
    (default: its config's block_out_channels). A new pass begins at every forward of the model, or of each module of
    `passes` (a VAE's decoder and encoder: a pipeline calls vae.decode, not its forward). modules: its attention
    modules by path, where the caller has them (default: attention_modules(model)); a CLIP attention among them
    (clip_attention_modules) is recorded as they are and never swapped. Where NVTX ranges are on (devices.nvtx:
    --nvtx, or under nsys) each call is one, named by its block path, inside one per pass, `step N` (N: the pass
    index); label and step put a component's name before them (`unet.<block>`, `unet step N`, `vae forward N`)."""

    def __init__(self, unet: torch.nn.Module, processor: Callable[[], object] | None = None,
                 around=None, levels: int | None = None, passes: list | None = None, modules: dict | None = None,
                 label: str = "", step: str = "step"):
        self.unet, self.processor, self.around, self.modules = unet, processor, around, modules
        self.label, self.step, self.nvtx, self._pushed = label, step, None, 0
        self.pass_modules = passes or [unet]
        config = getattr(unet, "config", None)
        self.levels = levels or len(getattr(config, "block_out_channels", None) or [0])
        self.rows: list[dict] = []
        self.current_pass: list[dict] = []
        self.pass_index = -1
        self._swap = None
        self._hooks: list = []
        self._open: list[dict] = []

    def __enter__(self) -> "Recorder":
        modules = self.modules or attention_modules(self.unet)
        if self.processor:  # diffusers' modules only: a CLIP attention has no processor to swap
            self._swap = swapped(self.unet, lambda block, original: self.processor(),
                                 {b: m for b, m in modules.items() if hasattr(m, "set_processor")})
            self._swap.__enter__()
        try:
            for block, module in modules.items():
                stage, level = block_position(block, self.levels)
                self._hooks.append(module.register_forward_pre_hook(
                    functools.partial(self._begin, block, stage, level), with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._end, with_kwargs=True, always_call=True))
            self._hooks += [m.register_forward_pre_hook(self._new_pass) for m in self.pass_modules]
            self.nvtx = devices.nvtx()
            if self.nvtx:  # the pass's range ends with it
                self._hooks += [m.register_forward_hook(lambda *_: self._pop(), always_call=True)
                                for m in self.pass_modules]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _begin(self, block: str, stage: str, level: int, module, args, kwargs) -> None:
        hidden, context = call_inputs(args, kwargs)
        row = {"pass_index": self.pass_index, "call_index": len(self.current_pass), "block": block, "stage": stage,
               "level": level, **describe_call(module, hidden, context, block)}
        self.current_pass.append(row)
        self.rows.append(row)
        self._open.append(row)
        self._push(f"{self.label}.{block}" if self.label else block)
        if self.around:
            self.around.before(row)

    def _end(self, module, args, kwargs, output) -> None:
        row = self._open.pop()
        if self.around:
            self.around.after(row)
        self._pop()

    def _new_pass(self, module, args) -> None:
        self.pass_index += 1
        self.current_pass = []
        self._push(" ".join(w for w in (self.label, self.step, str(self.pass_index)) if w))

    def _push(self, name: str) -> None:
        if self.nvtx:
            self.nvtx.range_push(name)
            self._pushed += 1

    def _pop(self) -> None:
        if self.nvtx and self._pushed:
            self.nvtx.range_pop()
            self._pushed -= 1

    def __exit__(self, *exc) -> None:
        while self._pushed:  # the ranges a Ctrl-C left open (KeyboardInterrupt passes by forward hooks)
            self._pop()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._swap:
            self._swap.__exit__(None, None, None)
            self._swap = None

    def passes(self) -> list[list[dict]]:
        grouped: dict[int, list[dict]] = {}
        for row in self.rows:
            grouped.setdefault(row["pass_index"], []).append(row)
        return [grouped[k] for k in sorted(grouped)]
