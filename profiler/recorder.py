"""The recorder: wraps every Attention processor of a U-Net (through diffusers' attn_processors /
set_attn_processor) and records one flat row per attention call, grouped by forward pass."""
from __future__ import annotations

from typing import Callable

import torch

Thunk = Callable[[], torch.Tensor]
Around = Callable[[dict, Thunk], torch.Tensor]  # runs the call, may add measured fields to the row

_STAGES = {"down_blocks": "down", "mid_block": "mid", "up_blocks": "up"}


def block_position(block: str, n_levels: int) -> tuple[str, int]:
    """(stage, level) of a module path. Level = number of downsamplings above the block: down_blocks.i -> i,
    mid -> n_levels - 1, up_blocks.i -> n_levels - 1 - i."""
    parts = block.split(".")
    stage = _STAGES.get(parts[0], "other")
    if stage == "down":
        return stage, int(parts[1])
    if stage == "up":
        return stage, n_levels - 1 - int(parts[1])
    return stage, n_levels - 1


def describe_call(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None) -> dict:
    """The shape figures of one attention call, from its inputs (works on the meta device)."""
    batch = hidden_states.shape[0]
    tokens_q = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
    tokens_k = tokens_q if encoder_hidden_states is None else encoder_hidden_states.shape[1]
    heads = attn.heads
    head_dim = attn.to_q.out_features // heads
    upcast = "attention" if getattr(attn, "upcast_attention", False) else \
        "softmax" if getattr(attn, "upcast_softmax", False) else ""  # diffusers' AttnProcessor's float32 upcast
    score_elements = batch * heads * tokens_q * tokens_k
    return {
        "kind": "self" if encoder_hidden_states is None else "cross",
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


class RecordingProcessor:
    """Stands in for one Attention module's processor; delegates the work to `inner`."""

    def __init__(self, inner, block: str, stage: str, level: int, recorder: "Recorder"):
        self.inner, self.block, self.stage, self.level, self.recorder = inner, block, stage, level, recorder

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        row = {"pass_index": self.recorder.pass_index, "call_index": len(self.recorder.current_pass),
               "block": self.block, "stage": self.stage, "level": self.level}
        row.update(describe_call(attn, hidden_states, encoder_hidden_states))
        self.recorder.current_pass.append(row)
        self.recorder.rows.append(row)

        def call():
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)

        return self.recorder.around(row, call) if self.recorder.around else call()


class Recorder:
    """Context manager: `with Recorder(unet, processor=factory, around=probe) as rec: unet(**inputs)`.

    processor: None keeps each module's own processor inside the wrapper; a callable returns a new processor per
    module (a backend). around(row, call): runs the call and may add measured fields to the row. The original
    processors are restored on exit, also when the forward raises."""

    def __init__(self, unet: torch.nn.Module, processor: Callable[[], object] | None = None,
                 around: Around | None = None):
        self.unet, self.processor, self.around = unet, processor, around
        self.rows: list[dict] = []
        self.current_pass: list[dict] = []
        self.pass_index = -1
        self._originals = None
        self._hook = None

    def __enter__(self) -> "Recorder":
        self._originals = self.unet.attn_processors
        n_levels = len(self.unet.config.block_out_channels)
        wrapped = {}
        for key, original in self._originals.items():
            block = key.removesuffix(".processor")
            stage, level = block_position(block, n_levels)
            inner = self.processor() if self.processor else original
            wrapped[key] = RecordingProcessor(inner, block, stage, level, self)
        self.unet.set_attn_processor(wrapped)
        self._hook = self.unet.register_forward_pre_hook(self._new_pass)
        return self

    def _new_pass(self, module, args) -> None:
        self.pass_index += 1
        self.current_pass = []

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        self.unet.set_attn_processor(self._originals)

    def passes(self) -> list[list[dict]]:
        grouped: dict[int, list[dict]] = {}
        for row in self.rows:
            grouped.setdefault(row["pass_index"], []).append(row)
        return [grouped[k] for k in sorted(grouped)]
