"""Timers and memory probes for one attention call, and NVML sampling. The device-specific calls they make live in
devices.py; this module only decides when to make them.

Timing passes and the probe pass are separate forwards: timing stays free of profiler overhead.
- time: an interval per call (CUDA events on the device's stream, read after the forward; a host clock on the CPU).
- memory per call: on CUDA the allocator peak, reset at the start of the call, minus what was allocated then; on the
  CPU the allocation timeline of torch.profiler (every alloc and free, in order) summed within the call's window.
- kernel: the attention ops that ran inside the call's window of the probe pass's profiler trace; on CUDA also the
  GPU kernels, credited to the call whose CPU op launched them (trace.py reads the trace).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import torch

from .. import devices

NOISY_IQR_OVER_MEDIAN = 0.1


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

    - time, by its meter: "device", an interval per call on the device's clock (CUDA events on its stream, a host
      clock on the CPU); "host", the host's clock on every device (on CUDA the host's own time in the call: its
      Python and launches, no events recorded); "graph", CUDA events made to be recorded as nodes of a CUDA graph
      being captured, read after each replay (read_graph); "none", no clock (ranges, peaks or faults only). Read by
      collect() after one synchronize into sample lists keyed by the row's `key` field (`samples`);
    - with peaks, where the device's allocator counts (CUDA): the call's allocator peak over what was allocated when
      it began (`peak`), read from the allocator's statistics (no synchronize needed);
    - with ranges: a profiler range per call named by its block (or name(row)); `ranges` maps the names back to
      keys, so that a Chrome / Perfetto trace of the pass shows each call and its kernels can be credited to it;
    - with sync: a synchronize before each call, so that it starts on an idle device (the probe pass: each call's
      allocator peak is its own);
    - with faults, where the device's pages are the host's (the CPU): the bytes of new pages the process touched
      during the call (`faulted`: its minor faults, devices.Cpu.faulted_bytes), read outside its interval.
    key: call_index (a call's place in one forward, whose samples are the forwards), or any field unique per call."""

    def __init__(self, device: devices.Cpu | devices.Cuda, clock=time.perf_counter, peaks: bool = False,
                 ranges: bool = False, sync: bool = False, key: str = "call_index", name=None, faults: bool = False,
                 meter: str = "device"):
        if meter not in ("device", "host", "graph", "none"):
            raise ValueError(f"meter {meter!r} is not device, host, graph or none")
        self.device, self.clock, self.key, self.name = device, clock, key, name or (lambda row: row["block"])
        self.meter = meter
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
        self._open[key] = opened
        if self.meter != "none":
            opened["interval"] = devices.HostInterval(self.clock) if self.meter == "host" else \
                dev.interval(self.clock, external=self.meter == "graph")
            opened["interval"].start()

    def after(self, row: dict) -> None:
        key = row[self.key]
        opened = self._open.pop(key)
        if "interval" in opened:
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
        self.read_graph()
        self._pending.clear()

    def read_graph(self) -> None:
        """After each replay of a CUDA graph captured with meter "graph": one synchronize, then every call's events
        (the graph records them anew at each replay) read into samples; the intervals kept for the next replay."""
        self.device.synchronize()
        for key, interval in self._pending:
            self.samples.setdefault(key, []).append(interval.ms())


class ProjectionClock:
    """Each attention call's projections timed on the host clock its own time is on (the CPU's: a call's time and
    its projections' on one clock): a forward pre-hook and hook on each projection module of its attention modules
    (recorder.projection_modules: to_q, to_k, to_v, to_out[0], the added-KV ones, CLIP's q/k/v/out_proj), their
    time added to the call open around them: `ms`, by the call's key. The call's meter says which call is open
    (opened(key) as it begins, closed() as it ends). The hooks' own cost (a clock read each side) falls in the call's
    time outside its projections: within the noise of `python -m profiler.bench --only profile` (docs/measuring.md)."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.ms = clock, {}
        self._open: list = []
        self._started: list[float] = []

    def hook(self, projections, stack) -> None:
        """Hooks on each of these projection modules, each removed when the ExitStack closes."""
        for proj in projections:
            stack.callback(proj.register_forward_pre_hook(self._begin).remove)
            stack.callback(proj.register_forward_hook(self._end, always_call=True).remove)

    def opened(self, key) -> None:
        self._open.append(key)
        self.ms.setdefault(key, 0.0)

    def closed(self) -> None:
        self._open.pop()

    def _begin(self, module, args) -> None:
        self._started.append(self.clock())

    def _end(self, module, args, output) -> None:
        took = self.clock() - self._started.pop()
        if self._open:  # a projection module run outside any recorded call: none of theirs
            self.ms[self._open[-1]] += 1e3 * took


def CallProbe(device: devices.Cpu | devices.Cuda) -> CallTimer:  # noqa: N802 (the probe pass's meter)
    """The probe pass's meter (the memory pass): each call a named range of the trace, started on an idle device,
    with its allocator peak where the device counts one. No clock: a synchronize per call serialises the host into
    any time taken so, and none is stored."""
    return CallTimer(device, peaks=True, ranges=True, sync=device.allocator, meter="none")


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
def traced(device: devices.Cpu | devices.Cuda, memory: bool | None = None, shapes: bool = True):
    """torch.profiler over a block: on the CPU with the allocation timeline, on CUDA with the GPU's kernels (and its
    allocation timeline too with memory=True: a compiled forward has no call boundary to read the allocator at).
    shapes=False: no input shapes recorded (the kernel-timing forwards: less host work per op)."""
    prof = torch.profiler.profile(activities=device.profiler_activities(), record_shapes=shapes,
                                  profile_memory=device.profile_memory if memory is None else memory)
    with quiet_native_stderr():
        prof.__enter__()
    try:
        yield prof
        device.synchronize()  # every kernel of the block has ended before the trace is collected
    finally:
        with quiet_native_stderr():
            prof.__exit__(None, None, None)


def cpu_peak_bytes(fn) -> tuple[object, int]:
    """Run fn() once under the allocation trace; return its result and its transient CPU peak in bytes."""
    with traced(devices.get("cpu")) as prof:
        result = fn()
    from .trace import trace_windows

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
