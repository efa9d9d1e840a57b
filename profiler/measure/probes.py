"""Timers and memory probes for one attention call, and NVML sampling. The device-specific calls they make live in
devices.py; this module only decides when to make them.

Timing passes and the probe pass are separate forwards: timing stays free of profiler overhead.
- time: an interval per call (CUDA events on the device's stream, read after the forward; a host clock on the CPU).
- memory per call: on CUDA the allocator peak, reset at the start of the call, minus what was allocated then; on the
  CPU the allocation timeline of torch.profiler (every alloc and free, in order) summed within the call's window.
- kernel: the attention ops that ran inside the call's window of the probe pass's profiler trace; on CUDA also the
  GPU kernels, credited to the call whose CPU op launched them (through the profiler's correlation ids, since a GPU
  kernel runs after its launch and may run inside the next call's window).
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import torch

from .. import devices

NOISY_IQR_OVER_MEDIAN = 0.1
# the GPU kernels of the backends beside SDPA's, by backend: FlexAttention compiled (a Triton template kernel: in
# an attention call nothing else is compiled), SageAttention's CUDA kernels (qk_int_sv_f16_attn_kernel, ...; not its
# CPU-side op sageattention::qk_int8_sv_...), FlashAttention 3 (cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>)
BACKEND_KERNELS = {"flex": re.compile(r"triton_tem_fused"), "sage": re.compile(r"(?<!::)qk_int8?_sv_f"),
                   "flash-attn-3": re.compile(r"cutlass::device_kernel<flash::")}
# the attention ops worth naming: SDPA's concrete kernels (not the dispatcher), matmuls of chunked code, extensions,
# a compiled region (on the CPU, FlexAttention's kernel), and the GPU kernels above
_KERNEL_OPS = re.compile(r"scaled_dot_product_(?!attention$)|baddbmm|^aten::bmm$|^aten::einsum$|xformers|flash_attn"
                         r"|flash_fwd|fmha|cudnn|cutlass.*[Aa]ttention|^Torch-Compiled Region"
                         + "".join(f"|{k.pattern}" for k in BACKEND_KERNELS.values()))
_CPU, _CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def summarize(samples_ms: list[float]) -> dict:
    """Median, IQR and the noisy flag (IQR / median > 0.1, as torch.utils.benchmark warns)."""
    if not samples_ms:
        return {"time_ms": float("nan"), "iqr_ms": float("nan"), "noisy": False}
    med = statistics.median(samples_ms)
    if len(samples_ms) >= 2:
        q = statistics.quantiles(samples_ms, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {"time_ms": med, "iqr_ms": iqr, "noisy": bool(med > 0 and iqr / med > NOISY_IQR_OVER_MEDIAN)}


class CallTimer:
    """The one meter of attention calls: the `around` of a Recorder (before(row) as a call begins, after(row) as it
    ends: the recorder's hooks on each Attention module) or of one call (timer(row, call)).

    - time: an interval per call on the device's clock (CUDA events on its stream, a host clock on the CPU), read by
      collect() after one synchronize into sample lists keyed by the row's `key` field (`samples`);
    - with peaks, where the device's allocator counts (CUDA): the call's allocator peak over what was allocated when
      it began (`peak`), read from the allocator's statistics (no synchronize needed);
    - with ranges: a profiler range per call named by its block (or name(row)); `ranges` maps the names back to
      keys, so that a Chrome / Perfetto trace of the pass shows each call and its kernels can be credited to it;
    - with sync: a synchronize before each call, so that it starts on an idle device (the probe pass, whose call
      times are set beside the GPU time of the same call's kernels);
    - with faults, where the device's pages are the host's (the CPU): the bytes of new pages the process touched
      during the call (`faulted`: its minor faults, devices.Cpu.faulted_bytes), read outside its interval.
    key: call_index (a call's place in one forward, whose samples are the forwards), or any field unique per call."""

    def __init__(self, device: devices.Cpu | devices.Cuda, clock=time.perf_counter, peaks: bool = False,
                 ranges: bool = False, sync: bool = False, key: str = "call_index", name=None, faults: bool = False):
        self.device, self.clock, self.key, self.name = device, clock, key, name or (lambda row: row["block"])
        self.peaks, self.sync, self.named = peaks and device.allocator, sync, ranges
        self.faults = faults and device.faulted_bytes() is not None
        self._pending: list[tuple[object, object]] = []
        self._open: dict = {}
        self.samples: dict = {}
        self.peak: dict = {}
        self.faulted: dict = {}
        self.ranges: dict[str, object] = {}

    def before(self, row: dict) -> None:
        key, dev, opened = row[self.key], self.device, {}
        if self.named:
            name = self.name(row)
            name = name if name not in self.ranges else f"{name} (call {key})"
            self.ranges[name] = key
            opened["range"] = torch.profiler.record_function(name)
            opened["range"].__enter__()
        if self.sync:
            dev.synchronize()
        if self.peaks:
            dev.reset_peak()
            opened["start"] = dev.allocated()
        if self.faults:
            opened["faulted"] = dev.faulted_bytes()
        opened["interval"] = dev.interval(self.clock)
        self._open[key] = opened
        opened["interval"].start()

    def after(self, row: dict) -> None:
        key = row[self.key]
        opened = self._open.pop(key)
        opened["interval"].stop()
        self._pending.append((key, opened["interval"]))
        if self.peaks:
            self.peak[key] = self.device.peak_allocated() - opened["start"]
        if self.faults:
            self.faulted[key] = self.device.faulted_bytes() - opened["faulted"]
        if "range" in opened:
            opened["range"].__exit__(None, None, None)

    def __call__(self, row: dict, call):
        self.before(row)
        try:
            return call()
        finally:
            self.after(row)

    def collect(self) -> None:
        """After each forward (or once at the end): one synchronize of the device, then every interval read."""
        self.device.synchronize()
        for key, interval in self._pending:
            self.samples.setdefault(key, []).append(interval.ms())
        self._pending.clear()


def CallProbe(device: devices.Cpu | devices.Cuda) -> CallTimer:  # noqa: N802 (the probe pass's meter)
    """The probe pass's meter: each call a named range of the trace, started on an idle device, with its allocator
    peak where the device counts one; its times (collect(), then samples) are of the same pass as the trace's GPU
    kernel times."""
    return CallTimer(device, peaks=True, ranges=True, sync=device.allocator)


@contextmanager
def quiet_native_stderr():
    """Kineto prints 'USDT: ... profiler_start' / 'profiler_stop' on file descriptor 2 from C++, past sys.stderr:
    catch fd 2 while the profiler starts or stops, and pass on every other line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            rest = [ln for ln in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


@contextmanager
def traced(device: devices.Cpu | devices.Cuda, memory: bool | None = None):
    """torch.profiler over a block: on the CPU with the allocation timeline, on CUDA with the GPU's kernels (and its
    allocation timeline too with memory=True: a compiled forward has no call boundary to read the allocator at)."""
    prof = torch.profiler.profile(activities=device.profiler_activities(), record_shapes=True,
                                  profile_memory=device.profile_memory if memory is None else memory)
    with quiet_native_stderr():
        prof.__enter__()
    try:
        yield prof
        device.synchronize()  # every kernel of the block has ended before the trace is collected
    finally:
        with quiet_native_stderr():
            prof.__exit__(None, None, None)


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


def _short(name: str) -> str:
    """A GPU kernel's name without its template arguments and signature; a generic CUTLASS wrapper keeps its first
    template argument (FlashAttention 3: cutlass::device_kernel<flash::...>)."""
    name = name.removeprefix("void ").strip()
    wrapped = re.match(r"(cutlass::device_kernel)<\s*([\w:]+)", name)
    if wrapped:
        return f"{wrapped.group(1)}<{wrapped.group(2)}>"
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name


def trace_windows(prof, ranges: dict[str, int]) -> tuple[dict[int, dict], int]:
    """Per call ({call_index: {"peak_mem_bytes", "kernel", "gpu_kernels", "sdpa_kernel", "gpu_time_ms"}}) and the
    whole traced block's CPU peak, from the profiler's raw events; `ranges` names each call's range (CallProbe's).
    Memory events are summed in time order (alloc +, free -) within each call's window. CPU ops are credited to the
    window they ran in; GPU kernels to the window of the CPU op that launched them."""
    return attribute(list(prof.profiler.kineto_results.events()), ranges)


def attribute(events, ranges: dict[str, int]) -> tuple[dict[int, dict], int]:
    """trace_windows on a list of kineto events (name, start_ns, end_ns, device_type, correlation_id,
    linked_correlation_id, nbytes), separate so that tests can hand it events whose GPU times overlap.

    Per call: kernel, the attention ops and GPU kernels that ran (short names); gpu_kernels, only the GPU kernels
    (CUDA-device events) that name an SDPA kernel or match the attention ops; sdpa_kernel, what those GPU kernels
    show (sdpa_kernel()), or on the CPU what its ops show; gpu_time_ms, the summed duration of every GPU kernel
    the call launched (None where none ran: the CPU)."""
    windows = [(ranges[e.name()], e.start_ns(), e.end_ns()) for e in events
               if e.device_type() == _CPU and e.name() in ranges]
    timeline = _timeline(events, skip=ranges)
    out = {key: _window(start, end, *timeline) for key, start, end in windows}
    return out, _peak(timeline[2])


def _timeline(events, skip=(), memory=_CPU) -> tuple[list, list, list]:
    """(the attention ops by start, the GPU kernels by when their launching op ran, the memory events of the
    `memory` device by time: (ns, +alloc / -free bytes)); events named in `skip` are none of these."""
    ops, gpu, mem, launched_at = [], [], [], {}
    for e in events:
        if e.device_type() == _CPU and e.linked_correlation_id() == 0:
            launched_at[e.correlation_id()] = e.start_ns()
    for e in events:
        name, dtype = e.name(), e.device_type()
        if name in skip:
            continue
        if name == "[memory]":
            if dtype == memory:
                mem.append((e.start_ns(), e.nbytes()))
        elif dtype == _CUDA and e.linked_correlation_id() and e.linked_correlation_id() in launched_at:
            # a GPU kernel (or copy), credited to when its launching op ran; a GPU range (linked to nothing) is not
            gpu.append((launched_at[e.linked_correlation_id()], name, (e.end_ns() - e.start_ns()) / 1e6))
        elif dtype == _CPU and _KERNEL_OPS.search(name):
            ops.append((e.start_ns(), re.sub(r": \d+/\d+$", "", name)))  # a compiled region without its frame id
    return sorted(ops), sorted(gpu), sorted(mem)


def _window(start: int, end: int, ops: list, gpu: list, mem: list) -> dict:
    """What ran from start to end (ns): the transient peak of its allocations, the attention ops and kernels."""
    peak = _peak([m for m in mem if start <= m[0] <= end])
    cpu_names = [name for ts, name in ops if start <= ts <= end]
    launched = [(name, ms) for ts, name, ms in gpu if start <= ts <= end]
    attention = [name for name, _ in launched if _KERNEL_OPS.search(name) or sdpa_kernel([name])]
    names = list(dict.fromkeys(cpu_names + [_short(n) for n in attention]))
    return {"peak_mem_bytes": peak, "kernel": ",".join(names),
            "gpu_kernels": list(dict.fromkeys(_short(n) for n in attention)),
            "sdpa_kernel": sdpa_kernel(attention) if launched else sdpa_kernel(cpu_names),
            "gpu_time_ms": sum(ms for _, ms in launched) if launched else None}


def _peak(mem: list) -> int:
    running = peak = 0
    for _, nbytes in mem:
        running += nbytes
        peak = max(peak, running)
    return peak


# The one op that is a backend's whole attention, where there is one: the op a compiled graph keeps as it is (an
# extern call of Inductor's), so that its events in the trace are the calls. SDPA's concrete kernels (not the
# dispatcher aten::scaled_dot_product_attention), xformers' and flash-attn's custom ops. The others' attention is
# several ops (naive: baddbmm, softmax, bmm) that Inductor fuses with what is around them.
ATTENTION_OPS = {"sdpa": re.compile(r"^aten::_scaled_dot_product_(?!attention$)"),
                 "xformers": re.compile(r"^xformers(_flash)?::"), "flash-attn": re.compile(r"^flash_attn(_3)?::")}


def attention_op(backend: str) -> re.Pattern | None:
    """The pattern of the op that is the backend's whole attention (ATTENTION_OPS), or None where there is none."""
    from ..attention import backends

    if backends.uses_sdpa(backend):
        return ATTENTION_OPS["sdpa"]
    return ATTENTION_OPS.get("flash-attn" if backend.startswith("flash-attn") else backend)


def op_calls(events, pattern: re.Pattern, memory=_CPU) -> list[dict]:
    """The events of a trace that match the attention op's pattern, outermost only (an op that runs another of
    them counts once), in the order they began: per op its name, input shapes, time (the op's own on the CPU, the
    GPU kernels it launched on CUDA: time_ms) and what ran inside it (_window: the peak of the `memory` device's
    allocations within the op, its kernels)."""
    found = sorted((e for e in events if e.device_type() == _CPU and pattern.search(e.name())),
                   key=lambda e: (e.start_ns(), -e.end_ns()))
    timeline = _timeline(events, memory=memory)
    out, end = [], -1
    for e in found:
        if e.start_ns() < end:  # inside the op before it
            continue
        end = e.end_ns()
        inside = _window(e.start_ns(), e.end_ns(), *timeline)
        own = (e.end_ns() - e.start_ns()) / 1e6
        out.append({"name": e.name(), "shapes": [list(s) for s in e.shapes()], **inside,
                    "time_ms": inside["gpu_time_ms"] if inside["gpu_time_ms"] is not None else own})
    return out


def cpu_peak_bytes(fn) -> tuple[object, int]:
    """Run fn() once under the allocation trace; return its result and its transient CPU peak in bytes."""
    with traced(devices.get("cpu")) as prof:
        result = fn()
    return result, trace_windows(prof, {})[1]


class NvmlSampler:
    """Samples the device's used memory and this process's memory in a background thread while the block runs.
    The NVML device is found by UUID / PCI bus id (devices.nvml_handle). Without a driver, `result()` says NVML is
    unavailable and why; an NVML error in the thread ends sampling and is reported in nvml_status. Inside a
    container NVML lists host pids: where no listed process has this pid, process memory is None (unknown), not 0."""

    def __init__(self, device: devices.Cpu | devices.Cuda, interval_s: float = 0.01, nvml=None):
        self.device, self.interval_s, self._nvml = device, interval_s, nvml
        self.status, self.samples = "unavailable", 0
        self.device_used_max = self.process_used_max = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if not isinstance(self.device, devices.Cuda):
            self.status = "unavailable: not a CUDA device"
            return self
        try:
            nvml = self._nvml or devices.nvml_module()
            self._handle = devices.nvml_handle(nvml, self.device.torch.index)
        except Exception as e:  # ImportError or OSError without a driver, NVMLError, LookupError
            self.status = f"unavailable: {type(e).__name__}: {e}"
            return self
        self._nvml, self.status = nvml, "ok"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        nv, pid = self._nvml, os.getpid()
        used = nv.nvmlDeviceGetMemoryInfo(self._handle).used
        mine = [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(self._handle) if p.pid == pid]
        self.device_used_max = max(self.device_used_max or 0, used)
        if mine and all(m is not None for m in mine):
            self.process_used_max = max(self.process_used_max or 0, sum(mine))
        self.samples += 1

    def _run(self):
        try:
            while not self._stop.is_set():
                self.sample()
                self._stop.wait(self.interval_s)
        except Exception as e:  # NVMLError and friends: stop sampling, and say so in the row
            self.status = f"error after {self.samples} samples: {type(e).__name__}: {e}"

    def __exit__(self, *exc):
        if self._thread:
            self._stop.set()
            self._thread.join()
        return False

    def result(self) -> dict:
        status = self.status
        if status == "ok" and self.samples and self.process_used_max is None:
            status = "ok; process memory unknown: NVML lists no process with this pid (a container's pid namespace)"
        return {"nvml_status": status, "nvml_samples": self.samples,
                "nvml_device_used_max_bytes": self.device_used_max,
                "nvml_process_used_max_bytes": self.process_used_max}
