"""The fused kernels diffusion users run beside PyTorch's SDPA: diffusers' attention dispatcher (every backend of
`diffusers.models.attention_dispatch`, as `diffusers:<name>`), FlexAttention compiled once per process and shape
(`flex`), SageAttention (`sage`) and FlashAttention 3 (`flash-attn-3`): their processors. What each needs to run,
said before it runs, is its record's in backends.py.

Shapes: B batch, T tokens, h heads, d head_dim, C = h*d. Each processor projects to (B, T, h, d) views of the
projections (no copies) and hands them to its kernel; everything around that is processor.Processor's.
"""
from __future__ import annotations

import functools
import importlib.util
import time

import torch

from .backends import SAGE_MAX_HEAD_DIM
from .processor import Processor, core_range

FLEX_BLOCK = 128  # FlexAttention's block size: the all-full block mask is built of these


def _projected(attn, hidden_states, context):
    """q (B, Tq, h, d), k and v (B, Tk, h, d): views of the projections."""
    q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    k = attn.to_k(context).unflatten(-1, (attn.heads, -1))
    v = attn.to_v(context).unflatten(-1, (attn.heads, -1))
    return q, k, v


class DispatchProcessor(Processor):
    """diffusers' AttnProcessor2_0 with its attention handed to diffusers' dispatcher, backend fixed: what
    set_attention_backend would do if it reached SD U-Nets. diffusers' own per-call checks of the backend (dtype,
    device, shapes) always run, so a kernel that diffusers would refuse raises rather than runs."""

    def __init__(self, backend: str):
        self.backend = backend

    def attend(self, attn, hidden_states, context, mask):
        from diffusers.models.attention_dispatch import (AttentionBackendName, _AttentionBackendRegistry,
                                                         dispatch_attention_fn)

        name = AttentionBackendName(self.backend)
        q, k, v = _projected(attn, hidden_states, context)  # (B, T, h, d)
        if mask is not None:  # (B*h, 1 or Tq, Tk) -> (B, h, 1 or Tq, Tk), as AttnProcessor2_0 does
            mask = mask.view(q.shape[0], attn.heads, -1, mask.shape[-1])
        for check in _AttentionBackendRegistry._constraints.get(name, []):
            check(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=attn.scale)
        with core_range():
            out = dispatch_attention_fn(q, k, v, attn_mask=mask, scale=attn.scale, backend=name)  # (B, Tq, h, d)
        return out.flatten(2).to(q.dtype)  # (B, Tq, C): a view where the kernel wrote (B, Tq, h, d)


# ---- FlexAttention, compiled

class CompileClock:
    """Seconds spent in calls that compiled (the first call of each shape), summed per process: a cell reads it
    before and after its compile pass, so compile time is kept apart from the timed forwards."""

    seconds = 0.0
    seen: set = set()


@functools.lru_cache(maxsize=1)
def compiled_flex():
    """flex_attention compiled once per process (Dynamo then compiles once per shape: dynamic=False, so every
    shape gets its own kernel, as a user's pipeline at a fixed size does)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def full_block_mask(tokens_q: int, tokens_k: int, device: str):
    """A BlockMask whose every FLEX_BLOCK x FLEX_BLOCK block is full: no mask_mod is evaluated per score, so no
    (Tq, Tk) boolean table is built and the kernel skips masking. Without one, the compiled CPU kernel still
    allocated about half a score table per call. Built on real tensors even under the planner's fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    nq, nk = -(-tokens_q // FLEX_BLOCK), -(-tokens_k // FLEX_BLOCK)
    with unset_fake_temporarily():
        def ints(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int32, device=device)

        indices = torch.arange(nk, dtype=torch.int32, device=device).expand(1, 1, nq, nk).contiguous()
        return BlockMask.from_kv_blocks(ints(1, 1, nq), ints(1, 1, nq, nk), ints(1, 1, nq, fill=nk), indices,
                                        BLOCK_SIZE=FLEX_BLOCK, mask_mod=noop_mask, seq_lengths=(tokens_q, tokens_k))


class FlexProcessor(Processor):
    """FlexAttention compiled (torch.compile of flex_attention), on (B, h, T, d) views of the projections, with an
    all-full block mask; the output comes back in the query's (B, T, h, d) layout, so the head merge is a view. An
    attention mask becomes a score_mod (one more compile for masked calls). Compiles past Dynamo's recompile limit
    raise rather than fall back to the eager kernel, which materialises the score table."""

    def attend(self, attn, hidden_states, context, mask):
        q, k, v = (t.transpose(1, 2) for t in _projected(attn, hidden_states, context))  # (B, h, T, d)
        block_mask = full_block_mask(q.shape[2], k.shape[2], str(q.device))
        score_mod = None
        if mask is not None:
            mask = mask.view(q.shape[0], attn.heads, -1, mask.shape[-1])  # (B, h, 1 or Tq, Tk)
            rows = mask.shape[2]

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + mask[b, h, q_idx if rows > 1 else 0, kv_idx]

        if torch.compiler.is_compiling():  # inside a compiled U-Net (the compile setting): part of its graph
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=attn.scale)
            return out.transpose(1, 2).flatten(2)
        key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), mask is not None)
        first = key not in CompileClock.seen
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True), core_range():
            out = compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=attn.scale)
        if first:
            if q.device.type == "cuda":
                torch.cuda.synchronize(q.device)
            CompileClock.seconds += time.perf_counter() - t0
            CompileClock.seen.add(key)
        return out.transpose(1, 2).flatten(2)  # (B, Tq, C)


# ---- SageAttention and FlashAttention 3: packages of their own, CUDA only

class SageProcessor(Processor):
    """sageattn of the sageattention package on (B, T, h, d) views ("NHD" layout): int8 Q and K, fp16 / fp8 PV."""

    def attend(self, attn, hidden_states, context, mask):
        from sageattention import sageattn

        if mask is not None:
            raise ValueError("sage takes no attention mask: use sdpa or xformers for masked attention")
        q, k, v = _projected(attn, hidden_states, context)  # (B, T, h, d)
        if q.shape[-1] > SAGE_MAX_HEAD_DIM:
            raise ValueError(f"sage supports head_dim <= {SAGE_MAX_HEAD_DIM}, this block has {q.shape[-1]}")
        with core_range():
            return sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=attn.scale).flatten(2)


class FlashAttnProcessor(Processor):
    """flash_attn_func of flash-attn (module flash_attn) or of FlashAttention 3 (module flash_attn_interface, the
    hopper/ build) on (B, T, h, d) views of the projections: no copies, no score table."""

    def __init__(self, module: str = "flash_attn", label: str = "flash-attn"):
        self.module, self.label = module, label

    def attend(self, attn, hidden_states, context, mask):
        flash_attn_func = importlib.import_module(self.module).flash_attn_func
        if mask is not None:
            raise ValueError(f"{self.label} takes no attention mask: use sdpa or xformers for masked attention")
        q, k, v = _projected(attn, hidden_states, context)  # (B, T, h, d)
        if q.shape[-1] > 256:
            raise ValueError(f"{self.label} supports head_dim <= 256, this block has {q.shape[-1]}")
        with core_range():
            out = flash_attn_func(q, k, v, softmax_scale=attn.scale)
        return (out[0] if isinstance(out, tuple) else out).flatten(2)  # FA3 builds return (out, lse)
