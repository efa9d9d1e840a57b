"""Timers and memory probes for one attention call, on CUDA and on the CPU, and NVML sampling.

Timing passes and the probe pass are separate forwards: timing stays free of profiler overhead.
- time: CUDA events around each call, read after the forward; on the CPU a host clock (CPU ops are synchronous).
- memory per call: on CUDA the allocator peak, reset at the start of the call, minus what was allocated then; on the
  CPU the allocation timeline of torch.profiler (every alloc and free, in order) summed within the call's window.
- kernel: the attention ops that ran inside the call's window of the probe pass's profiler trace.
"""
from __future__ import annotations

import re
import statistics
import threading
import time
from contextlib import contextmanager

import torch

NOISY_IQR_OVER_MEDIAN = 0.1
# the attention ops worth naming: SDPA's concrete kernels (not the dispatcher), matmuls of chunked code, extensions
_KERNEL_OPS = re.compile(r"scaled_dot_product_(?!attention$)|baddbmm|^aten::bmm$|^aten::einsum$|xformers|flash_attn"
                         r"|fmha|cudnn")


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
    """`around` for timing passes: appends each call's elapsed ms to row-keyed sample lists."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.cuda = device.type == "cuda"
        self.clock = clock
        self._pending: list[tuple[int, object, object]] = []
        self.samples: dict[int, list[float]] = {}

    def __call__(self, row: dict, call):
        key = row["call_index"]
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call()
            end.record()
            self._pending.append((key, start, end))
        else:
            t0 = self.clock()
            out = call()
            self.samples.setdefault(key, []).append((self.clock() - t0) * 1e3)
        return out

    def collect(self) -> None:
        """After each forward: read the CUDA events (one synchronize)."""
        if self._pending:
            torch.cuda.synchronize()
            for key, start, end in self._pending:
                self.samples.setdefault(key, []).append(start.elapsed_time(end))
            self._pending.clear()


class CallProbe:
    """`around` for the probe pass: marks each call for the profiler trace and, on CUDA, reads allocator peaks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak: dict[int, int] = {}

    def __call__(self, row: dict, call):
        key = row["call_index"]
        with torch.profiler.record_function(f"attnprof.call.{key}"):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                out = call()
                self.peak[key] = torch.cuda.max_memory_allocated() - start
            else:
                out = call()
        return out


@contextmanager
def traced(device: torch.device):
    """torch.profiler over a block; on the CPU with the allocation timeline."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=device.type == "cpu",
                                record_shapes=True) as prof:
        yield prof


def trace_windows(prof) -> tuple[dict[int, dict], int]:
    """Per call ({call_index: {"peak_mem_bytes", "kernel"}}) and the whole traced block's CPU peak, from the
    profiler's raw events: memory events are summed in time order (alloc +, free -) within each call's window."""
    events = list(prof.profiler.kineto_results.events())
    windows = []
    for e in events:
        name = e.name()
        if name.startswith("attnprof.call."):
            windows.append((int(name.rsplit(".", 1)[1]), e.start_ns(), e.end_ns()))
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    ops = sorted((e.start_ns(), e.name()) for e in events if _KERNEL_OPS.search(e.name()))
    out = {}
    for key, start, end in windows:
        running = peak = 0
        for ts, nbytes in mem:
            if start <= ts <= end:
                running += nbytes
                peak = max(peak, running)
        names = []
        for ts, name in ops:
            if start <= ts <= end and name not in names:
                names.append(name)
        out[key] = {"peak_mem_bytes": peak, "kernel": ",".join(names)}
    running = whole = 0
    for _, nbytes in mem:
        running += nbytes
        whole = max(whole, running)
    return out, whole


def cpu_peak_bytes(fn) -> tuple[object, int]:
    """Run fn() once under the allocation trace; return its result and its transient CPU peak in bytes."""
    with traced(torch.device("cpu")) as prof:
        result = fn()
    return result, trace_windows(prof)[1]


class NvmlSampler:
    """Samples device memory used and this process's memory in a background thread while the block runs.
    On a machine without an NVIDIA driver, `result()` says NVML is unavailable and why."""

    def __init__(self, device: torch.device, interval_s: float = 0.01):
        self.device, self.interval_s = device, interval_s
        self.status, self.samples = "unavailable", 0
        self.device_used_max = self.process_used_max = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.device.type != "cuda":
            self.status = "unavailable: not a CUDA device"
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._pynvml = pynvml
        except Exception as e:  # pynvml raises NVMLError subclasses, ImportError or OSError without a driver
            self.status = f"unavailable: {type(e).__name__}: {e}"
            return self
        self.status = "ok"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        import os

        nv, pid = self._pynvml, os.getpid()
        while not self._stop.is_set():
            used = nv.nvmlDeviceGetMemoryInfo(self._handle).used
            mine = sum(p.usedGpuMemory or 0 for p in nv.nvmlDeviceGetComputeRunningProcesses(self._handle)
                       if p.pid == pid)
            self.device_used_max = max(self.device_used_max or 0, used)
            self.process_used_max = max(self.process_used_max or 0, mine)
            self.samples += 1
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc):
        if self._thread:
            self._stop.set()
            self._thread.join()
        return False

    def result(self) -> dict:
        return {"nvml_status": self.status, "nvml_samples": self.samples,
                "nvml_device_used_max_bytes": self.device_used_max,
                "nvml_process_used_max_bytes": self.process_used_max}
