"""The recorder: wraps the processor of every diffusers Attention module of a model (a U-Net, a U-Net with its
ControlNet, a VAE; through Attention.set_processor) and records one flat row per attention call, grouped by forward
pass."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

Thunk = Callable[[], torch.Tensor]
Around = Callable[[dict, Thunk], torch.Tensor]  # runs the call, may add measured fields to the row

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
    `merged`, IP-Adapter's `text`: profiler.adapters.WRAPPED) under its parent's path, a pipeline step's U-Net
    (`unet.`) and a VAE part's VAE (`vae.`) under their own paths."""
    from diffusers.models.attention_processor import Attention

    from .adapters import WRAPPED

    out = {}
    for path, module in model.named_modules():
        if isinstance(module, Attention):
            for suffix in WRAPPED:
                path = path.replace(suffix, "")
            out[path.removeprefix("unet.").removeprefix("vae.")] = module
    return out


def describe_call(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                  block: str = "") -> dict:
    """The shape figures of one attention call, from its inputs (works on the meta device)."""
    batch = hidden_states.shape[0]
    tokens_q = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
    tokens_k = tokens_q if encoder_hidden_states is None else encoder_hidden_states.shape[1]
    heads = attn.heads
    head_dim = attn.inner_dim // heads
    upcast = "attention" if getattr(attn, "upcast_attention", False) else \
        "softmax" if getattr(attn, "upcast_softmax", False) else ""  # diffusers' AttnProcessor's float32 upcast
    score_elements = batch * heads * tokens_q * tokens_k
    return {
        "kind": "self" if encoder_hidden_states is None else "image" if block.endswith(".image") else "cross",
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "tokens_q": tokens_q,
        "tokens_k": tokens_k,
        "score_elements": score_elements,
        "upcast": upcast,
        "score_bytes": score_elements * (4 if upcast else hidden_states.element_size()),
        "flops": 4 * batch * heads * tokens_q * tokens_k * head_dim,
    }


@contextmanager
def swapped(model: torch.nn.Module, make: Callable[[str, object], object]):
    """Every Attention module's processor replaced by make(block path, its original processor) for the duration;
    the originals restored on exit, also when the block raises."""
    modules = attention_modules(model)
    originals = {block: m.processor for block, m in modules.items()}
    try:
        for block, module in modules.items():
            module.set_processor(make(block, originals[block]))
        yield originals
    finally:
        for block, module in modules.items():
            module.set_processor(originals[block])


class RecordingProcessor:
    """Stands in for one Attention module's processor; delegates the work to `inner`."""

    def __init__(self, inner, block: str, stage: str, level: int, recorder: "Recorder"):
        self.inner, self.block, self.stage, self.level, self.recorder = inner, block, stage, level, recorder

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if temb is not None:  # a VAE's attention passes it (diffusers drops what a processor does not name)
            kwargs["temb"] = temb
        row = {"pass_index": self.recorder.pass_index, "call_index": len(self.recorder.current_pass),
               "block": self.block, "stage": self.stage, "level": self.level}
        row.update(describe_call(attn, hidden_states, encoder_hidden_states, self.block))
        self.recorder.current_pass.append(row)
        self.recorder.rows.append(row)

        def call():
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)

        return self.recorder.around(row, call) if self.recorder.around else call()


class Recorder:
    """Context manager: `with Recorder(model, processor=factory, around=probe) as rec: model(**inputs)`.

    processor: None keeps each module's own processor inside the wrapper; a callable returns a new processor per
    module (a backend). around(row, call): runs the call and may add measured fields to the row. levels: the
    model's resolution levels (default: its config's block_out_channels). The original processors are restored on
    exit, also when the forward raises. A new pass begins at every forward of the model."""

    def __init__(self, unet: torch.nn.Module, processor: Callable[[], object] | None = None,
                 around: Around | None = None, levels: int | None = None):
        self.unet, self.processor, self.around = unet, processor, around
        self.levels = levels or len(unet.config.block_out_channels)
        self.rows: list[dict] = []
        self.current_pass: list[dict] = []
        self.pass_index = -1
        self._swap = None
        self._hook = None

    def _wrap(self, block: str, original) -> RecordingProcessor:
        stage, level = block_position(block, self.levels)
        return RecordingProcessor(self.processor() if self.processor else original, block, stage, level, self)

    def __enter__(self) -> "Recorder":
        self._swap = swapped(self.unet, self._wrap)
        self._swap.__enter__()
        self._hook = self.unet.register_forward_pre_hook(self._new_pass)
        return self

    def _new_pass(self, module, args) -> None:
        self.pass_index += 1
        self.current_pass = []

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        self._swap.__exit__(None, None, None)

    def passes(self) -> list[list[dict]]:
        grouped: dict[int, list[dict]] = {}
        for row in self.rows:
            grouped.setdefault(row["pass_index"], []).append(row)
        return [grouped[k] for k in sorted(grouped)]
