"""Attention backends: a registry of processors that diffusers' Attention.set_processor accepts, one record each
(Backend: its family, options, processor factory, the SDPA kernel it runs, what it needs, the name of its memory
model) and an honest availability check (the reason when it cannot run). The processors are processor.py's (ours),
fused.py's (the fused kernels' beside SDPA) and diffusers' own; the memory and bytes-moved models planner/memory.py's.
This module imports neither torch nor diffusers until a processor is made or a backend probed."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..spec import InputError, MiB, parse_dtype, torch_dtype
from . import mix

if TYPE_CHECKING:  # annotations only: torch is imported where a backend is probed
    import torch


# materialised: the score table whole, as the textbook algorithm (naive). The outputs' error reference is another
# thing: sdpa in float32 (measure/cell.py runs it), which scales to every size the device holds
REFERENCE_BACKEND, REFERENCE_DTYPE = "sdpa", "float32"
MATERIALISED, CHUNKED, EXACT, APPROXIMATE = "materialised", "chunked", "fused exact", "fused approximate"
MIXED = "mixed"  # a processor map (mix.py): one backend per block
FAMILIES = (MATERIALISED, CHUNKED, EXACT, APPROXIMATE, MIXED)  # the order in which reports group backends


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
    max_batch_heads: int = 0  # a call's batch x heads it takes at most (0: no limit), and where that is documented
    batch_heads_source: str = ""


@dataclass(frozen=True)
class Backend:
    """Everything the profiler knows about one backend. Adding one is one record (register) and its processor."""
    name: str
    family: str  # one of FAMILIES
    description: str
    options: dict = field(default_factory=dict)  # option name -> default
    factory: Callable | None = None  # the options as keywords -> a new processor (none imports diffusers on import)
    model: str = ""  # its memory and bytes-moved model: a key of planner/memory.py's MODELS
    memory_like: str | None = None  # or: the backend whose models (at its default options) this one follows
    sdpa_kernel: str = ""  # the SDPA kernel it forces (flash, efficient, math, cudnn), as rows name kernels
    picks_sdpa_kernel: bool = False  # PyTorch picks the SDPA kernel of its calls (sdpa, diffusers:native)
    uses_sdpa: bool = False  # its processor calls PyTorch's scaled_dot_product_attention
    frees_qkv: bool = False  # q, k and v are freed before to_out (processor.Processor's attend() returns)
    copies_qkv: bool = False  # q, k and v copied once more for the kernel (diffusers' cuDNN: contiguous (B, h, T, d))
    compiles: bool = False  # compiles its kernel on first use of a shape (its cell then runs a compile pass)
    added_kv: bool = False  # it stands in for a SimpleCrossAttn block's added-KV attention (processor.for_module)
    needs: Needs = Needs()
    kernels: str = ""  # a regex of its own GPU kernels' names, where they are neither SDPA's nor a chunked matmul's
    attention_op: str = ""  # a regex of the one op that is its whole attention in a trace (SDPA's: uses_sdpa)
    dispatcher: bool = False  # it runs through diffusers' attention dispatcher (diffusers:<name>)
    runs_kernel: str = ""  # the kernel its library runs, as the GPU time model names kernels (planner/kernels.py)


def _made_by(module: str, name: str, *args) -> Callable:
    """A factory of processor `name` of `module` (its options as keywords; args first), which imports the module on
    its first call: the registry itself imports neither torch nor diffusers, so that commands that only read runs
    (show, diff, report, jobs) start without them."""
    def make(**options):
        return getattr(importlib.import_module(module), name)(*args, **options)
    return make


_DIFFUSERS = "diffusers.models.attention_processor"
DISPATCHER = "diffusers:"  # the names of diffusers' dispatcher's backends: diffusers:<its name>
_OURS, _FUSED = "profiler.attention.processor", "profiler.attention.fused"
SAGE_MAX_HEAD_DIM = 128  # thu-ml/SageAttention#119: head_dim 160 (SD 1.5's inner blocks) is rejected
XFORMERS_MAX_BATCH_HEADS = 65535  # xformers#845: batch x heads above it fails to launch (AnimateDiff's temporal calls
# at 512x512 with guidance: 2 x 64 x 64 positions x 8 heads = 65,536)


def dispatcher_names() -> list[str]:
    """Every AttentionBackendName of the installed diffusers, spelled as diffusers spells it. Imports diffusers
    (about 1.8 s on this machine's CPU): the registry asks for these only when it is listed."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName]


def dispatcher_family(name: str) -> str:
    """Sage's int8 / fp8 kernels are approximate; every other dispatcher backend computes exact attention."""
    return APPROXIMATE if name.startswith(("sage", "_sage")) else EXACT


def dispatcher_reason(backend: str, device: torch.device) -> str:
    """diffusers' own requirement check, then what it does not check: a kernel fetched from the Hub at run time,
    and the kernels that run on CUDA (or NPU / XLA) only."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    if backend.endswith("_hub"):
        return f"diffusers:{backend} needs a download at run time (a kernel from the Hugging Face Hub)"
    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except RuntimeError as e:
        return f"diffusers:{backend}: {str(e).strip().splitlines()[0]}"
    if device.type != "cuda" and backend not in ("native", "_native_math", "_native_flash", "flex"):
        return f"diffusers:{backend} runs on CUDA only, not on {device.type}"
    return ""


# ---- the registry

def _sdpa_forced(kernel: str, description: str, **more) -> Backend:
    return Backend(f"sdpa-{kernel}", EXACT, description, factory=_made_by(_OURS, "SDPAKernelProcessor", kernel),
                   model="math" if kernel == "math" else "fused", sdpa_kernel=kernel, uses_sdpa=True, added_kv=True,
                   **more)


def _dispatcher_backend(name: str) -> Backend:
    """The record of diffusers:<name>: its processor runs the dispatcher (which frees q, k and v before to_out); its
    model is that of the kernel it runs where that is one of ours, else a fused kernel's (sage's for sage's)."""
    how = _DISPATCHER_KERNELS.get(name, {"model": "sage" if "sage" in name else "fused"})
    return Backend(f"{DISPATCHER}{name}", dispatcher_family(name),
                   f"diffusers' attention dispatcher, backend {name!r}",
                   factory=_made_by(_FUSED, "DispatchProcessor", name), frees_qkv=True, dispatcher=True, **how)


_DISPATCHER_KERNELS = {  # the dispatcher's backends that run a kernel we model (the others: a fused kernel's model)
    "native": {"model": "fused", "picks_sdpa_kernel": True, "uses_sdpa": True},
    "_native_flash": {"model": "fused", "sdpa_kernel": "flash", "uses_sdpa": True},
    "_native_efficient": {"model": "fused", "sdpa_kernel": "efficient", "uses_sdpa": True},
    "_native_math": {"model": "math", "sdpa_kernel": "math", "uses_sdpa": True},
    "_native_cudnn": {"model": "fused", "sdpa_kernel": "cudnn", "uses_sdpa": True, "copies_qkv": True},
    "xformers": {"model": "fused"},
    "flex": {"model": "flex-eager"},  # uncompiled FlexAttention
}


class _Registry(MutableMapping):
    """The backends by name. The `diffusers:<name>` entries (one per backend of the installed diffusers' dispatcher)
    join on the first look at the whole registry or at one of them: listing them imports diffusers, which costs
    every command's start (attnprof --help) about 1.8 s where nothing else needs it."""

    def __init__(self, builtins: tuple[Backend, ...]):
        self._own = {b.name: b for b in builtins}
        self._dispatcher: dict[str, Backend] | None = None

    def _all(self) -> dict[str, Backend]:
        if self._dispatcher is None:
            self._dispatcher = {b.name: b for b in map(_dispatcher_backend, dispatcher_names())}
        return {**self._own, **self._dispatcher}

    def _where(self, name) -> dict:
        return self._all() if isinstance(name, str) and name.startswith(DISPATCHER) else self._own

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


_HALF_CUDA = {"cuda": True, "half": True}
BACKENDS: MutableMapping[str, Backend] = _Registry((
    Backend("naive", MATERIALISED, "diffusers AttnProcessor: baddbmm + softmax, the whole score table materialised",
            factory=_made_by(_DIFFUSERS, "AttnProcessor"), model="naive", added_kv=True),
    Backend("sliced", CHUNKED, "diffusers SlicedAttnProcessor: slice_size (batch*heads) rows of tables at a time",
            {"slice_size": 1}, factory=_made_by(_OURS, "sliced"), model="sliced"),
    Backend("split", CHUNKED, "query chunks sized so one chunk's score table fits budget_bytes (ComfyUI's split)",
            {"budget_bytes": 64 * MiB}, factory=_made_by(_OURS, "SplitProcessor"), model="split"),
    Backend("subquad", CHUNKED, "sub-quadratic attention (Rabe & Staats 2021): query and key chunks, running "
            "max and sum; at most query_chunk x key_chunk scores per batch*head",
            {"query_chunk": 1024, "key_chunk": 4096}, factory=_made_by(_OURS, "SubQuadProcessor"), model="subquad"),
    Backend("sdpa", EXACT, "diffusers AttnProcessor2_0: PyTorch SDPA, PyTorch picks the kernel",
            factory=_made_by(_DIFFUSERS, "AttnProcessor2_0"), model="fused", picks_sdpa_kernel=True, uses_sdpa=True,
            added_kv=True),
    _sdpa_forced("flash", "PyTorch SDPA forced to its flash-attention kernel"),
    _sdpa_forced("efficient", "PyTorch SDPA forced to its memory-efficient kernel (CUDA)", needs=Needs(cuda=True)),
    _sdpa_forced("math", "PyTorch SDPA forced to its math kernel: materialises the score table, in fp32"),
    _sdpa_forced("cudnn", "PyTorch SDPA forced to its cuDNN kernel (CUDA)", needs=Needs(cuda=True)),
    Backend("xformers", EXACT, "xformers memory_efficient_attention via diffusers XFormersAttnProcessor",
            factory=_made_by(_DIFFUSERS, "XFormersAttnProcessor"), model="fused",
            needs=Needs("xformers", "pip install xformers", cuda=True, max_batch_heads=XFORMERS_MAX_BATCH_HEADS,
                        batch_heads_source=" (facebookresearch/xformers#845: its CUDA grid's y dimension)"),
            attention_op=r"^xformers(_flash)?::"),
    Backend("flash-attn", EXACT, "flash_attn_func of the flash-attn package (CUDA, fp16/bf16, head_dim <= 256)",
            factory=_made_by(_FUSED, "FlashAttnProcessor"), model="fused", frees_qkv=True,
            needs=Needs("flash_attn", "pip install flash-attn", **_HALF_CUDA, max_head_dim=256, head_dim_multiple=8),
            attention_op=r"^flash_attn(_3)?::", runs_kernel="flash"),
    Backend("flash-attn-3", EXACT, "flash_attn_func of FlashAttention 3 (flash_attn_interface; Hopper sm90, "
            "fp16/bf16, head_dim <= 256 and a multiple of 8)",
            factory=_made_by(_FUSED, "FlashAttnProcessor", "flash_attn_interface", "flash-attn-3"),
            model="fused", frees_qkv=True,
            needs=Needs("flash_attn_interface", "build flash-attn's hopper/ (FlashAttention 3)", **_HALF_CUDA,
                        max_head_dim=256, head_dim_multiple=8, gpus="runs on Hopper (sm90) only",
                        arch_ok=lambda arch: arch[0] == 9),
            kernels=r"cutlass::device_kernel<flash::", attention_op=r"^flash_attn(_3)?::", runs_kernel="fa3"),
    Backend("flex", EXACT, "FlexAttention compiled once per process and shape (torch.compile), an all-full block "
            "mask; the compile time kept apart (compile_s)", factory=_made_by(_FUSED, "FlexProcessor"), model="flex",
            frees_qkv=True, compiles=True, kernels=r"triton_tem_fused"),
    Backend("sage", APPROXIMATE, "sageattn of SageAttention: int8 QK, fp16 PV (CUDA sm80+, fp16/bf16, head_dim "
            "<= 128)", factory=_made_by(_FUSED, "SageProcessor"), model="sage", frees_qkv=True,
            needs=Needs("sageattention", "pip install sageattention", **_HALF_CUDA,
                        max_head_dim=SAGE_MAX_HEAD_DIM, source=" (thu-ml/SageAttention#119)",
                        gpus="needs an sm80 or newer GPU", arch_ok=lambda arch: arch >= (8, 0)),
            kernels=r"(?<!::)qk_int8?_sv_f"),
))


TUNED = Backend(mix.NAME, MIXED, "a processor map (attnprof tune): one backend per block, each block's own",
                uses_sdpa=True)  # not in BACKENDS: a map is a file, not a name to list; uses_sdpa: some of its may


def for_call(name: str, options: dict, row: dict) -> tuple[str, dict]:
    """The backend (and its options) that runs one call (a row with its block): the backend itself, or for a
    processor map the entry of the call's block."""
    if not mix.is_map(name):
        return name, options
    text = options["map"] if name == mix.NAME and "map" in options else check_options(name, options)["map"]
    return mix.of_block(text, row["block"])  # a cell's map was checked where it was given


def call_refusal(name: str, row: dict, options: dict | None = None) -> str:
    """Why the backend cannot run one attention call (a recorder row: its kind, batch, heads, head_dim), from the facts
    on its record; '' where it can. What the planner says beside the call and the preflight records as a cell's
    reason (never an error at run time). A processor map: its block's backend."""
    name, _ = for_call(name, options or {}, row)
    b = _record(name)
    if b is None:
        return ""
    if row.get("kind") == "added-kv" and not b.added_kv:
        return (f"{name} cannot stand in for a SimpleCrossAttn block's added-KV attention (its keys are the "
                "conditioning tokens and every position of the block; diffusers' AttnAddedKVProcessor does it for "
                "naive and sdpa)")
    n, bh = b.needs, row["batch"] * row["heads"]
    if n.max_batch_heads and bh > n.max_batch_heads:
        return f"{name} cannot run this call (batch x heads {bh:,} > {n.max_batch_heads:,}{n.batch_heads_source})"
    if n.max_head_dim and (row["head_dim"] > n.max_head_dim or row["head_dim"] % n.head_dim_multiple):
        return f"{name} cannot run this call (head_dim {row['head_dim']}: it takes <= {n.max_head_dim}{n.source})"
    return ""


def refusal(name: str, rows: list[dict], options: dict | None = None) -> str:
    """Why the backend cannot run a forward of these calls: the first call it refuses, and how many it refuses; ''
    where it runs every one."""
    refused = [(r, why) for r in rows for why in [call_refusal(name, r, options)] if why]
    if not refused:
        return ""
    row, why = refused[0]
    return f"{why}: {len(refused)} of {len(rows)} calls, e.g. {row['block']}"


def _record(name: str) -> Backend | None:
    """The backend's record (a processor map's: TUNED), or None for a name that is not registered (a plugin's, stored
    in a run)."""
    return TUNED if mix.is_map(name) else BACKENDS[name] if name in BACKENDS else None


def own_kernels() -> dict[str, str]:
    """Each registered backend's own GPU kernels (its record's `kernels`), by name; diffusers' dispatcher's backends
    run kernels named here (kernel_of) and are not listed, so that nothing imports diffusers for it."""
    return {b.name: b.kernels for b in BACKENDS._own.values() if b.kernels}


def attention_op(name: str) -> str:
    """The regex of the one op that is the backend's whole attention in a trace: SDPA's concrete kernels for a
    backend that calls SDPA, else its record's `attention_op`; '' where there is none (naive's is several ops)."""
    b = _record(name)
    if b is None:
        return ""
    return r"^aten::_scaled_dot_product_(?!attention$)" if b.uses_sdpa else b.attention_op


def by_family(names) -> list[tuple[str, list[str]]]:
    """The names grouped by their backend's family, families in FAMILIES order (then 'other': names that are not
    registered, e.g. a plugin's stored in a run), names in the order given."""
    groups: dict[str, list[str]] = {f: [] for f in (*FAMILIES, "other")}
    for name in dict.fromkeys(names):
        groups[family(name)].append(name)
    return [(f, members) for f, members in groups.items() if members]


def family(name: str) -> str:
    b = _record(name)
    return b.family if b else "other"


def compiles(name: str) -> bool:
    """Whether the backend compiles its kernel on first use of a shape (its cell then runs a compile pass)."""
    b = _record(name)
    return bool(b and b.compiles)


def register(backend: Backend) -> None:
    """Add a backend of your own: one record, with a processor factory that takes the backend's options as keywords
    and a memory model (model: one of planner/memory.py's; or memory_like: a registered backend whose models it
    follows). Modules named in $ATTNPROF_PLUGINS (comma-separated) are imported when this module is, so that
    workers see them too."""
    if backend.factory is None or not (backend.model or backend.memory_like in BACKENDS):
        raise ValueError(f"backend {backend.name!r} needs a factory and a model (or memory_like naming a registered "
                         "backend)")
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
    pairs. A processor map: 'tuned (tuned.json)'."""
    options = dict(json.loads(options) if isinstance(options, str) and options else options or {})
    if mix.is_map(name):
        return mix.label(name, options)
    b = _record(name)
    defaults = b.options if b else {}
    changed = {k: v for k, v in sorted(options.items()) if defaults.get(k) != v}
    return name + (f"({','.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")


_DISPATCHER_OURS = (("native_flash", "sdpa-flash"), ("native_efficient", "sdpa-efficient"),
                       ("native_math", "sdpa-math"), ("native_cudnn", "sdpa-cudnn"), ("native", "sdpa"),
                       ("xformers", "xformers"), ("flash_3", "flash-attn-3"), ("flash", "flash-attn"),
                       ("sage", "sage"))


def kernel_of(name: str) -> str:
    """The backend whose kernel a diffusers dispatcher backend runs (diffusers:_native_flash: sdpa-flash,
    diffusers:flash_varlen_hub: flash-attn), else the name itself: what fit shows one row for."""
    if not name.startswith(DISPATCHER):
        return name
    key = name.split(":", 1)[1].lstrip("_")
    return next((ours for prefix, ours in _DISPATCHER_OURS if key.startswith(prefix) and ours in BACKENDS), name)


def dispatched(name: str) -> bool:
    """Whether the backend runs through diffusers' attention dispatcher (a diffusers:<name> record)."""
    b = _record(name)
    return bool(b and b.dispatcher)


def uses_sdpa(name: str) -> bool:
    """Whether the backend's processor calls PyTorch's scaled_dot_product_attention (so a kernel of SDPA's runs)."""
    b = _record(name)
    return bool(b and b.uses_sdpa)


def picks_sdpa_kernel(name: str) -> bool:
    """Whether PyTorch picks the SDPA kernel of the backend's calls (sdpa, diffusers:native), not the backend."""
    b = _record(name)
    return bool(b and b.picks_sdpa_kernel)


def call_kernel(name: str, row: dict, arch: str | None = None) -> str:
    """The kernel that runs a call's attention (what the GPU time model fits, planner/kernels.py): the SDPA kernel the
    backend (or the one of ours a dispatcher backend runs: kernel_of) forces, or the one PyTorch chose for the call
    (row["sdpa_kernel"]); the kernel a fused library runs (its record's runs_kernel: flash-attn's FlashAttention-2
    is PyTorch's flash one; xformers dispatches to FlashAttention-2 first where it runs, from sm80 in half precision up to head
    dim 256, else to its cutlass kernel, PyTorch's memory-efficient one); else the backend's own ops (naive's
    baddbmm, softmax and bmm; the chunked backends'). arch: the GPU's (sm90), where known."""
    own = kernel_of(name)
    b = _record(own)
    if b is not None and b.sdpa_kernel:
        return b.sdpa_kernel
    chosen = row.get("sdpa_kernel")
    if b is not None and b.picks_sdpa_kernel and isinstance(chosen, str) and chosen:
        return chosen
    if own == "xformers":
        flash = arch and int(arch.removeprefix("sm")) >= 80 and row.get("head_dim", 0) <= 256
        return "flash" if flash else "efficient"
    return b.runs_kernel if b is not None and b.runs_kernel else own


def check_backend_name(name: str) -> None:
    """A registered backend, or a processor map: `tuned` (its options say which) or a map file (read here)."""
    if mix.is_map(name):
        if name != mix.NAME:
            mix.read(name)
        return
    if name not in BACKENDS:
        dispatcher = name.startswith(DISPATCHER)
        same_kind = [n for n in BACKENDS if n.startswith(DISPATCHER) == dispatcher]
        raise InputError(f"unknown backend {name!r}: use one of {', '.join(same_kind)}" + ("" if dispatcher else
                         ", or diffusers:NAME for a backend of diffusers' dispatcher (attnprof backends lists them)"))


def _whole_number(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, str) and value.strip().isdigit() else None


def check_options(name: str, options: dict) -> dict:
    """The backend's options, validated (whole numbers >= 1; digit strings are read as numbers), over its defaults.
    A processor map's: {"file", "map"} (mix.py), each of its entries checked as a backend's."""
    if mix.is_map(name):
        return _map_options(name, options)
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


def _map_options(name: str, options: dict) -> dict:
    """A processor map's options: {"file": its file's name, "map": what runs (mix.canonical)}, read from the file
    (name: a .json path; options: none, or those it gives) or checked as given (name: tuned)."""
    if name == mix.NAME:
        if set(options) != {"file", "map"}:
            raise InputError("backend tuned takes a processor map: give --backend FILE.json (attnprof tune writes "
                             "tuned.json)")
        table, where = mix.table_of(options["map"]), f"processor map {options['file']}"
    else:
        where = f"processor map {name}"
        table = mix.entries(mix.read(name), where)
    seen: dict[str, dict] = {}
    for block, entry in [*table["blocks"].items(), *([("default", table["default"])] if table["default"] else [])]:
        if mix.is_map(entry[0]):
            raise InputError(f"{where}: {block} names another map ({entry[0]}): give backends by name")
        try:
            entry[1] = check_options(entry[0], entry[1])
        except InputError as e:
            raise InputError(f"{where}: {block}: {e}") from None
        if seen.setdefault(entry[0], entry[1]) != entry[1]:
            raise InputError(f"{where}: {entry[0]} appears with two sets of options ({seen[entry[0]]} and "
                             f"{entry[1]}): a map takes one per backend")
    made = {"file": options.get("file") if name == mix.NAME else Path(name).name, "map": mix.canonical(table)}
    if name != mix.NAME and options and options != made:
        raise InputError(f"{where}: a map file takes no options (--option): its entries carry theirs")
    return made


def cell_backend(name: str, options: dict) -> tuple[str, dict]:
    """(backend, options) as a cell stores them: a registered backend's options checked; a map file as `tuned` with
    its map (mix.py), so that the cell carries what runs."""
    opts = check_options(name, options)
    return (mix.NAME if mix.is_map(name) else name), opts


def make_processor(name: str, **options):
    """A new processor instance of the backend (availability is availability()'s job); for a processor map, one
    that gives each block its own (mix.Unplaced: recorder.swapped asks it per block)."""
    opts = check_options(name, options)
    if mix.is_map(name):
        return mix.Unplaced(opts["map"], make_processor)
    return BACKENDS[name].factory(**opts)


def asks(name: str, options: dict, device: str, dtype: str, head_dims: tuple[int, ...]) -> list[tuple]:
    """What availability is asked for a cell's backend: (backend, device, dtype, head dims); for a processor map one
    ask per backend it runs, at the head dims of its blocks where the map says them (a tuned one does)."""
    if not mix.is_map(name):
        return [(name, device, dtype, head_dims)]
    text = check_options(name, options)["map"]
    return [(part, device, dtype, mix.head_dims(text, part) or head_dims) for part in mix.parts(text)]


# ---- availability

def _cuda_arch(device: torch.device) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


def _static_reason(name: str, device: torch.device, dtype: str, head_dims: tuple[int, ...]) -> str:
    """Why the backend cannot run here, said from what it needs (its record's needs; a dispatcher backend:
    diffusers' own requirement check), or '' where only running it can tell."""
    if name.startswith(DISPATCHER):
        return dispatcher_reason(name.removeprefix("diffusers:"), device)
    needs = BACKENDS[name].needs
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


KERNEL_ERRORS = (RuntimeError, ValueError, ImportError, OSError)  # what a kernel raises where it refuses a call
# (torch's "No available kernel", flash-attn's and xformers' checks, an op missing for the device: a RuntimeError)
# or runs out of memory (torch.OutOfMemoryError, cuBLAS's and cuDNN's texts): a TypeError, KeyError or
# AttributeError is a bug of ours


@functools.lru_cache(maxsize=None)
def _probe(name: str, device: str, dtype: str, head_dim: int = 64) -> tuple[bool, str]:
    """Run the backend on a diffusers Attention with the model's head_dim, as self- and as cross-attention; the
    error (and PyTorch's warnings saying why) if it fails."""
    import torch
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
        except KERNEL_ERRORS as e:  # unsupported-kernel errors subclass these
            why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught))
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return False, (f"{name} does not run on {device} in {dtype} at head_dim {head_dim}: {first}"
                           + (f" ({why})" if why else ""))
    return True, ""


def availability(name: str, device: str = "cpu", dtype: str = "float16",
                 head_dims: tuple[int, ...] = (64,), options: dict | None = None) -> tuple[bool, str]:
    """(True, "") where the backend runs on this device in this dtype at each of the model's head dims (SD 1.x:
    40, 80, 160; SDXL: 64), else (False, the reason). A processor map (`tuned` needs its options: options): each
    backend it runs, at the head dims of its blocks."""
    import torch

    if mix.is_map(name):
        for ask in asks(name, options or {}, device, dtype, tuple(head_dims)):
            ok, why = availability(*ask)
            if not ok:
                return ok, why
        return True, ""
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


_load_plugins()
