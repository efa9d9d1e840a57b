"""Reading a profiler trace: what ran in each attention call, credited to the call that launched it, and on CUDA what
the GPU spent on it (CUPTI's kernel durations). One reader for every pass that traces: the probe pass (memory and
kernel names), the profiled forwards whose kernel times are a call's headline on CUDA (measure/passes.py), a compiled
cell's attention ops (compiled.py) and a trace recorded on a GPU and replayed by a CPU test (save / load).

- A call is a range of the trace (probes.CallTimer's `ranges`: a profiler range per call, named by its block). CPU
  ops are credited to the range they ran in; GPU kernels (and copies) to the range of the CPU op that launched them,
  through the profiler's correlation ids, since a kernel runs after its launch and may run in the next call's range.
- The attention core of a call: the ops that are its attention (CORE_OPS: SDPA's op, baddbmm / softmax / bmm of
  diffusers' naive and sliced processors, an extension's op, the range our own processors put around their core:
  processor.CORE_RANGE), outermost, never inside a projection (aten::linear). Its kernels are `attn_kernel_ms`; the
  call's other kernels (to_q, to_k, to_v, to_out, layout copies) `proj_kernel_ms`. On the CPU, where the ops are the
  work, the core's ops' own time against the rest of the call's range.
- A call's figures per forward (`call_samples`): where a trace holds several forwards, each call's ranges in time
  order, one per forward.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from pathlib import Path

import torch

from ..attention.processor import CORE_RANGE

_CPU, _CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
# the attention ops worth naming: SDPA's concrete kernels (not the dispatcher), matmuls of chunked code, extensions,
# a compiled region (on the CPU, FlexAttention's kernel), and the GPU kernels of the backends beside SDPA's (each
# backend's record: attention/backends.own_kernels)
_KERNEL_OPS = (r"scaled_dot_product_(?!attention$)|baddbmm|^aten::bmm$|^aten::einsum$|xformers|flash_attn"
               r"|flash_fwd|fmha|cudnn|cutlass.*[Aa]ttention|^Torch-Compiled Region")


def kernel_ops() -> re.Pattern:
    """The names of a call's attention ops and kernels (_KERNEL_OPS, with the registered backends' own kernels)."""
    from ..attention import backends

    return re.compile(_KERNEL_OPS + "".join(f"|{k}" for k in backends.own_kernels().values()))


# the CPU ops that are a call's attention core (module docstring); a projection's ops never are
CORE_OPS = re.compile(r"^aten::(scaled_dot_product_attention|_scaled_dot_product\w*|baddbmm|bmm|_?softmax|einsum)$"
                      r"|^xformers|^flash_attn|^sageattention|^Torch-Compiled Region|^" + re.escape(CORE_RANGE) + "$")
PROJECTION_OPS = re.compile(r"^aten::linear$")

# The SDPA kernel a name belongs to, tried in this order so that the patterns exclude each other: cuDNN's kernels
# carry "flash" in their names (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_...), so cuDNN is tried
# first; math is gemms plus a softmax, so a softmax names it only where no fused kernel ran. Aten op names (the CPU
# side of a call: aten::_scaled_dot_product_flash_attention_for_cpu, ..._attention_math) name their kernel too.
SDPA_KERNELS = (("cudnn", re.compile(r"cudnn", re.I)),
                ("efficient", re.compile(r"fmha_cutlass|PyTorchMemEffAttention|efficient_attention", re.I)),
                ("flash", re.compile(r"flash_fwd|pytorch_flash|flash::|flash_attention|FlashAttn", re.I)),
                ("math", re.compile(r"softmax|attention_math", re.I)))


def sdpa_kernel(names) -> str | None:
    """The SDPA kernel that the GPU kernel names of one call show: 'cudnn', 'flash', 'efficient', 'math' or None."""
    names = list(names)
    return next((kernel for kernel, pattern in SDPA_KERNELS if any(pattern.search(n) for n in names)), None)


def short(name: str) -> str:
    """A GPU kernel's name without its template arguments and signature; a generic CUTLASS wrapper keeps its first
    template argument (FlashAttention 3: cutlass::device_kernel<flash::...>)."""
    name = name.removeprefix("void ").strip()
    wrapped = re.match(r"(cutlass::device_kernel)<\s*([\w:]+)", name)
    if wrapped:
        return f"{wrapped.group(1)}<{wrapped.group(2)}>"
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name


def events(prof) -> list:
    """The kineto events of a finished torch.profiler.profile."""
    return list(prof.profiler.kineto_results.events())


class Timeline:
    """A trace's events, sorted once for many windows (bisect, not a scan per call: a K-forward SDXL trace holds
    tens of thousands of kernels for 700 call ranges)."""

    def __init__(self, evs, skip=(), memory=_CPU):
        launched_at, ops, gpu, mem, core, linear = {}, [], [], [], [], []
        self._kernel_ops = kernel_ops()
        for e in evs:
            if e.device_type() == _CPU and e.linked_correlation_id() == 0:
                launched_at[e.correlation_id()] = e.start_ns()
        for e in evs:
            name, dtype = e.name(), e.device_type()
            if name in skip:
                continue
            if name == "[memory]":
                if dtype == memory:
                    mem.append((e.start_ns(), e.nbytes()))
            elif dtype == _CUDA and e.linked_correlation_id() and e.linked_correlation_id() in launched_at:
                # a GPU kernel (or copy), credited to when its launching op ran; a GPU range (linked to nothing) is not
                gpu.append((launched_at[e.linked_correlation_id()], name, (e.end_ns() - e.start_ns()) / 1e6,
                            e.start_ns(), e.end_ns()))
            elif dtype == _CPU:
                if self._kernel_ops.search(name):
                    ops.append((e.start_ns(), re.sub(r": \d+/\d+$", "", name)))  # a compiled region without its id
                if CORE_OPS.search(name):
                    core.append((e.start_ns(), e.end_ns()))
                elif PROJECTION_OPS.search(name):
                    linear.append((e.start_ns(), e.end_ns()))
        self.ops, self.gpu, self.mem = sorted(ops), sorted(gpu), sorted(mem)
        self.core = _outermost(sorted(core), _outermost(sorted(linear), []))
        self._ops_at, self._gpu_at, self._mem_at = ([x[0] for x in v] for v in (self.ops, self.gpu, self.mem))
        self._core_at = [s for s, _ in self.core]

    def _between(self, keys: list, values: list, start: int, end: int) -> list:
        return values[bisect.bisect_left(keys, start):bisect.bisect_right(keys, end)]

    def in_core(self, ts: int) -> bool:
        i = bisect.bisect_right(self._core_at, ts) - 1
        return i >= 0 and self.core[i][0] <= ts <= self.core[i][1]

    def core_ms(self, start: int, end: int) -> float:
        """The CPU time of the core ops that began in [start, end] (their own spans, outermost)."""
        return sum(e - s for s, e in self._between(self._core_at, self.core, start, end)) / 1e6

    def window(self, start: int, end: int) -> dict:
        """What ran from start to end (ns): the transient peak of its allocations, the attention ops and kernels,
        the GPU time of its kernels split into the attention core's and the rest, their span."""
        peak = peak_bytes(self._between(self._mem_at, self.mem, start, end))
        cpu_names = [name for _, name in self._between(self._ops_at, self.ops, start, end)]
        launched = self._between(self._gpu_at, self.gpu, start, end)
        attention = [name for _, name, *_ in launched if self._kernel_ops.search(name) or sdpa_kernel([name])]
        names = list(dict.fromkeys(cpu_names + [short(n) for n in attention]))
        out = {"peak_mem_bytes": peak, "kernel": ",".join(names),
               "gpu_kernels": list(dict.fromkeys(short(n) for n in attention)),
               "sdpa_kernel": sdpa_kernel(attention) if launched else sdpa_kernel(cpu_names)}
        if launched:
            attn = sum(ms for ts, _, ms, *_ in launched if self.in_core(ts))
            total = sum(ms for _, _, ms, *_ in launched)
            span = (max(e for *_, e in launched) - min(s for *_, s, _ in launched)) / 1e6
            return {**out, "gpu_time_ms": total, "attn_kernel_ms": attn, "proj_kernel_ms": total - attn,
                    "gpu_span_ms": span}
        attn = self.core_ms(start, end)  # the CPU: the core's ops against the rest of the call
        return {**out, "gpu_time_ms": None, "attn_kernel_ms": attn,
                "proj_kernel_ms": max(0.0, (end - start) / 1e6 - attn), "gpu_span_ms": None}


def _outermost(spans: list, inside: list) -> list:
    """The spans (sorted by start) that lie in no other span of theirs nor in any of `inside` (sorted, outermost)."""
    out, end = [], -1
    starts = [s for s, _ in inside]
    for s, e in spans:
        i = bisect.bisect_right(starts, s) - 1
        if s < end or (i >= 0 and inside[i][0] <= s and e <= inside[i][1]):
            continue
        out.append((s, e))
        end = e
    return out


def peak_bytes(mem: list) -> int:
    """The highest running total of (ns, +alloc / -free bytes) events in time order."""
    running = peak = 0
    for _, nbytes in mem:
        running += nbytes
        peak = max(peak, running)
    return peak


def _ranges(evs, ranges: dict) -> list[tuple]:
    """(key, start, end) of every range named in `ranges`, in time order."""
    return sorted(((ranges[e.name()], e.start_ns(), e.end_ns()) for e in evs
                   if e.device_type() == _CPU and e.name() in ranges), key=lambda r: r[1])


def attribute(evs, ranges: dict) -> tuple[dict, int]:
    """Per call ({key: Timeline.window}) and the whole trace's CPU peak, from a list of kineto events (name,
    start_ns, end_ns, device_type, correlation_id, linked_correlation_id, nbytes: tests hand it events whose GPU
    times overlap); `ranges` names each call's range. A call ranged twice keeps its last window."""
    timeline = Timeline(evs, skip=ranges)
    return {key: timeline.window(start, end) for key, start, end in _ranges(evs, ranges)}, peak_bytes(timeline.mem)


def trace_windows(prof, ranges: dict) -> tuple[dict, int]:
    """attribute() on a finished profiler's events."""
    return attribute(events(prof), ranges)


def call_samples(evs, ranges: dict) -> dict:
    """Every window of each call in time order ({key: [window, ...]}): a trace of K forwards gives K per call."""
    timeline, out = Timeline(evs, skip=ranges), {}
    for key, start, end in _ranges(evs, ranges):
        out.setdefault(key, []).append(timeline.window(start, end))
    return out


def forward_kernels(evs, name: str) -> list[dict]:
    """Per range called `name` (a whole forward's, in time order), the GPU time of every kernel it launched
    (`gpu_ms`), of those of attention cores (`attn_ms`), and their span: a forward's kernels, hooks or none."""
    timeline = Timeline(evs, skip={name})
    out = []
    for _, start, end in _ranges(evs, {name: 0}):
        w = timeline.window(start, end)
        out.append({"gpu_ms": w["gpu_time_ms"] or 0.0, "attn_ms": w["attn_kernel_ms"] if w["gpu_time_ms"] else 0.0,
                    "span_ms": w["gpu_span_ms"] or 0.0})
    return out


# ---- the one op that is a backend's whole attention, where there is one

# The op a compiled graph keeps as it is (an extern call of Inductor's), so that its events in the trace are the
# calls: SDPA's concrete kernels (not the dispatcher aten::scaled_dot_product_attention), xformers' and flash-attn's
# custom ops (each backend's record: attention/backends.attention_op). The others' attention is several ops (naive:
# baddbmm, softmax, bmm) that Inductor fuses with what is around them.
def attention_op(backend: str) -> re.Pattern | None:
    """The pattern of the op that is the backend's whole attention, or None where there is none."""
    from ..attention import backends

    pattern = backends.attention_op(backend)
    return re.compile(pattern) if pattern else None


def op_calls(evs, pattern: re.Pattern, memory=_CPU) -> list[dict]:
    """The events of a trace that match the attention op's pattern, outermost only (an op that runs another of
    them counts once), in the order they began: per op its name, input shapes, time (the op's own on the CPU, the
    GPU kernels it launched on CUDA: time_ms) and what ran inside it (Timeline.window: the peak of the `memory`
    device's allocations within the op, its kernels)."""
    found = sorted((e for e in evs if e.device_type() == _CPU and pattern.search(e.name())),
                   key=lambda e: (e.start_ns(), -e.end_ns()))
    timeline = Timeline(evs, memory=memory)
    out, end = [], -1
    for e in found:
        if e.start_ns() < end:  # inside the op before it
            continue
        end = e.end_ns()
        inside = timeline.window(e.start_ns(), e.end_ns())
        own = (e.end_ns() - e.start_ns()) / 1e6
        out.append({"name": e.name(), "shapes": [list(s) for s in e.shapes()], **inside,
                    "time_ms": inside["gpu_time_ms"] if inside["gpu_time_ms"] is not None else own})
    return out


# ---- a trace kept to be read again (a GPU run's, replayed by CPU tests)

class Event:
    """A kineto event as the readers above ask it, made from a saved trace's row (or by a test)."""

    __slots__ = ("_v",)

    def __init__(self, name, start, end, device="cpu", corr=0, linked=0, nbytes=0):
        self._v = (name, int(start), int(end), device, int(corr), int(linked), int(nbytes))

    def name(self): return self._v[0]  # noqa: E704
    def start_ns(self): return self._v[1]  # noqa: E704
    def end_ns(self): return self._v[2]  # noqa: E704
    def device_type(self): return _CUDA if self._v[3] == "cuda" else _CPU  # noqa: E704
    def correlation_id(self): return self._v[4]  # noqa: E704
    def linked_correlation_id(self): return self._v[5]  # noqa: E704
    def nbytes(self): return self._v[6]  # noqa: E704
    def shapes(self): return []  # noqa: E704


def save(evs, path: Path, meta: dict | None = None) -> None:
    """The events as gzipped JSON ({"meta", "events": [[name, start, end, device, corr, linked, nbytes], ...]}):
    what the readers above need of them, so that a CPU test can read a GPU's trace again. Names are interned."""
    names: dict[str, int] = {}
    rows = []
    for e in evs:
        i = names.setdefault(e.name(), len(names))
        rows.append([i, e.start_ns(), e.end_ns(), "cuda" if e.device_type() == _CUDA else "cpu",
                     e.correlation_id(), e.linked_correlation_id(), e.nbytes() if e.name() == "[memory]" else 0])
    with gzip.open(path, "wt") as f:
        json.dump({"meta": meta or {}, "names": list(names), "events": rows}, f, separators=(",", ":"))


def load(path: Path) -> tuple[list[Event], dict]:
    """(the events, the meta) of a trace that save() wrote."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    names = data["names"]
    return [Event(names[r[0]], *r[1:]) for r in data["events"]], data["meta"]
