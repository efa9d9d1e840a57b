"""The whole forward's peak memory, with no weights and no GPU.

One U-Net forward runs on fake tensors (torch._subclasses.FakeTensorMode: real shapes, dtypes and op semantics, no
storage) under `LiveBytes`, a small TorchDispatchMode that counts the bytes alive
after every op: a storage is counted when an op first returns it and uncounted when its last reference goes (a
weakref callback), views share their base's storage, and the weights and inputs are held from the start. So the
peak is what `torch.cuda.max_memory_allocated()` reports after a reset made with only the model and its inputs on
the device, less what the allocator adds (rounding, reserve), the CUDA context and kernel workspaces. We count
ourselves instead of using torch.distributed's MemTracker: it attributes every tensor to modules and parameters
and took about 30 s for SDXL base at 1024x1024 here; this takes about 2.5 s.

Every attention call runs once per asked backend on the same fake inputs (memoized by the call's shape), each
backend's transient measured from the bytes alive when the call began. The rest of the forward does not depend on
the backend (every processor returns the same (B, Tq, C) output), so the forward's peak under backend b is
    max(the peak outside attention calls, max over calls i of (live at the start of i + i's transient under b)).
The fake tensors sit on the CPU (a CPU-only torch cannot index fake CUDA tensors); outside attention every op
returns the same tensors on either device, so only the attention calls follow the target device. Backends run as
they really run there: their own processors (naive, sliced, split, subquad, sdpa-math; for the CPU also sdpa and
sdpa-flash), and for CUDA the fused SDPA kernels through their own aten ops, whose fake implementations give their
outputs (flash, mem-efficient, cuDNN; sdpa picks flash in fp16 / bf16, mem-efficient in fp32); the dispatcher's
backends that run one of these (diffusers:native, diffusers:_native_*) go the same way through diffusers' dispatcher.
Backends with no fake implementation (xformers, flash-attn, flash-attn-3, sage, the dispatcher's other kernels) use
their memory model for the attention call, and say so; so does FlexAttention (flex, diffusers:flex), which runs
through Dynamo, where this count's dispatch mode cannot follow; so do the chunked
backends for a call of more than 64 chunks (tracing thousands of chunks of a huge image costs minutes, and every
chunk repeats the first: the tests hold the model to the trace where both run). Kernels' internal buffers are
modelled: _safe_softmax's mask (one byte per score), which the math kernel holds beside its two tables, the CPU
flash kernel's per-thread buffers (memory.cpu_flash_tiles), and on the CPU every convolution's (cpu_conv: oneDNN's
blocked copies of input, weight and output, or PyTorch's im2col columns), which are the forward's peak wherever
attention's tables are small (a VAE decode or a ControlNet under sdpa: a full-resolution convolution).

With ops=True the same forward also counts every op's FLOPs and bytes (OpCount) for the time model (walk(), read by
planner/timing.py), the asked backends' own ops left out: a sweep's preflight and its time prediction share one forward
per shape (three before: this trace, a meta-device plan and the time model's walk; 5.1 s of a 32 s test fixture).
"""
from __future__ import annotations

import functools
import signal
import threading
import weakref
from collections import Counter
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..attention import backends, kernel_choice, mix
from ..unet import models
from . import cpu_conv, memory
from ..attention.processor import for_module
from ..attention.recorder import Recorder
from ..unet.workload import Workload
from ..spec import parse_dtype

LEFT_OUT = ("the CUDA context (a few hundred MiB per process), cuBLAS / cuDNN workspaces (MiB to tens "
            "of MiB), the caching allocator's rounding and reserve (make gpu-check measures these where a GPU is "
            "lent); on the CPU, the scratchpad of oneDNN's float16 / bfloat16 convolutions")


def _efficient_accumulator(args, out=None) -> int:
    """The mem-efficient kernel's float32 output accumulator, which it allocates where the output cannot stay in
    registers: head_dim above 128 with a float16 / bfloat16 output. q, v: (B, h, T, d)."""
    q, v = args[0], args[2]
    return q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] * 4 if v.shape[-1] > 128 and q.element_size() < 4 else 0


def _cpu_flash_tiles(args, out=None) -> int:
    """aten's CPU flash kernel's per-thread buffers (memory.cpu_flash_tiles). q, k: (B, h, T, d)."""
    q, k = args[0], args[1]
    return memory.cpu_flash_tiles(q.shape[2], k.shape[2], q.shape[3], q.element_size())


# kernel buffers that no fake implementation allocates, by op (args, out) -> bytes: _safe_softmax's bool mask of -inf
# rows; on the CPU, a convolution's (cpu_conv)
_WORKSPACE = {torch.ops.aten._safe_softmax.default: lambda args, out: args[0].numel(),
              torch.ops.aten._scaled_dot_product_efficient_attention.default: _efficient_accumulator,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash_tiles}
_CPU_WORKSPACE = {**_WORKSPACE, torch.ops.aten.convolution.default: cpu_conv.workspace_bytes}
_CUDA_KERNELS = ("flash", "efficient", "cudnn")  # the SDPA kernels traced as their aten op on fake CUDA tensors
MAX_TRACED_CHUNKS = 64


class LiveBytes(TorchDispatchMode):
    """Bytes alive after each op, over those held when it began; `peak` is the highest since reset_peak()."""

    def __init__(self, held: list[torch.Tensor], device: str = "cuda"):
        super().__init__()
        self.workspace = _CPU_WORKSPACE if device == "cpu" else _WORKSPACE
        self.held = {t.untyped_storage()._cdata for t in held}
        self.alive: dict[int, weakref.ref] = {}
        self.now = self.peak = 0
        self.moments: list[int] | None = None  # bytes alive after each op, while a list (outside attention calls)

    def __enter__(self):
        """While it counts, a Ctrl-C is held and raised as KeyboardInterrupt when it ends, in place of any error
        the count ends with (a caller that goes on past a trace's error must not go on past a Ctrl-C): landing in
        one of the weakref callbacks below (run as fake tensors die), Python would print it as ignored, with a
        traceback, and go on (a Ctrl-C during attnprof record's prediction in the script's process was lost so).
        Only in the main thread, where SIGINT has Python's own handler: a handler of the program's is left to do
        its work."""
        self._ctrl_c, self._handler = [], None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._handler = signal.signal(signal.SIGINT, lambda signum, frame: self._ctrl_c.append(signum))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._handler is not None:
                signal.signal(signal.SIGINT, self._handler)
                if self._ctrl_c:
                    raise KeyboardInterrupt

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.alive or key in self.held:
            return
        n = st.nbytes()
        self.alive[key] = weakref.ref(st, functools.partial(self._freed, key, n))
        self.now += n

    def _freed(self, key: int, n: int, _ref) -> None:
        if self.alive.pop(key, None) is not None:
            self.now -= n

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, (torch.Tensor, tuple, list)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t)
            extra = self.workspace.get(func)
            at = self.now + (extra(args, out) if extra else 0)
            self.peak = max(self.peak, at)
            if self.moments is not None:
                self.moments.append(at)
        return out


class _FusedOp(TorchFunctionMode):
    """diffusers' AttnProcessor2_0 as it runs on CUDA: its scaled_dot_product_attention call goes to the aten op of
    the kernel (whose fake implementation gives its outputs), since on the CPU's fake tensors PyTorch's kernel
    choice would pick a CPU kernel. kernel 'sdpa': per call, the kernel PyTorch picks on the GPU target
    (kernel_choice.sdpa_choice). Everything else (projections, layouts, what stays alive until the output projection) is
    the processor's own."""

    def __init__(self, kernel: str, dtype: str, gpu, inner=None):
        super().__init__()
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.kernel, self.dtype, self.gpu, self.inner = kernel, dtype, gpu, inner or AttnProcessor2_0()

    def __call__(self, attn, *args, **kwargs):
        with self:
            return self.inner(attn, *args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = (args[i] if i < len(args) else kwargs[n]  # (B, h, T, d); the dispatcher passes them by name
                   for i, n in enumerate(("query", "key", "value")))
        mask, scale, ops = kwargs.get("attn_mask"), kwargs.get("scale"), torch.ops.aten
        kernel = self.kernel if self.kernel != "sdpa" else \
            kernel_choice.sdpa_choice(self.dtype, q.shape[-1], k.shape[-2], "cuda", self.gpu)
        if kernel == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        if kernel == "flash":
            return ops._scaled_dot_product_flash_attention(q, k, v, scale=scale)[0]
        if kernel == "efficient":
            return ops._scaled_dot_product_efficient_attention(q, k, v, mask, False, scale=scale)[0]
        return ops._scaled_dot_product_cudnn_attention(q, k, v, mask, False, scale=scale)[0]


_NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "zeros", "ones", "full",
               "arange", "scalar_tensor", "lift_fresh", "detach", "_unsafe_view"}  # _unsafe_view: a view, unmarked


OP_CLASSES = ("convolution", "matmul", "norm", "other")  # the time model's classes of ops (planner/timing.py)
_CLASS_OF = {**dict.fromkeys(("convolution", "_convolution", "mkldnn_convolution", "convolution_overrideable",
                              "cudnn_convolution", "_slow_conv2d_forward", "slow_conv_transpose2d"), 0),
             **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"), 1),
             **dict.fromkeys(("native_group_norm", "native_layer_norm", "group_norm", "layer_norm",
                              "_native_batch_norm_legit_no_training", "native_batch_norm", "rms_norm",
                              "_fused_rms_norm"), 2)}


def op_class(name: str) -> int:
    """The index in OP_CLASSES of an aten op (its overload packet's name)."""
    return _CLASS_OF.get(name, 3)


class OpCount(TorchDispatchMode):
    """Every op's (FLOPs, bytes moved, bytes of its largest output, class): outside attention calls into `rest`,
    inside one into its list in `calls`."""

    def __init__(self):
        super().__init__()
        self.rest: list[tuple[float, float, float, float]] = []
        self.calls: list[list[tuple[float, float, float, float]]] = []
        self.at: list[int] = []  # where each call began among the rest's ops: the forward's order
        self.inside: list | None = None
        self.paused = False  # while the trace runs each asked backend on a call: their ops are not the forward's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        returns, name = func._schema.returns, func.overloadpacket.__name__
        tensors = lambda x: [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]  # noqa: E731
        if name in _NO_TRAFFIC or any(r.alias_info is not None and not r.alias_info.is_write for r in returns) or \
                not tensors(out):
            return out  # a view, an allocation, or a metadata query (a fake tensor's .device: prim.device): no kernel
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        moved = sum(nbytes(t) for t in tensors((args, kwargs)) + tensors(out))
        written = any(r.alias_info is not None for r in returns)  # an in-place op or out=: no new tensor
        largest = 0 if written else max((nbytes(t) for t in tensors(out)), default=0)
        count = flop_registry.get(func.overloadpacket)
        flops = count(*args, **kwargs, out_val=out) if count else 0
        (self.inside if self.inside is not None else self.rest).append((float(flops), float(moved), float(largest),
                                                                         float(op_class(name))))
        return out


class _NoCore(TorchFunctionMode):
    """scaled_dot_product_attention answered with an empty output of its shape: the core is modelled apart."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, v = args[0], args[2] if len(args) > 2 else kwargs["value"]
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


FLEX_HOW = "memory model; FlexAttention runs through Dynamo, which this fake-tensor count cannot follow"


def how_traced(name: str, device: str, dtype: str) -> str | None:
    """How a backend's attention calls are traced on this device: 'processor', a CUDA kernel name, 'memory model'
    (no fake implementation of the kernel; after a ';' why), or None where the backend does not run on the device
    at all. A dispatcher backend that runs one of PyTorch's SDPA kernels is traced as that kernel is, through
    diffusers' dispatcher (its own processor); its other kernels come from their models."""
    b, cuda = backends.BACKENDS[name], device == "cuda"
    if b.model in ("flex", "flex-eager"):  # FlexAttention, compiled or not (flex, diffusers:flex)
        return FLEX_HOW
    if b.picks_sdpa_kernel:
        return "sdpa" if cuda else "processor"  # PyTorch's choice, per call
    if b.sdpa_kernel in _CUDA_KERNELS:
        return b.sdpa_kernel if cuda else "processor" if b.sdpa_kernel == "flash" else None
    if b.needs.package or b.dispatcher and not b.uses_sdpa:
        return "memory model" if cuda else None  # an extension's kernel, or one of diffusers' dispatcher's
    return "processor"


def method_text(how: str) -> str:
    if how.startswith("memory model;"):
        return f"attention calls from the {how}"
    if how.startswith("sdpa: "):
        return f"traced: PyTorch's pick per call ({how.removeprefix('sdpa: ')}), its aten op on fake CUDA tensors"
    return {"processor": "traced: its processor on fake tensors",
            "processor, chunks": f"traced: its processor on fake tensors; calls of over {MAX_TRACED_CHUNKS} chunks "
                                 "from the memory model",
            "memory model": "attention calls from the memory model (no fake implementation of the kernel)",
            "sdpa": "traced: PyTorch's pick per call, its aten op on fake CUDA tensors",
            "mixed": "traced: each block's backend as that backend is traced (a processor map)"}.get(
        how, f"traced: aten's {how} attention kernel on fake CUDA tensors")


def _dispatcher(name: str):
    """The processor that _FusedOp runs around a CUDA kernel: diffusers' dispatcher for a diffusers:<name> backend
    (its SDPA call is the one replaced), else AttnProcessor2_0's (None)."""
    return backends.make_processor(name) if backends.dispatched(name) else None


def _temb(proc, temb) -> dict:
    """temb for a processor whose __call__ takes it (diffusers' own drop it for those that do not)."""
    import inspect

    return {"temb": temb} if temb is not None and "temb" in inspect.signature(proc.__call__).parameters else {}


class _EveryBackend:
    handles_added_kv = True  # it runs each backend as processor.for_module fits it to the call's module

    """Stands in for each attention module's processor during the trace: runs every asked backend on the call's
    inputs (once per call shape), measures each one's transient, and returns one backend's output."""

    def __init__(self, trace: "_Trace"):
        self.trace = trace

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        # temb named, so that diffusers passes a VAE's own (and warns of nothing); handed on to a processor that takes it
        tr, live = self.trace, self.trace.live
        tr.outside = max(tr.outside, live.peak)
        start, moments, live.moments = live.now, live.moments, None
        row = tr.recorder.current_pass[-1]
        key = (row["kind"], row["batch"], row["heads"], row["head_dim"], row["tokens_q"], row["tokens_k"],
               tuple(hidden_states.shape))
        row["sdpa_kernel"], row["device"] = tr.sdpa_kernel(row), tr.device
        if tr.counter:
            tr.counter.paused = True
        if key not in tr.transient:
            tr.transient[key] = {}
            for name, proc in tr.processors.items():
                proc = for_module(proc, attn) if proc is not None else None  # an added-KV block's own, or none
                if proc is not None and memory.chunks(name, row, tr.dtype, **tr.options[name]) <= MAX_TRACED_CHUNKS:
                    live.reset_peak()
                    try:
                        out = proc(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs,
                                   **_temb(proc, temb))
                        del out
                        tr.transient[key][name] = live.peak - start
                        continue
                    except Exception as e:  # a processor of a plugin may not run on fake tensors: its model then
                        tr.failed.setdefault(name, f"{type(e).__name__}: {e}"[:160])
                tr.transient[key][name] = memory.predicted_peak_bytes(name, row, tr.dtype, **tr.options[name])
                tr.modelled.add(name)
        live.reset_peak()
        if tr.counter:  # the call's own ops: its projections and layouts, the attention core left out
            tr.counter.paused, tr.counter.inside = False, []
            tr.counter.calls.append(tr.counter.inside)
            tr.counter.at.append(len(tr.counter.rest))
        with _NoCore():  # an output of the call's shape, which every backend's has; its transient is not used
            out = for_module(tr.carry, attn)(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)
        if tr.counter:
            tr.counter.inside = None
        tr.calls.append((row, start, key))
        live.reset_peak()
        live.moments = moments
        return out


class _Trace:
    def __init__(self, dtype: str, processors: dict, options: dict, device: str, gpu):
        self.dtype, self.processors, self.options, self.device, self.gpu = dtype, processors, options, device, gpu
        self.carry = backends.make_processor("sdpa")  # gives the call's output; every backend's has its shape
        self.transient: dict[tuple, dict[str, int]] = {}
        self.calls: list[tuple[dict, int, tuple]] = []
        self.outside = 0
        self.modelled: set[str] = set()  # backends with a call from the memory model
        self.failed: dict[str, str] = {}  # backends whose processor raised on the fake tensors, and what it raised
        self.live: LiveBytes | None = None
        self.recorder: Recorder | None = None
        self.kernels: dict[tuple, str] = {}
        self.counter: OpCount | None = None

    def sdpa_kernel(self, row: dict) -> str:
        """The kernel sdpa runs for this call on the device (for CUDA, on the GPU target)."""
        key = (row["head_dim"], row["tokens_k"])
        if key not in self.kernels:
            with _disable_current_modes():  # the CPU's choice is asked of PyTorch on real tensors
                self.kernels[key] = kernel_choice.sdpa_choice(self.dtype, *key, self.device, self.gpu)
        return self.kernels[key]


@functools.lru_cache(maxsize=1)
def fake_mode():
    """The one FakeTensorMode of the process: a model's parts (a U-Net and its ControlNet) must share a mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@functools.lru_cache(maxsize=8)
def fake_part(model: str, which: str, dtype: str) -> torch.nn.Module:
    """A part of a model (workload.Workload.make_part) with fake weights, built once per process: each meta
    parameter wrapped as a fake CPU tensor (what a fake tensor is inside), three times faster than to_empty's
    empty_like per parameter. IP-Adapter's projections, made on first use, stay with it."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = Workload(model).make_part(which, "meta", "cpu", dtype)
    mode, cpu = fake_mode(), torch.device("cpu")
    with mode:
        return meta._apply(lambda t: FakeTensor(mode, t, cpu))


def fake_model(model: str, dtype: str, settings: tuple = ()) -> tuple[Workload, torch.nn.Module]:
    """(the workload, the model under test with fake weights) of a cell."""
    w = Workload(model, settings)
    return w, w.build(lambda which: fake_part(model, which, w.dtype(dtype)))


_WALKS: dict[tuple, dict] = {}  # the ops of the forwards traced with ops=True, by shape: the last 64


def walk(model: str, width: int, height: int, batch: int = 1, dtype: str = "float16", settings: tuple = ()) -> dict:
    """The forward's ops on fake tensors (the time model's input, planner/timing.py): {"rows": the attention calls
    (recorder rows), "blocks": each call's block, "calls": per call an array of its own ops' (FLOPs, bytes moved,
    bytes of the largest new output, class: OP_CLASSES), the attention core left out, "rest": the same for every op
    outside attention calls, "at": where each call began among the rest's ops (the forward's order), "dtype": what
    the model computes in (an upcast VAE: float32)}. From the trace that a sweep's
    preflight or a plan made of this shape already, else from a trace of its own."""
    key = _walk_key(model, width, height, batch, dtype, settings)
    if key not in _WALKS:
        trace(model, width, height, batch, dtype, "cpu", [], ops=True, settings=tuple(settings))
    return _WALKS[key]


def _walk_key(model: str, width: int, height: int, batch: int, dtype, settings) -> tuple:
    """What a walk (_WALKS) is kept by: the forward's shape, dtype and settings."""
    return model, width, height, batch, parse_dtype(dtype), tuple(sorted(settings))


def _remember_walk(shape: tuple, tr: _Trace) -> None:
    _WALKS.pop(shape, None)
    _WALKS[shape] = {"rows": [{k: v for k, v in row.items() if k not in ("pass_index", "sdpa_kernel", "device")}
                              for row, _, _ in tr.calls],
                     "blocks": [row["block"] for row, _, _ in tr.calls],
                     "calls": [np.array(c, float).reshape(-1, 4) for c in tr.counter.calls],
                     "rest": np.array(tr.counter.rest, float).reshape(-1, 4),
                     "at": list(tr.counter.at), "dtype": tr.dtype}
    while len(_WALKS) > 64:
        _WALKS.pop(next(iter(_WALKS)))


def trace(model: str, width: int, height: int, batch: int = 1, dtype: str = "float16", device: str = "cuda",
          names: list[str] | None = None, options: dict[str, dict] | None = None, moments: bool = False,
          gpu: kernel_choice.GpuTarget | None = None, settings: tuple = (), ops: bool = False) -> dict:
    """_trace's figures for every backend asked; a processor map (attention/mix.py) among them is traced as its
    backends are (in the same forward where they take the same options, else in one of its own) and its figures
    are mixed_peak's of its blocks' backends, "how" saying so."""
    names = names if names is not None else backends.names()
    options = options or {}
    maps = {n: backends.check_options(n, options.get(n, {}))["map"] for n in names if mix.is_map(n)}
    plain = {n: options.get(n, {}) for n in names if n not in maps}
    alone = {n for n, text in maps.items() if any(p in plain and backends.check_options(p, plain[p]) != o
                                                  for p, o in mix.parts(text).items())}
    for n in set(maps) - alone:
        plain.update(mix.parts(maps[n]))
    shape = (model, width, height, batch, dtype, device)
    out = _remembered(*shape, list(plain), plain, moments, gpu, settings, ops)
    for n, text in maps.items():
        parts = mix.parts(text)
        source = _remembered(*shape, list(parts), parts, False, gpu, settings) if n in alone else out
        if all(p in source["backends"] for p in parts):  # else a backend of it does not run on this device
            choice = {r["block"]: mix.of_block(text, r["block"])[0] for r in source["rows"]}
            out["backends"][n] = {**mixed_peak(source, choice), "how": "mixed"}
            for row, own in zip(out["rows"], source["rows"]):
                row["traced_peak_bytes"][n] = own["traced_peak_bytes"][choice[own["block"]]]
    return out


_TRACES: dict[tuple, tuple] = {}  # the last 16 traces of the process, by what they were asked


def _remembered(model, width, height, batch, dtype, device, names, options, moments, gpu, settings, ops=False) -> dict:
    """_trace's figures, traced once per process for the same question (a copy each time): `fit` of several backends
    and the time model's calibration ask one shape again (`fit --pipeline tiny-sd15 --budget 256MiB` of sdpa and
    naive asked 24 traces, 4 of them again). A backend registered anew (a plugin's) is a new question."""
    import copy
    import json

    registered = tuple(backends.BACKENDS.get(n) for n in names)
    key = (model, width, height, batch, str(dtype), device, tuple(names), json.dumps(options, sort_keys=True,
           default=str), moments, gpu, tuple(sorted(settings)), ops, tuple(map(id, registered)))
    walk = _walk_key(model, width, height, batch, dtype, settings)
    if key not in _TRACES:
        out = _trace(model, width, height, batch, dtype, device, names, options, moments, gpu, settings, ops)
        # the registrations kept with it: while the entry lives, no other object takes their ids
        _TRACES[key] = (out, _WALKS.get(walk) if ops else None, registered)
        while len(_TRACES) > 16:
            _TRACES.pop(next(iter(_TRACES)))
    out, ops_walk, _ = _TRACES[key]
    if ops_walk is not None and walk not in _WALKS:  # walk() reads it: kept while the trace is
        _WALKS[walk] = ops_walk
    return copy.deepcopy(out)


def mixed_peak(traced: dict, choice: dict[str, str]) -> dict:
    """The forward's peak with one backend per block (choice: block -> a backend that `traced`, trace()'s output,
    holds): weights and inputs, and the larger of the peak outside attention calls and, over the calls, the bytes
    alive when the call began plus its block's backend's transient. The rest of the forward does not depend on the
    backends: every processor returns the same output and frees what it made."""
    transient = max([traced["outside_peak_bytes"]] + [r["live_at_start_bytes"] + r["traced_peak_bytes"][
        choice[r["block"]]] for r in traced["rows"]])
    return {"transient_peak_bytes": transient,
            "predicted_forward_peak_bytes": traced["weights_bytes"] + traced["inputs_bytes"] + transient}


def _trace(model: str, width: int, height: int, batch: int = 1, dtype: str = "float16", device: str = "cuda",
           names: list[str] | None = None, options: dict[str, dict] | None = None, moments: bool = False,
           gpu: kernel_choice.GpuTarget | None = None, settings: tuple = (), ops: bool = False) -> dict:
    """The forward's peak memory under each backend, on `device` ('cuda' or 'cpu'; for CUDA, the kernels that the
    GPU target `gpu` runs: default kernel_choice.gpu_target()), of the model with its settings (spec.SETTINGS).
    Returns {"rows": the attention calls (recorder rows, each with traced_peak_bytes per backend and sdpa_kernel:
    what SDPA runs for it), "weights_bytes", "inputs_bytes", "outside_peak_bytes", "backends": {name:
    {"transient_peak_bytes", "predicted_forward_peak_bytes", "how"}}}; a backend that cannot run on the device is
    left out of "backends". With moments, also "moments": the bytes alive after each op outside attention calls.
    With ops, every op is counted in the same forward too, for walk() (the time model) to read."""
    names = names if names is not None else backends.names()
    options = {n: backends.check_options(n, (options or {}).get(n, {})) for n in names}
    shape = _walk_key(model, width, height, batch, dtype, settings)
    w, module = fake_model(model, parse_dtype(dtype), settings)
    dtype = w.dtype(parse_dtype(dtype))  # what the model computes in (an upcast VAE: float32)
    how = {n: how_traced(n, device, dtype) for n in names}
    gpu = (gpu or kernel_choice.gpu_target()) if device == "cuda" else None
    with fake_mode(), torch.no_grad(), w.applied(module):
        processors = {n: (None if h.startswith("memory model") else
                          _FusedOp(h, dtype, gpu, _dispatcher(n)) if h in ("flash", "efficient", "cudnn", "sdpa") else
                          backends.make_processor(n, **options[n])) for n, h in how.items() if h is not None}
        tr = _Trace(dtype, processors, options, device, gpu)
        inputs = w.inputs(module, batch, width, height)
        held = [*module.parameters(), *module.buffers(),
                *(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))]
        weights = models.weights_bytes(module)
        tensors = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_leaves(inputs)
                   if isinstance(t, torch.Tensor)}
        tr.live = LiveBytes(held, device)
        tr.live.moments = [] if moments else None
        tr.counter = OpCount() if ops else None
        with Recorder(module, processor=lambda: _EveryBackend(tr)) as rec, tr.live, tr.counter or nullcontext():
            tr.recorder = rec
            w.forward(module, inputs)
            tr.outside = max(tr.outside, tr.live.peak)
        del inputs, held
    if ops:
        _remember_walk(shape, tr)
    out = {"weights_bytes": weights, "inputs_bytes": sum(tensors.values()), "outside_peak_bytes": tr.outside,
           "rows": [], "backends": {}, "moments": tr.live.moments}
    for row, start, key in tr.calls:
        out["rows"].append({**{k: v for k, v in row.items() if k != "pass_index"}, "live_at_start_bytes": start,
                            "traced_peak_bytes": dict(tr.transient[key])})
    for name in processors:
        transient = max([tr.outside] + [start + tr.transient[key][name] for _, start, key in tr.calls])
        chunked = how[name] == "processor" and name in tr.modelled
        how_here = f"memory model; its processor failed on fake tensors ({tr.failed[name]})" if name in tr.failed \
            else "processor, chunks" if chunked else how[name]
        if how_here == "sdpa":
            counts = Counter(row["sdpa_kernel"] for row, _, _ in tr.calls)
            how_here = "sdpa: " + ", ".join(f"{k} for {n} calls" for k, n in counts.items())
        out["backends"][name] = {"transient_peak_bytes": transient, "how": how_here,
                                 "predicted_forward_peak_bytes": weights + out["inputs_bytes"] + transient}
    return out
