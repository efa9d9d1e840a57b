"""Our attention processors: the part of every processor around the attention itself, as diffusers' AttnProcessor
does it (Processor, which fused.py's processors share too), the chunked backends' (split, subquad: their cores are
chunked.py's) and SDPA forced to one kernel. The registry (backends.py) names them and imports this module only
when it makes one, so that reading the registry costs no torch import.

Shapes: B batch, h heads, d head_dim, C = h*d, Tq / Tk query / key tokens, n = B*h."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .chunked import split_attention, subquad_attention

CORE_RANGE = "attnprof::attention_core"  # the profiler range around the attention of our processors


def core_range():
    """A profiler range around the attention itself of one of our processors (between the projections), so that a
    trace tells a call's attention from its projections (measure/trace.py: attn_kernel_ms) where the attention is
    many ops (the chunked cores) or an op of another library; nothing inside a compiled graph (Dynamo traces it)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(CORE_RANGE)


class Processor:
    """Everything diffusers' AttnProcessor does around attention: spatial norm, 4-D inputs, mask preparation, group
    norm, norm_cross, output projection and dropout, residual, rescale. Subclasses implement attend()."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)  # (B, Tq, C)
        batch, tokens_k, _ = (hidden_states if encoder_hidden_states is None else encoder_hidden_states).shape
        attention_mask = attn.prepare_attention_mask(attention_mask, tokens_k, batch)  # (n, 1 or Tq, Tk) or None
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        hidden_states = self.attend(attn, hidden_states, encoder_hidden_states, attention_mask)  # (B, Tq, C)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class HeadsProcessor(Processor):
    """Projects to (n, T, d) as AttnProcessor does and runs core(); scores in float32 where diffusers upcasts."""

    def attend(self, attn, hidden_states, context, mask):
        q = attn.head_to_batch_dim(attn.to_q(hidden_states))  # (n, Tq, d)
        k = attn.head_to_batch_dim(attn.to_k(context))  # (n, Tk, d)
        v = attn.head_to_batch_dim(attn.to_v(context))  # (n, Tk, d)
        upcast = attn.upcast_attention or attn.upcast_softmax
        with core_range():
            out = self.core(q, k, v, mask, attn.scale, torch.float32 if upcast else q.dtype)  # (n, Tq, d)
        return attn.batch_to_head_dim(out)  # (B, Tq, C)


class SplitProcessor(HeadsProcessor):
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes

    def core(self, q, k, v, mask, scale, score_dtype):
        return split_attention(q, k, v, mask, scale, self.budget_bytes, score_dtype)


class SubQuadProcessor(HeadsProcessor):
    def __init__(self, query_chunk: int, key_chunk: int):
        self.query_chunk, self.key_chunk = query_chunk, key_chunk

    def core(self, q, k, v, mask, scale, score_dtype):
        return subquad_attention(q, k, v, mask, scale, self.query_chunk, self.key_chunk, score_dtype)


@functools.cache
def _sliced_class() -> type:
    from diffusers.models.attention_processor import SlicedAttnProcessor as Diffusers

    class SlicedAttnProcessor(Diffusers):
        """diffusers' SlicedAttnProcessor, whose __call__ takes temb: a VAE's attention passes it to every processor
        and diffusers warns on each call of one that lacks it (every VAE decode, under sliced); applied through the
        spatial norm where the module has one, as AttnProcessor does."""

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            if attn.spatial_norm is not None:
                hidden_states = attn.spatial_norm(hidden_states, temb)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)

    return SlicedAttnProcessor


def sliced(slice_size: int):
    """The sliced backend's processor: diffusers' SlicedAttnProcessor (a subclass of that name) that takes temb."""
    return _sliced_class()(slice_size)


_SDP_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}


class SDPAKernelProcessor:
    """diffusers' AttnProcessor2_0 with PyTorch's SDPA kernel forced: no silent fallback to another kernel."""

    def __init__(self, kernel: str):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.kernel, self.inner = _SDP_BACKENDS[kernel], AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        with sdpa_kernel(self.kernel):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)

    @classmethod
    def added_kv(cls, kernel) -> "SDPAKernelProcessor":
        """The same kernel forced, for a SimpleCrossAttn block's added-KV attention (AttnAddedKVProcessor2_0)."""
        from diffusers.models.attention_processor import AttnAddedKVProcessor2_0

        made = cls.__new__(cls)
        made.kernel, made.inner = kernel, AttnAddedKVProcessor2_0()
        return made


def for_module(processor, attn):
    """The processor to set on this Attention module for a backend's processor: the processor itself; where the
    module's attention is added-KV (a SimpleCrossAttn block: add_k_proj and add_v_proj beside to_k and to_v), the
    processor of diffusers' that does that backend's attention there (naive: AttnAddedKVProcessor, sdpa and its forced
    kernels: AttnAddedKVProcessor2_0); None where there is none (backends.Backend.added_kv says which backends have
    one: the preflight refuses the others)."""
    if getattr(attn, "added_kv_proj_dim", None) is None or getattr(processor, "handles_added_kv", False):
        return processor
    from diffusers.models import attention_processor as ap

    if isinstance(processor, (ap.AttnAddedKVProcessor, ap.AttnAddedKVProcessor2_0)):
        return processor
    if isinstance(processor, SDPAKernelProcessor):
        return SDPAKernelProcessor.added_kv(processor.kernel)
    made = {ap.AttnProcessor: ap.AttnAddedKVProcessor, ap.AttnProcessor2_0: ap.AttnAddedKVProcessor2_0}.get(
        type(processor))
    return made() if made else None
