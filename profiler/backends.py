"""Attention backends: a registry of processors that diffusers' Attention.set_processor accepts, each with an honest
availability check (the reason when it cannot run) and a model of its transient peak memory.

Shapes: B batch, h heads, d head_dim, C = h*d, Tq / Tk query / key tokens, n = B*h. The chunked cores `split` and
`subquad` are ours; everything around the core (norms, projections, mask, output projection) is one base class that
does what diffusers' AttnProcessor does.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .spec import InputError, parse_dtype, torch_dtype

MiB = 2**20


@dataclass(frozen=True)
class Backend:
    name: str
    family: str  # reference / chunked / fused
    description: str
    options: dict = field(default_factory=dict)  # option name -> default
    factory: Callable | None = None  # a registered backend's processor factory (built-ins: make_processor)
    memory_like: str | None = None  # a registered backend's memory model: that of this built-in


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("naive", "reference", "diffusers AttnProcessor: baddbmm + softmax, the whole score table materialised"),
    Backend("sliced", "chunked", "diffusers SlicedAttnProcessor: slice_size (batch*heads) rows of tables at a time",
            {"slice_size": 1}),
    Backend("split", "chunked", "query chunks sized so one chunk's score table fits budget_bytes (ComfyUI's split)",
            {"budget_bytes": 64 * MiB}),
    Backend("subquad", "chunked", "sub-quadratic attention (Rabe & Staats 2021): query and key chunks, running "
            "max and sum; at most query_chunk x key_chunk scores per batch*head",
            {"query_chunk": 1024, "key_chunk": 4096}),
    Backend("sdpa", "fused", "diffusers AttnProcessor2_0: PyTorch SDPA, PyTorch picks the kernel"),
    Backend("sdpa-flash", "fused", "PyTorch SDPA forced to its flash-attention kernel"),
    Backend("sdpa-efficient", "fused", "PyTorch SDPA forced to its memory-efficient kernel (CUDA)"),
    Backend("sdpa-math", "fused", "PyTorch SDPA forced to its math kernel: materialises the score table, in fp32"),
    Backend("sdpa-cudnn", "fused", "PyTorch SDPA forced to its cuDNN kernel (CUDA)"),
    Backend("xformers", "fused", "xformers memory_efficient_attention via diffusers XFormersAttnProcessor"),
    Backend("flash-attn", "fused", "flash_attn_func of the flash-attn package (CUDA, fp16/bf16, head_dim <= 256)"),
)}
_SDPA_KERNELS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "sdpa-math": SDPBackend.MATH, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def register(backend: Backend) -> None:
    """Add a backend of your own (a processor factory that takes the backend's options as keywords). Modules named
    in $ATTNPROF_PLUGINS (comma-separated) are imported when this module is, so that workers see them too."""
    if backend.factory is None or backend.memory_like not in BACKENDS:
        raise ValueError(f"backend {backend.name!r} needs a factory and memory_like naming a built-in backend")
    BACKENDS[backend.name] = backend


def _load_plugins() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get("ATTNPROF_PLUGINS", "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise InputError(f"ATTNPROF_PLUGINS names {module!r}, which does not import ({e}): fix the variable")


def names() -> list[str]:
    return list(BACKENDS)


def label(name: str, options=None) -> str:
    """The backend's name, with its options where they differ from the defaults: 'sliced(slice_size=4)'. Every
    text that names a measured backend uses it. options: as stored (JSON), a dict, or a cell spec's (key, value)
    pairs."""
    options = dict(json.loads(options) if isinstance(options, str) and options else options or {})
    defaults = BACKENDS[name].options if name in BACKENDS else {}
    changed = {k: v for k, v in sorted(options.items()) if defaults.get(k) != v}
    return name + (f"({','.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")


def uses_sdpa(name: str) -> bool:
    """Whether the backend's processor calls PyTorch's scaled_dot_product_attention (so PyTorch picks a kernel)."""
    return name == "sdpa" or name.startswith("sdpa-")


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")


def _whole_number(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.strip().isdigit() else None


def check_options(name: str, options: dict) -> dict:
    """The backend's options, validated (whole numbers >= 1; digit strings are read as numbers), over its defaults."""
    check_backend_name(name)
    defaults = BACKENDS[name].options
    out = dict(defaults)
    for key, value in options.items():
        if key not in defaults:
            takes = f"use {', '.join(defaults)}" if defaults else "it takes no options"
            raise InputError(f"backend {name!r} has no option {key!r}: {takes}")
        number = _whole_number(value)
        if number is None or number < 1:
            raise InputError(f"option {key}={value!r} of backend {name!r}: use a whole number >= 1")
        out[key] = number
    return out


# ---- the chunked cores: (n, Tq, d) x (n, Tk, d) x (n, Tk, d) -> (n, Tq, d); mask: additive, (n, 1 or Tq, Tk)

def _mask_block(mask: torch.Tensor | None, rows: slice, cols: slice):
    if mask is None:
        return None
    return mask[:, rows if mask.shape[1] > 1 else slice(None), cols]


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


# ---- processors

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


class FlashAttnProcessor(Processor):
    """flash_attn_func on (B, T, h, d) views of the projections: no copies, no score table."""

    def attend(self, attn, hidden_states, context, mask):
        from flash_attn import flash_attn_func

        if mask is not None:
            raise ValueError("flash-attn takes no attention mask: use sdpa or xformers for masked attention")
        q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # (B, Tq, h, d)
        if q.shape[-1] > 256:
            raise ValueError(f"flash-attn supports head_dim <= 256, this block has {q.shape[-1]}")
        k = attn.to_k(context).unflatten(-1, (attn.heads, -1))  # (B, Tk, h, d)
        v = attn.to_v(context).unflatten(-1, (attn.heads, -1))  # (B, Tk, h, d)
        return flash_attn_func(q, k, v, softmax_scale=attn.scale).flatten(2)  # (B, Tq, C)


class SDPAKernelProcessor:
    """diffusers' AttnProcessor2_0 with PyTorch's SDPA kernel forced: no silent fallback to another kernel."""

    def __init__(self, kernel: SDPBackend):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.kernel, self.inner = kernel, AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        with sdpa_kernel(self.kernel):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)


def make_processor(name: str, **options):
    """A new processor instance of the backend (availability is availability()'s job)."""
    opts = check_options(name, options)
    from diffusers.models import attention_processor as ap

    if BACKENDS[name].factory is not None:
        return BACKENDS[name].factory(**opts)
    if name in _SDPA_KERNELS:
        return SDPAKernelProcessor(_SDPA_KERNELS[name])
    factories = {"naive": ap.AttnProcessor, "sliced": ap.SlicedAttnProcessor, "split": SplitProcessor,
                 "subquad": SubQuadProcessor, "sdpa": ap.AttnProcessor2_0, "xformers": ap.XFormersAttnProcessor,
                 "flash-attn": FlashAttnProcessor}
    return factories[name](**opts)


# ---- availability

def _static_reason(name: str, device: torch.device, dtype: str, head_dims: tuple[int, ...]) -> str:
    package = {"xformers": "xformers", "flash-attn": "flash_attn"}.get(name)
    if package and importlib.util.find_spec(package) is None:
        return f"{name} is not installed: pip install {name}"
    if name in ("xformers", "flash-attn", "sdpa-efficient", "sdpa-cudnn") and device.type != "cuda":
        return f"{name} runs on CUDA only, not on {device.type}"
    if name == "flash-attn" and dtype == "float32":
        return "flash-attn runs in float16 or bfloat16 only, not float32"
    bad = [d for d in head_dims if d > 256 or d % 8]
    if name == "flash-attn" and bad:
        return f"flash-attn needs head_dim <= 256 and a multiple of 8; this model has head_dim {bad[0]}"
    return ""


PROBE_TOKENS = 64  # query tokens of the availability probe (cross-attention: 77 keys, as the text encoder gives)


@functools.lru_cache(maxsize=None)
def _probe(name: str, device: str, dtype: str, head_dim: int = 64) -> tuple[bool, str]:
    """Run the backend on a diffusers Attention with the model's head_dim, as self- and as cross-attention; the
    error (and PyTorch's warnings saying why) if it fails."""
    from diffusers.models.attention_processor import Attention

    gen = torch.Generator().manual_seed(0)
    tdt = torch_dtype(dtype)
    self_attn, cross_attn = (Attention(query_dim=2 * head_dim, heads=2, dim_head=head_dim, cross_attention_dim=c)
                             .to(device=device, dtype=tdt).eval() for c in (None, 64))
    x = torch.randn(1, PROBE_TOKENS, 2 * head_dim, generator=gen).to(device=device, dtype=tdt)  # (B, Tq, C)
    text = torch.randn(1, 77, 64, generator=gen).to(device=device, dtype=tdt)  # (B, Tk, C_text)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            make_processor(name)(self_attn, x)
            make_processor(name)(cross_attn, x, text)
        except (RuntimeError, ValueError, ImportError, OSError) as e:  # unsupported-kernel errors subclass these
            why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught))
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return False, (f"{name} does not run on {device} in {dtype} at head_dim {head_dim}: {first}"
                           + (f" ({why})" if why else ""))
    return True, ""


def availability(name: str, device: str = "cpu", dtype: str = "float16",
                 head_dims: tuple[int, ...] = (64,)) -> tuple[bool, str]:
    """(True, "") where the backend runs on this device in this dtype at each of the model's head dims (SD 1.x:
    40, 80, 160; SDXL: 64), else (False, the reason)."""
    check_backend_name(name)
    dtype = parse_dtype(dtype)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        return False, f"device {device} is not profiled: use cpu or cuda"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False, "CUDA is not available here (no GPU, or a CPU-only torch build)"
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        return False, f"no device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    head_dims = tuple(sorted(set(head_dims)))
    reason = _static_reason(name, dev, dtype, head_dims)
    if reason:
        return False, reason
    for d in head_dims:
        ok, why = _probe(name, str(dev), dtype, d)
        if not ok:
            return ok, why
    return True, ""


# ---- memory models

def chunks(name: str, row: dict, dtype: str, **options) -> int:
    """How many chunks a chunked backend cuts one call into (1 for the others)."""
    opts = check_options(name, options)
    n, tq, tk = row["batch"] * row["heads"], row["tokens_q"], row["tokens_k"]
    if name == "sliced":
        return -(-n // opts["slice_size"])
    if name == "split":
        return -(-tq // split_rows(n, tk, row["score_bytes"] // row["score_elements"], opts["budget_bytes"]))
    if name == "subquad":
        return -(-tq // opts["query_chunk"]) * -(-tk // opts["key_chunk"])
    return 1


def _upcast(row: dict, e: int) -> str:
    """How the call upcasts before its softmax: 'attention' (q and k to float32, scores in float32), 'softmax' (the
    scores to float32) or '' (none, or float32 inputs, where an upcast copies nothing). Rows stored before the field
    existed say so only through their 4-byte scores: those are U-Net rows, whose upcast is upcast_attention."""
    if e == 4:
        return ""
    if "upcast" in row:
        return row["upcast"] or ""
    return "attention" if row["score_bytes"] != row["score_elements"] * e else ""


def _scores_phase(ns: int, row: dict, e: int, up: str, held: int) -> int:
    """The peak of diffusers' get_attention_scores over ns (batch*head) rows, `held` bytes alive besides: baddbmm
    with its empty input, an upcast copy of the scores, softmax with its input, the probabilities cast back."""
    tq, tk, d = row["tokens_q"], row["tokens_k"], row["head_dim"]
    n_s = ns * tq * tk  # score elements
    qk = ns * (tq + tk) * d * 4 if up == "attention" else 0  # float32 copies of q and k
    s1 = 4 if up == "attention" else e  # baddbmm's dtype
    s2 = 4 if up else e  # softmax's dtype
    moments = [held + qk + 2 * n_s * s1, held + qk + 2 * n_s * s2]
    if up == "softmax":
        moments.append(held + n_s * (s1 + 4))  # scores and their float32 copy
    if s2 != e:
        moments.append(held + qk + n_s * (s2 + e))  # probabilities and their cast to the input dtype
    return max(moments)


def _modelled(name: str, options: dict) -> tuple[str, dict]:
    """The built-in whose models a backend uses (itself, or a registered backend's memory_like), with its options."""
    opts = check_options(name, options)
    if BACKENDS[name].memory_like:
        return BACKENDS[name].memory_like, check_options(BACKENDS[name].memory_like, {})
    return name, opts


def predicted_peak_bytes(name: str, row: dict, dtype: str, **options) -> int:
    """Transient peak of one processor call over what was allocated when it began (the output counts), following
    the processor op by op as it allocates and frees (tests/test_forward.py holds it to the fake-tensor trace of
    every call of SD 1.5, SD 2.1 and SDXL, both batch sizes, with and without upcast).

    Every processor first holds q, k, v (a_q + 2 a_k) and ends holding its head-merged output and to_out's
    output (2 a_q). Scores take row["score_bytes"] / row["score_elements"] bytes (4 where diffusers upcasts). `sdpa` on
    CUDA follows the kernel named in row["sdpa_kernel"] (the planner's and the measurement's). Left out: the CPU
    flash kernel's per-thread tiles (~0.5 MiB per thread), kernel workspaces other than the mem-efficient
    kernel's float32 accumulator (head_dim > 128 in float16 / bfloat16), and the mask diffusers repeats per head."""
    name, opts = _modelled(name, options)
    e = torch_dtype(dtype).itemsize
    b, n, d, tq, tk = row["batch"], row["batch"] * row["heads"], row["head_dim"], row["tokens_q"], row["tokens_k"]
    sb = row["score_bytes"] // row["score_elements"]
    a_q, a_k = n * tq * d * e, n * tk * d * e  # one projection on the query / key side
    up = _upcast(row, e)
    if name == "naive":  # AttnProcessor: scores, then probabilities alive through bmm, head merge and to_out
        core = max(_scores_phase(n, row, e, up, 0), n * tq * tk * e + 2 * a_q)
    elif name == "sliced":  # the output zeros, and each slice's output alive into the next slice's scores
        ns = min(opts["slice_size"], n)
        count, out_s = -(-n // ns), ns * tq * d * e
        last = (n - (count - 1) * ns) * tq * d * e
        loop = a_q + max(_scores_phase(ns, row, e, up, out_s if count > 1 else 0), ns * tq * tk * e + out_s)
        core = max(loop, last + 2 * a_q)
    elif name == "split":  # output, one chunk table in place, the chunk's probs @ v (upcast: float32 k and q chunk)
        r = min(tq, split_rows(n, tk, sb, opts["budget_bytes"]))
        s_c = n * r * tk * sb
        core = a_q + s_c + (n * r * d * e if sb == e else 4 * n * tk * d + max(4 * n * r * d, n * r * (tk + d) * e))
    elif name == "subquad":  # output, one score block, float32 accumulator, block @ v, running max / sum / rescale
        r, c = min(tq, opts["query_chunk"]), min(tk, opts["key_chunk"])
        s_c = n * r * c * sb
        if sb == e:
            core = a_q + s_c + n * r * d * (4 + e) + 3 * n * r * 4
        else:  # a float32 query chunk, and each key chunk in float32 while its scores are taken
            core = a_q + 8 * n * r * d + 8 * n * r + s_c + max(4 * n * c * d, 8 * n * r + n * r * (c + d) * e)
    elif name == "sdpa-math":  # aten's math kernel: float32 copies (below float32), scaled q and k, scores, softmax
        f = 4 / e  # with its bool mask, the probabilities cast back, probs @ v in float32 and cast back
        ups = int((a_q + 2 * a_k) * f) if e < 4 else 0
        sq, sk, cl = int(a_q * f), int(a_k * f), b > 1  # batches above 1 copy q, k and v for the batched matmuls
        big = n * tq * tk
        core = ups + sq + max(sk * (1 + cl) + sq * cl + 4 * big, 9 * big,
                              4 * big + (e < 4) * big * e + sq + max(cl * int(a_k * f), (e < 4) * a_q))
    else:  # fused kernels: output and a float32 logsumexp; mem-efficient adds a float32 accumulator past head_dim 128
        kernel = {"sdpa-efficient": "efficient", "sdpa": row.get("sdpa_kernel")}.get(name)
        acc = n * tq * d * 4 if kernel == "efficient" and d > 128 and e < 4 else 0
        core = a_q + n * tq * 4 + acc
    return int(a_q + 2 * a_k + max(core, 2 * a_q))  # every processor ends holding its merged output and to_out's


# ---- bytes moved: the x axis of the roofline (measure/limits.py places each call against the device's limits)

def bytes_moved(name: str, row: dict, dtype: str, **options) -> int:
    """The bytes one call's attention reads and writes in the backend's own model: the part that `flops` counts
    (QK^T, softmax, PV; the projections left out of both). A fused kernel reads Q, K and V and writes O once. A
    backend that materialises the score table writes it, the softmax reads it and writes the probabilities, and PV
    reads them: four passes over the table (naive, sliced; sdpa-math and sdpa running its math kernel do so in
    float32, after copying Q, K and V to float32 and before casting O back). The chunked backends pass over their
    chunks' tables the same way and read K and V again for each query chunk; subquad also reads and rewrites its
    float32 accumulator for each key chunk. Tables take row["score_bytes"] (4 bytes a score where diffusers
    upcasts). A model of traffic to memory: tables small enough to stay in a cache move less."""
    name, opts = _modelled(name, options)
    e = torch_dtype(dtype).itemsize
    n, d, tq, tk = row["batch"] * row["heads"], row["head_dim"], row["tokens_q"], row["tokens_k"]
    a_q, a_k, table = n * tq * d * e, n * tk * d * e, row["score_bytes"]
    if name in ("naive", "sliced"):
        return 2 * a_q + 2 * a_k + 4 * table
    if name == "split":
        query_chunks = chunks(name, row, dtype, **opts)
        return 2 * a_q + 2 * a_k * query_chunks + 4 * table
    if name == "subquad":
        query_chunks, key_chunks = -(-tq // opts["query_chunk"]), -(-tk // opts["key_chunk"])
        return 2 * a_q + 2 * a_k * query_chunks + 4 * table + key_chunks * 2 * n * tq * d * 4
    if name == "sdpa-math" or (name == "sdpa" and row.get("sdpa_kernel") == "math"):
        f = 4 / e  # float32 operands
        casts = (a_q + 2 * a_k) * (1 + f) + a_q * (f + 1) if e < 4 else 0  # in: read, write f32; out: the reverse
        return int(f * (2 * a_q + 2 * a_k) + 4 * n * tq * tk * 4 + casts)
    return 2 * a_q + 2 * a_k  # fused kernels: Q, K and V read once, O written once


_load_plugins()
