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
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .fused import SAGE_MAX_HEAD_DIM
from .processor import Processor
from .spec import InputError, parse_dtype, torch_dtype

MiB = 2**20


# materialised: the score table whole, as the textbook algorithm (naive). The outputs' error reference is another
# thing: sdpa in float32 (measure/cell.py REFERENCE_BACKEND), which scales to every size the device holds
MATERIALISED, CHUNKED, EXACT, APPROXIMATE = "materialised", "chunked", "fused exact", "fused approximate"
FAMILIES = (MATERIALISED, CHUNKED, EXACT, APPROXIMATE)  # the order in which reports group backends


@dataclass(frozen=True)
class Backend:
    name: str
    family: str  # one of FAMILIES
    description: str
    options: dict = field(default_factory=dict)  # option name -> default
    factory: Callable | None = None  # a registered backend's processor factory (built-ins: make_processor)
    memory_like: str | None = None  # a registered backend's memory model: that of this built-in


class _Registry(MutableMapping):
    """The backends by name. The `diffusers:<name>` entries (one per backend of the installed diffusers' dispatcher)
    join on the first look at the whole registry or at one of them: listing them imports diffusers, which costs
    every command's start (attnprof --help) about 1.8 s where nothing else needs it."""

    def __init__(self, builtins: tuple[Backend, ...]):
        self._own = {b.name: b for b in builtins}
        self._dispatcher: dict[str, Backend] | None = None

    def _all(self) -> dict[str, Backend]:
        if self._dispatcher is None:
            from .fused import dispatcher_family, dispatcher_names

            self._dispatcher = {f"diffusers:{n}": Backend(
                f"diffusers:{n}", dispatcher_family(n), f"diffusers' attention dispatcher, backend {n!r}")
                for n in dispatcher_names()}
        return {**self._own, **self._dispatcher}

    def _where(self, name) -> dict:
        return self._all() if isinstance(name, str) and name.startswith("diffusers:") else self._own

    def __getitem__(self, name):
        return self._where(name)[name]

    def __contains__(self, name):
        return name in self._where(name)

    def __setitem__(self, name, backend):
        self._own[name] = backend

    def __delitem__(self, name):
        del self._own[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self):
        return len(self._all())


BACKENDS: MutableMapping[str, Backend] = _Registry((
    Backend("naive", MATERIALISED, "diffusers AttnProcessor: baddbmm + softmax, the whole score table materialised"),
    Backend("sliced", CHUNKED, "diffusers SlicedAttnProcessor: slice_size (batch*heads) rows of tables at a time",
            {"slice_size": 1}),
    Backend("split", CHUNKED, "query chunks sized so one chunk's score table fits budget_bytes (ComfyUI's split)",
            {"budget_bytes": 64 * MiB}),
    Backend("subquad", CHUNKED, "sub-quadratic attention (Rabe & Staats 2021): query and key chunks, running "
            "max and sum; at most query_chunk x key_chunk scores per batch*head",
            {"query_chunk": 1024, "key_chunk": 4096}),
    Backend("sdpa", EXACT, "diffusers AttnProcessor2_0: PyTorch SDPA, PyTorch picks the kernel"),
    Backend("sdpa-flash", EXACT, "PyTorch SDPA forced to its flash-attention kernel"),
    Backend("sdpa-efficient", EXACT, "PyTorch SDPA forced to its memory-efficient kernel (CUDA)"),
    Backend("sdpa-math", EXACT, "PyTorch SDPA forced to its math kernel: materialises the score table, in fp32"),
    Backend("sdpa-cudnn", EXACT, "PyTorch SDPA forced to its cuDNN kernel (CUDA)"),
    Backend("xformers", EXACT, "xformers memory_efficient_attention via diffusers XFormersAttnProcessor"),
    Backend("flash-attn", EXACT, "flash_attn_func of the flash-attn package (CUDA, fp16/bf16, head_dim <= 256)"),
    Backend("flash-attn-3", EXACT, "flash_attn_func of FlashAttention 3 (flash_attn_interface; Hopper sm90, "
            "fp16/bf16, head_dim <= 256 and a multiple of 8)"),
    Backend("flex", EXACT, "FlexAttention compiled once per process and shape (torch.compile), an all-full block "
            "mask; the compile time kept apart (compile_s)"),
    Backend("sage", APPROXIMATE, "sageattn of SageAttention: int8 QK, fp16 PV (CUDA sm80+, fp16/bf16, head_dim "
            "<= 128)"),
))
_SDPA_KERNELS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "sdpa-math": SDPBackend.MATH, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
# processors whose q, k and v are freed before the output projection (processor.Processor's attend returns)
_FREES_QKV = ("flash-attn", "flash-attn-3", "flex", "sage")
# which of our models a dispatcher backend's kernel follows (the kernel it runs); the others: a fused kernel's
_DISPATCHER_MODELS = {"native": "sdpa", "_native_flash": "sdpa-flash", "_native_math": "sdpa-math",
                      "_native_efficient": "sdpa-efficient", "_native_cudnn": "sdpa-cudnn", "xformers": "xformers",
                      "flex": "flex-eager"}


def by_family(names) -> list[tuple[str, list[str]]]:
    """The names grouped by their backend's family, families in FAMILIES order (then 'other': names that are not
    registered, e.g. a plugin's stored in a run), names in the order given."""
    groups: dict[str, list[str]] = {f: [] for f in (*FAMILIES, "other")}
    for name in dict.fromkeys(names):
        groups[family(name)].append(name)
    return [(f, members) for f, members in groups.items() if members]


def family(name: str) -> str:
    return BACKENDS[name].family if name in BACKENDS else "other"


def compiles(name: str) -> bool:
    """Whether the backend compiles its kernel on first use of a shape (its cell then runs a compile pass)."""
    return name == "flex"


def register(backend: Backend) -> None:
    """Add a backend of your own (a processor factory that takes the backend's options as keywords). Modules named
    in $ATTNPROF_PLUGINS (comma-separated) are imported when this module is, so that workers see them too."""
    if backend.factory is None or backend.memory_like not in BACKENDS:
        raise ValueError(f"backend {backend.name!r} needs a factory and memory_like naming a built-in backend")
    if backend.family not in FAMILIES:
        raise ValueError(f"backend {backend.name!r} has family {backend.family!r}: use one of {', '.join(FAMILIES)}")
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
    if name.startswith("diffusers:"):
        return _DISPATCHER_MODELS.get(name.removeprefix("diffusers:"), "").startswith("sdpa")
    return name == "sdpa" or name.startswith("sdpa-")


def picks_sdpa_kernel(name: str) -> bool:
    """Whether PyTorch picks the SDPA kernel of the backend's calls (sdpa, diffusers:native), not the backend."""
    return name == "sdpa" or _DISPATCHER_MODELS.get(name.removeprefix("diffusers:")) == "sdpa" and \
        name.startswith("diffusers:")


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        dispatcher = name.startswith("diffusers:")
        same_kind = [n for n in BACKENDS if n.startswith("diffusers:") == dispatcher]
        raise InputError(f"unknown backend {name!r}: use one of {', '.join(same_kind)}" + ("" if dispatcher else
                         ", or diffusers:NAME for a backend of diffusers' dispatcher (attnprof backends lists them)"))


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

    from . import fused

    if BACKENDS[name].factory is not None:
        return BACKENDS[name].factory(**opts)
    if name in _SDPA_KERNELS:
        return SDPAKernelProcessor(_SDPA_KERNELS[name])
    if name.startswith("diffusers:"):
        return fused.DispatchProcessor(name.removeprefix("diffusers:"))
    factories = {"naive": ap.AttnProcessor, "sliced": ap.SlicedAttnProcessor, "split": SplitProcessor,
                 "subquad": SubQuadProcessor, "sdpa": ap.AttnProcessor2_0, "xformers": ap.XFormersAttnProcessor,
                 "flash-attn": fused.FlashAttnProcessor, "flex": fused.FlexProcessor, "sage": fused.SageProcessor,
                 "flash-attn-3": lambda: fused.FlashAttnProcessor("flash_attn_interface", "flash-attn-3")}
    return factories[name](**opts)


# ---- availability

@dataclass(frozen=True)
class Needs:
    """What a backend needs that can be said before it runs (availability's first answer; its probe then runs it)."""
    package: str = ""  # the module it imports
    install: str = ""  # how to get it
    cuda: bool = False  # CUDA only
    half: bool = False  # float16 / bfloat16 only
    max_head_dim: int = 0  # 0: no limit
    head_dim_multiple: int = 1
    source: str = ""  # where the head-dim limit is documented
    gpus: str = ""  # the GPUs it runs on, as said where arch_ok refuses one
    arch_ok: Callable | None = None  # (major, minor) of the CUDA device -> whether it runs there


NEEDS = {
    "sdpa-efficient": Needs(cuda=True), "sdpa-cudnn": Needs(cuda=True),
    "xformers": Needs("xformers", "pip install xformers", cuda=True),
    "flash-attn": Needs("flash_attn", "pip install flash-attn", cuda=True, half=True, max_head_dim=256,
                        head_dim_multiple=8),
    "flash-attn-3": Needs("flash_attn_interface", "build flash-attn's hopper/ (FlashAttention 3)", cuda=True,
                          half=True, max_head_dim=256, head_dim_multiple=8, gpus="runs on Hopper (sm90) only",
                          arch_ok=lambda arch: arch[0] == 9),
    "sage": Needs("sageattention", "pip install sageattention", cuda=True, half=True, max_head_dim=SAGE_MAX_HEAD_DIM,
                  source=" (thu-ml/SageAttention#119)", gpus="needs an sm80 or newer GPU",
                  arch_ok=lambda arch: arch >= (8, 0)),
}


def _cuda_arch(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _static_reason(name: str, device: torch.device, dtype: str, head_dims: tuple[int, ...]) -> str:
    """Why the backend cannot run here, said from what it needs (NEEDS; a dispatcher backend: diffusers' own
    requirement check), or '' where only running it can tell."""
    if name.startswith("diffusers:"):
        from .fused import dispatcher_reason

        return dispatcher_reason(name.removeprefix("diffusers:"), device)
    needs = NEEDS.get(name, Needs())
    if needs.package and importlib.util.find_spec(needs.package) is None:
        return f"{name} is not installed: {needs.install}"
    if needs.cuda and device.type != "cuda":
        return f"{name} runs on CUDA only, not on {device.type}"
    if needs.half and dtype == "float32":
        return f"{name} runs in float16 or bfloat16 only, not float32"
    arch = _cuda_arch(device) if needs.arch_ok else None
    if arch and not needs.arch_ok(arch):
        return f"{name} {needs.gpus}; this GPU is sm{arch[0]}{arch[1]}"
    m = needs.head_dim_multiple
    bad = [d for d in head_dims if needs.max_head_dim and (d > needs.max_head_dim or d % m)]
    if bad:
        return (f"{name} needs head_dim <= {needs.max_head_dim}{f' and a multiple of {m}' if m > 1 else ''}"
                f"{needs.source}; this model has head_dim {bad[0]}")
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
    """The built-in whose models a backend uses (itself, a registered backend's memory_like, or for a dispatcher
    backend the kernel it runs: 'flex-eager' for diffusers' uncompiled FlexAttention), with its options."""
    opts = check_options(name, options)
    if name.startswith("diffusers:"):
        kernel = name.removeprefix("diffusers:")
        model = _DISPATCHER_MODELS.get(kernel, "sage" if "sage" in kernel else "flash-attn")
        return model, {} if model == "flex-eager" else check_options(model, {})
    if name == "flash-attn-3":
        return "flash-attn", opts
    if BACKENDS[name].memory_like:
        return BACKENDS[name].memory_like, check_options(BACKENDS[name].memory_like, {})
    return name, opts


def predicted_peak_bytes(name: str, row: dict, dtype: str, **options) -> int:
    """Transient peak of one processor call over what was allocated when it began (the output counts), following the
    processor op by op as it allocates and frees (tests/test_forward.py holds it to the fake-tensor trace of every
    call of SD 1.5, SD 2.1 and SDXL, both batch sizes, with and without upcast).

    Every processor first holds q, k, v (a_q + 2 a_k) and ends holding its head-merged output and to_out's output (2
    a_q); q, k and v are still alive then, but for the fused processors of fused.py, whose kernels write (B, Tq, h,
    d), so that their head merge is a view. Scores take row["score_bytes"] / row["score_elements"] bytes (4 where
    diffusers upcasts). `sdpa` on CUDA follows the kernel named in row["sdpa_kernel"] (the planner's and the
    measurement's); a dispatcher backend (diffusers:<name>) follows the kernel it runs, flex on the CPU adds the K and
    V copies that the compiled CPU kernel reorders for its gemms (row["device"], default CUDA), and the CPU flash
    kernel its per-thread buffers (cpu_flash_tiles, at this process's thread count). Left out: compiled flex's
    per-thread tiles (under 0.5 MiB per thread), kernel workspaces other than the mem-efficient kernel's float32
    accumulator (head_dim > 128 in float16 / bfloat16), and the mask diffusers repeats per head."""
    frees_qkv = name in _FREES_QKV or name.startswith("diffusers:")
    copies_qkv = name == "diffusers:_native_cudnn"  # diffusers makes q, k and v contiguous (B, h, T, d) for cuDNN
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
    elif name == "flex-eager":  # FlexAttention uncompiled (torch's math_attention): float32 scores, their masked
        big = n * tq * tk  # copy and softmax alive at once, a bool table of fully masked rows, below float32 the
        core = a_q + 12 * big + big + (e < 4) * big * e  # probabilities cast back (measured on the CPU in float32)
    elif name == "flex" and _on_cpu(row):  # the compiled CPU kernel: output, and K and V reordered for its gemms
        core = a_q + 2 * a_k
    elif name == "sage":  # not measured here (CUDA only): output, Q and K in int8 with head_dim padded to 64 / 128,
        d_pad = 64 if d <= 64 else 128  # and K smoothed (its mean over tokens taken off: a copy)
        core = a_q + n * (tq + tk) * d_pad + a_k
    else:  # fused kernels: output and a float32 logsumexp (mem-efficient: none, but a float32 accumulator past
        kernel = {"sdpa-efficient": "efficient", "sdpa": row.get("sdpa_kernel")}.get(name)  # head_dim 128)
        acc = n * tq * d * 4 if kernel == "efficient" and d > 128 and e < 4 else 0
        lse = 0 if kernel == "efficient" else n * tq * 4  # mem-efficient computes none where no gradient is asked
        tiles = cpu_flash_tiles(tq, tk, d, e) if _flash_on_cpu(name, row) else 0
        core = (a_q + 2 * a_k) * copies_qkv + a_q + lse + acc + tiles
    if frees_qkv:  # processor.Processor's attend() returns (B, Tq, C): q, k and v are gone before to_out runs
        return int(max(a_q + 2 * a_k + core, 2 * a_q))
    return int(a_q + 2 * a_k + max(core, 2 * a_q))  # every processor ends holding its merged output and to_out's


def cpu_flash_tiles(tokens_q: int, tokens_k: int, head_dim: int, itemsize: int, threads: int | None = None) -> int:
    """The per-thread buffers of aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu): per thread a
    float32 block of qs x kvs scores, its row max and sum and a qs x head_dim accumulator, and below float32 the
    block in the input dtype; qs = 256 query rows from 768 queries (64 from 192, else 32), kvs = 512 keys (fewer
    where there are fewer). Measured on this machine's 2 threads, float32, bfloat16 and float16, 64 to 4096 tokens,
    head_dim 8 to 160: exact."""
    qs = min(tokens_q, 256 if tokens_q >= 768 else 64 if tokens_q >= 192 else 32)
    kvs = min(512, tokens_k)
    per_thread = 4 * (qs * kvs + 2 * qs + qs * head_dim) + (itemsize < 4) * qs * kvs * itemsize
    return (threads or torch.get_num_threads()) * per_thread


def _flash_on_cpu(name: str, row: dict) -> bool:
    """Whether the call runs aten's CPU flash kernel."""
    kernel = {"sdpa-flash": "flash", "sdpa": row.get("sdpa_kernel")}.get(name)
    return kernel == "flash" and _on_cpu(row)


def _on_cpu(row: dict) -> bool:
    """Whether the call runs on the CPU: row["device"] where the row has it (measured cells, the planner's trace),
    else the GPU that the planner targets by default."""
    return str(row.get("device", "cuda")).startswith("cpu")


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
    if name in ("sdpa-math", "flex-eager") or (name == "sdpa" and row.get("sdpa_kernel") == "math"):
        f = 4 / e  # float32 operands
        casts = (a_q + 2 * a_k) * (1 + f) + a_q * (f + 1) if e < 4 else 0  # in: read, write f32; out: the reverse
        return int(f * (2 * a_q + 2 * a_k) + 4 * n * tq * tk * 4 + casts)
    return 2 * a_q + 2 * a_k  # fused kernels: Q, K and V read once, O written once


_load_plugins()
