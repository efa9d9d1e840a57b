"""Values for a model built on the meta device: random weights that keep activations O(1), and the buffers a meta
build leaves empty. Attention cost does not depend on the values; what runs must still read initialised memory."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def remake_buffers(model: torch.nn.Module) -> None:
    """The buffers a meta build leaves empty (to_empty gives them memory, not values), remade on the model's device:
    a video U-Net's positional table over frames (SinusoidalPositionalEmbedding.pe, a function of its shape); any
    other buffer zeroed (none of the registry's models has one), so that no forward reads uninitialised memory."""
    from diffusers.models.embeddings import SinusoidalPositionalEmbedding

    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if isinstance(module, SinusoidalPositionalEmbedding) and name == "pe":
                fresh = SinusoidalPositionalEmbedding(buf.shape[-1], buf.shape[-2]).pe
                buf.copy_(fresh.to(device=buf.device, dtype=buf.dtype))
            elif buf is not None:
                buf.zero_()


@torch.no_grad()
def random_init(module: torch.nn.Module, seed: int, pool_size: int = 1 << 24) -> None:
    """Normal weights scaled by 1/sqrt(fan_in), unit norm scales, zero biases: activations stay O(1) in fp16.
    The values are slices at random offsets of one seeded pool of 16M normal samples: a copy per parameter instead
    of drawing 860M (SD1.5) samples one by one. The pool is drawn on the CPU (the same values on every device) and
    moved once to the parameters' device, so that every write stays on one device; products are taken in float32
    and rounded once to the parameters' dtype. A module of fewer parameters than the pool draws a pool of its own
    size (tiny-sd15's 3.2M: its build 0.2 -> 0.1 s). Attention cost does not depend on the values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pool_size = min(pool_size, sum(p.numel() for p in module.parameters()))
    pool = torch.randn(pool_size, generator=gen).to(next(module.parameters()).device)
    for name, p in module.named_parameters():
        if p.ndim < 2:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        flat, std = p.view(-1), 1.0 / math.sqrt(math.prod(p.shape[1:]))
        for off in range(0, flat.numel(), pool_size):
            n = min(pool_size, flat.numel() - off)
            start = int(torch.randint(pool_size - n + 1, (1,), generator=gen))
            torch.mul(pool[start:start + n], std, out=flat[off:off + n])
