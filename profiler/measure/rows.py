"""The rows of a measured cell, eager or compiled (cell.py, compiled.py): the timed forwards, one call's block row,
the cell's row and its attention summary."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch
from torch.utils._pytree import tree_leaves

from ..attention import backends
from ..unet.models import facts_of
from ..planner.memory import bytes_moved, predicted_peak_bytes, working_set
from ..spec import CellSpec
from .limits import place
from .probes import CallTimer, summarize

# max |out - ref| / max |ref| of the whole U-Net output that a backend may show in each dtype
TOLERANCE = {"float32": 1e-3, "bfloat16": 6e-2, "float16": 1e-2}


@contextlib.contextmanager
def without_collection():
    """Python's cyclic garbage collector kept off during the block, as timeit times: the objects a probe pass's
    profiler leaves behind (thousands) otherwise set off a full collection inside a later timed forward, the next
    cell's in the same worker included (tiny-sd15 at 256x256 on this CPU: 87 ms a forward, 130 ms with it). What is
    due is collected once the block ends, outside the times (collecting before each block instead cost a sweep 0.2 s
    a cell: a full collection of a worker's 400,000 objects)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed_forwards(work, unet, inputs, dev, warmup: int, repeats: int, timer: CallTimer | None = None) -> dict:
    """warmup + repeats forwards, each on the device's clock, with no garbage collection among them
    (without_collection); the timed ones' times (forward_ms; host_ms: the host's clock from the forward's start to a
    synchronize after it), the largest forward transient the allocator saw (forward_peak; 0 without one), the first
    timed output (on the CPU, float) and the seconds they all took. A timer's samples of the warm-up forwards are
    dropped."""
    with without_collection():
        return _timed_forwards(work, unet, inputs, dev, warmup, repeats, timer)


def _timed_forwards(work, unet, inputs, dev, warmup: int, repeats: int, timer: CallTimer | None) -> dict:
    forward_ms, host_ms, forward_peak, output, seconds = [], [], 0, None, 0.0
    for i in range(warmup + repeats):
        dev.synchronize()
        dev.reset_peak()
        held = dev.allocated()
        clock = dev.interval()
        t0 = time.perf_counter()
        clock.start()
        out = work.forward(unet, inputs)
        clock.stop()
        timer.collect() if timer else dev.synchronize()  # the forward's clock can be read
        host = (time.perf_counter() - t0) * 1e3
        elapsed = clock.ms()
        seconds += elapsed / 1e3
        if dev.allocator:
            forward_peak = max(forward_peak, dev.peak_allocated() - held)
        if i < warmup:
            if timer:
                timer.samples.clear()
            continue
        forward_ms.append(elapsed)
        host_ms.append(host)
        if output is None:
            output = out.float().cpu()
        del out
    return {"forward_ms": forward_ms, "host_ms": host_ms, "forward_peak": forward_peak, "output": output,
            "seconds": seconds}


def block_row(spec: CellSpec, row: dict, samples: list[float], seen: dict, peak: int | None, roof: tuple,
              figures: dict | None = None) -> dict:
    """One call's row: its shape (the recorder's row), its time samples (the headline: kernel time on CUDA, the host
    clock on the CPU), what the probe pass's trace saw in it (seen: the kernel, the SDPA kernel, its GPU time, and
    its memory where `peak` is None), the timing passes' other figures of it (figures: passes.call_figures), its
    memory model and roofline (against its headline time)."""
    row = {k: v for k, v in row.items() if k != "pass_index"}
    timing = summarize(samples)
    moved = bytes_moved(spec.backend, row, spec.dtype, **spec.options)
    return {**spec.as_row(), **row, **timing, "time_samples_ms": samples,
            "sdpa_kernel": seen.get("sdpa_kernel") if backends.uses_sdpa(spec.backend) else None,  # where it ran
            "peak_mem_bytes": peak if peak is not None else seen.get("peak_mem_bytes"),
            "predicted_peak_bytes": predicted_peak_bytes(spec.backend, {**row, "device": spec.device}, spec.dtype,
                                                         **spec.options),
            "kernel": seen.get("kernel", ""), "gpu_time_ms": seen.get("gpu_time_ms"),
            "gpu_kernels": ",".join(seen["gpu_kernels"]) if seen.get("gpu_time_ms") is not None else None,
            **(figures or {}),
            "bytes_moved": moved, **place(row["flops"], moved, timing["time_ms"], *roof,
                                          working=working_set(spec.backend, row, spec.dtype, **spec.options)),
            "status": "ok"}


def cell_row(spec: CellSpec, reference: tuple, inputs: dict, weights: int, timed: dict, cpu_forward_peak,
             dev, nvml) -> dict:
    """A measured cell's row but for its attention figures: the forward's time and peak (the allocator's, or on
    the CPU the probe trace's cpu_forward_peak), the output's error against the reference, NVML's figures."""
    reference, reference_label = reference
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_leaves(inputs)
            if isinstance(t, torch.Tensor)}
    forward_peak = int(timed["forward_peak"] if cpu_forward_peak is None else cpu_forward_peak)
    abs_err = float((timed["output"] - reference).abs().max())
    rel_err = abs_err / max(float(reference.abs().max()), 1e-12)
    fwd = summarize(timed["forward_ms"])
    return {
        **spec.as_row(), **facts_of(spec.model), "status": "ok", "error": "",
        "forward_time_ms": fwd["time_ms"], "forward_iqr_ms": fwd["iqr_ms"], "noisy": fwd["noisy"],
        "forward_time_samples_ms": timed["forward_ms"], "forward_peak_mem_bytes": forward_peak,
        "weights_bytes": weights, "inputs_bytes": sum(held.values()),
        "forward_peak_total_bytes": weights + sum(held.values()) + forward_peak,
        "allocator_reserved_max_bytes": dev.reserved_max(), "allocator_allocated_max_bytes": dev.allocated_max(),
        "max_abs_err": abs_err, "max_rel_err": rel_err, "error_ok": rel_err <= TOLERANCE[spec.dtype],
        "reference": reference_label, **nvml.result(),
    }


def attention_summary(blocks: list[dict], roof: tuple, per_forward: bool = True) -> dict:
    """A cell's attention figures from its calls' rows (a measured cell's or a replay's): its attention time
    (report.compare.ATTENTION_TIME: per timed forward the calls summed, the median of those sums; with per_forward
    False, a replay's, whose shapes are timed apart and as often as each needs, the sum of its calls' medians; NaN
    where the calls have no time: compiled, fused away), the largest call's peaks, the kernels, and the calls
    together on the roofline against roof = (peak FLOP/s, peak bytes/s)."""
    samples = [sum(round_ms) for round_ms in zip(*(b["time_samples_ms"] for b in blocks))]
    time_ms = statistics.median(samples) if per_forward and samples else sum(b["time_ms"] for b in blocks)
    totals = (*(sum(b[k] for b in blocks) for k in ("flops", "bytes_moved")), time_ms)
    return {"attention_time_ms": time_ms, "attention_time_samples_ms": samples,
            "attention_peak_mem_bytes": max((b["peak_mem_bytes"] for b in blocks if b["peak_mem_bytes"] is not None),
                                            default=None),  # None: no call's memory is its own (compiled, fused)
            "predicted_peak_bytes": max(b["predicted_peak_bytes"] for b in blocks),
            "calls": len(blocks), "kernel": " | ".join(dict.fromkeys(b["kernel"] for b in blocks)),
            "sdpa_kernel": ",".join(dict.fromkeys(b["sdpa_kernel"] for b in blocks if b["sdpa_kernel"])) or None,
            **{f"attention_{k}": v for k, v in place(*totals, *roof).items()}}
