"""What a pipeline adds around the U-Net's attention, as module wrappers applied for the duration of a cell (they
work on real, meta and fake models alike, so the planner and the measured run see the same calls):

- Token Merging (ToMe, Bolya & Hoffman 2023) before each self-attention at the finest level (tomesd's defaults:
  max_downsample 1, 2x2 cells, merge_attn only): `ToMeSelf` merges ratio x the tokens into their most similar
  destination tokens (bipartite soft matching, one random destination per 2x2 cell), runs the attention on the rest,
  and unmerges its output. Ours, not the tomesd package: tomesd 0.1.3 patches BasicTransformerBlock.forward through
  attributes (use_ada_layer_norm) that diffusers 0.42 no longer has.
- IP-Adapter: each cross-attention also attends to the image tokens through its own key and value projections (with
  random weights here), sharing the text attention's query; `IPCross` makes that image attention a call of its own
  (so it is recorded with its own token count, through the backend under test) and adds its output, projected by
  to_out's weight, to the text attention's output, as diffusers' IPAdapterAttnProcessor adds them before to_out.
  The inputs carry the text tokens and then the image tokens in encoder_hidden_states.

The wrapped modules keep the original Attention as a child (`merged`, `text`): the recorder reports a call under
the original's path, the image attention as `<path>.image`.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

TOME_CELL = 2  # tomesd's sx, sy: one destination token per 2x2 cell
WRAPPED = (".merged", ".text")  # children whose path is reported as their parent's


class _Merge:
    """tomesd's bipartite_soft_matching_random2d for (B, N, C) tokens of an h x w grid: merge() keeps N - r tokens,
    unmerge() puts each back (a merged token's value goes to every token merged into it)."""

    def __init__(self, x: torch.Tensor, h: int, w: int, r: int, generator: torch.Generator):
        b, n, _ = x.shape
        hsy, wsx = h // TOME_CELL, w // TOME_CELL
        pick = torch.randint(TOME_CELL * TOME_CELL, (hsy, wsx, 1), generator=generator).to(x.device)
        buffer = torch.zeros(hsy, wsx, TOME_CELL * TOME_CELL, device=x.device, dtype=torch.int64)
        buffer.scatter_(2, pick, -torch.ones_like(pick))  # -1 marks each cell's destination
        buffer = buffer.view(hsy, wsx, TOME_CELL, TOME_CELL).transpose(1, 2).reshape(hsy * TOME_CELL, wsx * TOME_CELL)
        if hsy * TOME_CELL < h or wsx * TOME_CELL < w:  # rows / columns outside whole cells are sources
            full = torch.zeros(h, w, device=x.device, dtype=torch.int64)
            full[:hsy * TOME_CELL, :wsx * TOME_CELL] = buffer
            buffer = full
        order = buffer.reshape(1, -1, 1).argsort(dim=1)  # destinations first
        n_dst = hsy * wsx
        self.a_idx, self.b_idx, self.n, self.b = order[:, n_dst:, :], order[:, :n_dst, :], n, b
        metric = x / x.norm(dim=-1, keepdim=True)
        a, bb = self._split(metric)
        scores = a @ bb.transpose(-1, -2)  # (B, sources, destinations)
        r = min(a.shape[1], r)
        best, self.node = scores.max(dim=-1)
        edges = best.argsort(dim=-1, descending=True)[..., None]
        self.unm_idx, self.src_idx = edges[..., r:, :], edges[..., :r, :]
        self.dst_idx = self.node[..., None].gather(1, self.src_idx)
        self.r = r

    def _split(self, x: torch.Tensor):
        c = x.shape[-1]
        return (x.gather(1, self.a_idx.expand(x.shape[0], -1, c)), x.gather(1, self.b_idx.expand(x.shape[0], -1, c)))

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        src, dst = self._split(x)
        c = x.shape[-1]
        unm = src.gather(1, self.unm_idx.expand(-1, -1, c))
        src = src.gather(1, self.src_idx.expand(-1, -1, c))
        dst = dst.scatter_reduce(1, self.dst_idx.expand(-1, -1, c), src, reduce="mean")
        return torch.cat([unm, dst], dim=1)  # (B, N - r, C)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        c, unm_len = x.shape[-1], self.unm_idx.shape[1]
        unm, dst = x[:, :unm_len], x[:, unm_len:]
        src = dst.gather(1, self.dst_idx.expand(-1, -1, c))
        out = x.new_zeros(x.shape[0], self.n, c)
        a_idx = self.a_idx.expand(x.shape[0], -1, 1)
        out.scatter_(1, self.b_idx.expand(x.shape[0], -1, c), dst)
        out.scatter_(1, a_idx.gather(1, self.unm_idx).expand(-1, -1, c), unm)
        out.scatter_(1, a_idx.gather(1, self.src_idx).expand(-1, -1, c), src)
        return out  # (B, N, C)


class ToMeSelf(nn.Module):
    """A finest-level self-attention with ToMe around it: merge, attend over the kept tokens, unmerge."""

    def __init__(self, merged: nn.Module, ratio: float, grid: dict):
        super().__init__()
        self.merged, self.ratio, self.grid = merged, ratio, grid

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        h, w = self.grid["size"]
        if hidden_states.shape[1] != h * w:  # not the finest level: tomesd leaves it alone
            return self.merged(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
        merge = _Merge(hidden_states, h, w, int(hidden_states.shape[1] * self.ratio), self.grid["generator"])
        out = self.merged(merge.merge(hidden_states), encoder_hidden_states, attention_mask, **kwargs)
        return merge.unmerge(out)


class _SharedQuery(nn.Module):
    """Stands in for the image attention's to_q: the text attention's query of this call (IP-Adapter shares it),
    kept by a hook on the text attention's to_q while the adapter is applied."""

    def __init__(self):
        super().__init__()
        self.last = None

    def keep(self, module, args, output) -> None:
        self.last = output

    def forward(self, hidden_states):
        return self.last  # IPCross lets go of it once the image attention has run


class _ProjectOnly(nn.Module):
    """to_out's weight without its bias: the image attention's share of to_out(text + scale * image)."""

    def __init__(self, linear: nn.Linear, scale: float):
        super().__init__()
        self.linear, self.scale = [linear], scale  # a list: the weight stays the text attention's parameter

    def forward(self, x):
        return nn.functional.linear(x * self.scale, self.linear[0].weight)


def image_attention(text: nn.Module, scale: float = 1.0) -> nn.Module:
    """The image-token attention of one cross-attention: its own key and value projections (IP-Adapter's
    to_k_ip / to_v_ip), the text attention's query and to_out weight. Built on the text attention's device and
    dtype (meta and fake tensors too)."""
    from diffusers.models.attention_processor import Attention

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    weight = text.to_q.weight
    heads, inner = text.heads, text.to_q.out_features
    with unset_fake_temporarily(), torch.device("meta"):  # a meta module first, whatever mode the caller is in
        image = nn.Module.to(Attention(query_dim=text.to_q.in_features, cross_attention_dim=text.to_k.in_features,
                                       heads=heads, dim_head=inner // heads, bias=False, out_bias=False),
                             weight.dtype)
    if _is_fake(weight):  # as the planner makes fake models (planner/forward.py)
        from torch._subclasses.fake_tensor import FakeTensor

        image = image._apply(lambda t: FakeTensor(weight.fake_mode, t, weight.device))
    elif weight.device.type != "meta":
        from .weights_init import random_init

        image = image.to_empty(device=weight.device)
        random_init(image.to_k, seed=1)
        random_init(image.to_v, seed=2)
    image.to_q = _SharedQuery()
    image.to_out[0] = _ProjectOnly(text.to_out[0], scale)
    return image


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class IPCross(nn.Module):
    """A cross-attention with IP-Adapter's image attention beside it: encoder_hidden_states holds the text tokens and
    then `tokens` image tokens; the output is the text attention's plus the image attention's."""

    def __init__(self, text: nn.Module, image: nn.Module, tokens: int):
        super().__init__()
        self.text, self.image, self.tokens = text, image, tokens

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        words, pictures = encoder_hidden_states[:, :-self.tokens], encoder_hidden_states[:, -self.tokens:]
        out = self.text(hidden_states, words, attention_mask, **kwargs)
        out = out + self.image(hidden_states, pictures)
        self.image.to_q.last = None  # the query lives as long as diffusers' IP processor keeps it, no longer
        return out


def _transformer_blocks(unet: nn.Module):
    from diffusers.models.attention import BasicTransformerBlock

    return [m for m in unet.modules() if isinstance(m, BasicTransformerBlock)]


@contextmanager
def applied(unet: nn.Module, tome: float = 0.0, ip_tokens: int = 0, seed: int = 0):
    """ToMe (ratio `tome`) and IP-Adapter (`ip_tokens` image tokens) on the U-Net's transformer blocks for the
    duration; the originals back on exit, also on error. IP-Adapter's projections are made once per U-Net."""
    blocks = _transformer_blocks(unet) if tome or ip_tokens else []
    grid = {"size": None, "generator": None}  # each forward: its grid, and ToMe's random picks from the same seed
    hook = unet.register_forward_pre_hook(
        lambda m, args, kwargs: grid.update(size=_finest(args, kwargs), generator=torch.Generator().manual_seed(seed)),
        with_kwargs=True) if tome else None
    if ip_tokens and not hasattr(unet, "_attnprof_ip"):
        unet._attnprof_ip = {id(b.attn2): image_attention(b.attn2) for b in blocks if b.attn2 is not None}
    saved, hooks = [(b, b.attn1, b.attn2) for b in blocks], [hook] if hook else []
    try:
        for b in blocks:
            if tome:
                b.attn1 = ToMeSelf(b.attn1, tome, grid)
            if ip_tokens and b.attn2 is not None:
                image = unet._attnprof_ip[id(b.attn2)]
                hooks.append(b.attn2.to_q.register_forward_hook(image.to_q.keep))
                b.attn2 = IPCross(b.attn2, image, ip_tokens)
        yield unet
    finally:
        for b, attn1, attn2 in saved:
            b.attn1, b.attn2 = attn1, attn2
        for h in hooks:
            h.remove()


def _finest(args, kwargs) -> tuple[int, int]:
    sample = kwargs.get("sample", args[0] if args else None)  # (B, C, h, w): the finest level's grid
    return int(sample.shape[-2]), int(sample.shape[-1])


def tome_tokens(tokens: int, ratio: float) -> int:
    """Tokens a finest-level self-attention sees under ToMe at this ratio."""
    return tokens - int(tokens * ratio)

