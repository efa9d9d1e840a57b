"""A synthetic GPU on the CPU: the kernel-clock path (devices.Cuda's: kernel time per call from the profiler's trace,
plain forwards apart, host time apart) run on CPU tensors, with GPU kernels written into each trace the profiled
forwards leave. Each op that would launch kernels on a GPU (a leaf aten op that computes: not a view, not an empty)
gets a runtime launch event inside it and a kernel on one stream, starting when both its launch and the kernel before
it are done, lasting what `duration(name, in_core)` says (ns). Kernels are short and launches slow here (a CPU op
takes microseconds to milliseconds): a host-bound forward, as an eager SD U-Net at batch 1 on an H200 is."""
from __future__ import annotations

import re

from profiler import devices
from profiler.measure import passes, replay, state, trace
from profiler.record import session

VIEWS = re.compile(r"^aten::(view|reshape|_reshape_alias|transpose|permute|expand|as_strided|empty|empty_like|"
                   r"empty_strided|t|unsqueeze|squeeze|slice|select|detach|alias|_unsafe_view|unflatten|flatten|"
                   r"lift_fresh|resolve_conj|resolve_neg|split|chunk|narrow|contiguous|numpy_T|chunk|unbind|"
                   r"split_with_sizes|to|_to_copy|item|_local_scalar_dense|is_nonzero|size|stride|result_type)$")


class FakeGpu(devices.Cpu):
    """The CPU, timed as a GPU is: kernel_clock on (passes.py's CUDA path), no CUDA graphs."""

    kernel_clock = True

    def capture(self, fn):
        raise RuntimeError("no CUDA graphs on a synthetic GPU")


def _leaves(evs) -> list:
    """The CPU aten ops that compute (not a view, not an empty) and hold no other such op: what launches a kernel."""
    ops = sorted((e for e in evs if e.device_type() == trace._CPU and e.name().startswith("aten::")
                  and not VIEWS.search(e.name())), key=lambda e: (e.start_ns(), -e.end_ns()))
    return [e for i, e in enumerate(ops) if not (i + 1 < len(ops) and ops[i + 1].start_ns() < e.end_ns())]


def with_kernels(evs, duration) -> list:
    """The trace's events with a launch and a kernel added for each kernel-launching op (module docstring)."""
    timeline = trace.Timeline(evs)
    corr = max([e.correlation_id() for e in evs] + [0]) + 1000
    out, gpu_free = list(evs), 0
    for op in _leaves(evs):
        launch = op.start_ns() + max(1, (op.end_ns() - op.start_ns()) // 2)
        ns = int(duration(op.name(), timeline.in_core(launch)))
        start = max(launch + 1000, gpu_free)
        out += [trace.Event("cudaLaunchKernel", launch, launch + 1, corr=corr),
                trace.Event(f"synthetic_kernel<{op.name()}>", start, start + ns, device="cuda", linked=corr)]
        gpu_free, corr = start + ns, corr + 1
    return out


def install(monkeypatch, duration) -> list:
    """The synthetic GPU for every cell measured in this process (devices.get of any device gives a FakeGpu, the
    profiled forwards' traces get kernels, its launch probe and fixed GEMM read steady); returns the list each trace
    with its kernels is appended to."""
    seen = []
    real_get = devices.get

    def get(device):
        dev = real_get(device)
        return FakeGpu(dev.torch) if dev.torch.type == "cpu" else dev

    def events(prof):
        evs = with_kernels(trace.events(prof), duration)
        seen.append(evs)
        return evs

    monkeypatch.setattr(devices, "get", get)
    monkeypatch.setattr(passes, "events", events)
    monkeypatch.setattr(replay, "events", events)
    monkeypatch.setattr(session, "events", events)
    monkeypatch.setattr(state, "launch_us", lambda dev: LAUNCH_US)  # a steady machine: the CPU's own moves with
    monkeypatch.setattr(state, "gemm_ref_ms", lambda dev: GEMM_MS)  # its load, which no verdict may rest on
    return seen


LAUNCH_US, GEMM_MS = 5.0, 1.0  # the synthetic GPU's launch cost and fixed GEMM, before and after every cell


def credited(evs, block_ranges: dict) -> dict:
    """Independently of trace.py: per call key, the kernels launched inside each of its ranges (a launch event lies
    inside the op that made it), summed (ms), one sum per range in time order."""
    launches = {e.correlation_id(): e.start_ns() for e in evs if e.name() == "cudaLaunchKernel"}
    kernels = [(launches[e.linked_correlation_id()], (e.end_ns() - e.start_ns()) / 1e6) for e in evs
               if e.device_type() == trace._CUDA]
    out: dict = {}
    for e in sorted((e for e in evs if e.name() in block_ranges), key=lambda e: e.start_ns()):
        out.setdefault(block_ranges[e.name()], []).append(
            sum(ms for at, ms in kernels if e.start_ns() <= at <= e.end_ns()))
    return out

