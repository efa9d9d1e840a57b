"""The chunked attention cores of the split and subquad backends (and the row count that sizes split's chunks, from
a score's size):
(n, Tq, d) x (n, Tk, d) x (n, Tk, d) -> (n, Tq, d), mask additive, (n, 1 or Tq, Tk). Plain torch: the processors
around them are processor.py's, their memory models planner/memory.py's."""
from __future__ import annotations

import torch

from ..spec import MiB


def _mask_block(mask: torch.Tensor | None, rows: slice, cols: slice):
    if mask is None:
        return None
    return mask[:, rows if mask.shape[1] > 1 else slice(None), cols]


def score_size(upcast: str, element_size: int) -> int:
    """A score's bytes in diffusers' attention: float32 where the call upcasts ('attention' or 'softmax', a recorder
    row's upcast), else its inputs' element size."""
    return 4 if upcast else element_size


def split_rows(batch_heads: int, tokens_k: int, score_size: int, budget_bytes: int) -> int:
    """Query rows per chunk so that one chunk's score table (n x rows x Tk x score_size bytes) fits the budget."""
    return max(1, budget_bytes // (batch_heads * tokens_k * score_size))


def split_attention(q, k, v, mask=None, scale=None, budget_bytes=64 * MiB, score_dtype=None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, a chunk of query rows at a time (softmax is per query row: exact).
    Scores and softmax in score_dtype (float32 where diffusers upcasts); one chunk table alive at a time."""
    n, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sdt = score_dtype or q.dtype
    rows = split_rows(n, tk, sdt.itemsize, budget_bytes)
    k_t = k.to(sdt).transpose(1, 2)  # (n, d, Tk)
    out = q.new_empty((n, tq, v.shape[-1]), dtype=v.dtype)  # (n, Tq, d)
    for i in range(0, tq, rows):
        s = torch.bmm(q[:, i:i + rows].to(sdt), k_t).mul_(scale)  # (n, r, Tk)
        if mask is not None:
            s.add_(_mask_block(mask, slice(i, i + rows), slice(None)))
        s.sub_(s.amax(-1, keepdim=True)).exp_()  # softmax in place: no second table
        s.div_(s.sum(-1, keepdim=True, dtype=torch.promote_types(sdt, torch.float32)).to(sdt))
        out[:, i:i + rows] = torch.bmm(s.to(v.dtype), v)  # (n, r, d)
        del s  # else the next chunk's table is allocated while this one is still held
    return out


def subquad_attention(q, k, v, mask=None, scale=None, query_chunk=1024, key_chunk=4096, score_dtype=None):
    """softmax(q k^T * scale + mask) v by query chunks and key chunks with a running max and sum (log-sum-exp
    rescaling); at most a query_chunk x key_chunk score block per batch*head. Accumulators in float32 (or wider)."""
    n, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sdt = score_dtype or q.dtype
    lowest = torch.finfo(sdt).min  # a floor for the running max: fully masked chunks give exp(-inf) = 0, not nan
    acc_dtype = torch.promote_types(sdt, torch.float32)
    out = q.new_empty((n, tq, v.shape[-1]), dtype=v.dtype)  # (n, Tq, d)
    for i in range(0, tq, query_chunk):
        qc = q[:, i:i + query_chunk].to(sdt)  # (n, r, d)
        r = qc.shape[1]
        m = torch.full((n, r, 1), float("-inf"), dtype=acc_dtype, device=q.device)  # running max
        l = torch.zeros((n, r, 1), dtype=acc_dtype, device=q.device)  # running sum of exp(s - m)
        acc = torch.zeros((n, r, v.shape[-1]), dtype=acc_dtype, device=q.device)  # running sum of exp(s - m) v
        for j in range(0, tk, key_chunk):
            s = torch.bmm(qc, k[:, j:j + key_chunk].to(sdt).transpose(1, 2)).mul_(scale)  # (n, r, c)
            if mask is not None:
                s.add_(_mask_block(mask, slice(i, i + query_chunk), slice(j, j + key_chunk)))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True).to(acc_dtype)).clamp_min_(lowest)  # (n, r, 1)
            s.sub_(m_new.to(sdt)).exp_()
            corr = (m - m_new).exp_()  # rescales what was summed under the old max
            l.mul_(corr).add_(s.sum(-1, keepdim=True, dtype=acc_dtype))
            acc.mul_(corr).add_(torch.bmm(s.to(v.dtype), v[:, j:j + key_chunk]))  # (n, r, d)
            m = m_new
            del s  # else the next block is allocated while this one is still held
        out[:, i:i + r] = acc.div_(l)
    return out
