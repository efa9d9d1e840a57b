"""The roofline the time model's features are measured against (planner/timing.py's docstring): the device in one
dtype (Device), one op's and one attention call's time at the device's limits (roof_ms, call_features), and the
least squares with every coefficient >= 0 that the fits share (nnls)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..measure.limits import CACHE_SHARE
from .forward import OP_CLASSES
from .memory import bytes_moved, new_page_bytes, working_set, writes_tables

CALL_FEATURES = ("core_self", "core_cross", "projections", "overhead")
REST_FEATURES = (*OP_CLASSES, "ops")


@dataclass(frozen=True)
class Device:
    """What the time model knows of a device in one dtype (module docstring); None where not measured."""

    flops: float
    bandwidth: float
    cache_bytes: float | None = None
    cache_bandwidth: float | None = None
    new_page_bandwidth: float | None = None
    fresh_min: float | None = None
    softmax: float | None = None
    score_gemm: float | None = None
    gpu: bool = False  # a fused kernel's exponentials overlap its GEMMs (its floor takes the larger, not the sum)

    @classmethod
    def of(cls, limits: dict, dtype: str) -> "Device":
        """From a measured device's limits (measure/limits.py) or the GPU table's; a cache bandwidth below the
        memory's (a cost per launch, stored by runs before the small figures were replayed) left out."""
        mem = limits.get("device_memory") or {}
        bandwidth, cache = limits["device_peak_bytes_per_s"], mem.get("cache_bytes_per_s")
        cache = cache if cache and cache >= bandwidth else None
        return cls(limits["device_peak_flops"][dtype], bandwidth, mem.get("cache_bytes"),
                   cache, mem.get("fresh_bytes_per_s"), mem.get("fresh_min_bytes"),
                   (limits.get("device_softmax_per_s") or {}).get(dtype),
                   (limits.get("device_score_gemm_per_s") or {}).get(dtype),
                   (limits.get("device_limits") or {}).get("device") == "cuda")

    def moved_ms(self, nbytes, working):
        """Milliseconds to move nbytes whose working set is `working` bytes (arrays or numbers)."""
        cached = self.cache_bytes and self.cache_bandwidth
        bandwidth = np.where(np.asarray(working) <= CACHE_SHARE * (self.cache_bytes or 0), self.cache_bandwidth or
                             self.bandwidth, self.bandwidth) if cached else self.bandwidth
        return np.asarray(nbytes) / bandwidth * 1e3

    def new_pages_ms(self, nbytes):
        return np.asarray(nbytes) / self.new_page_bandwidth * 1e3 if self.new_page_bandwidth else 0 * nbytes

    def ops_ms(self, ops: np.ndarray) -> np.ndarray:
        """Each op's roofline time: ops rows are (FLOPs, bytes moved, bytes of its new output, class)."""
        flops, moved, out = ops[:, 0], ops[:, 1], ops[:, 2]
        fresh = np.where(out >= (self.fresh_min or np.inf), out, 0.0)
        return np.maximum(flops / self.flops * 1e3, self.moved_ms(moved, moved)) + self.new_pages_ms(fresh)

    def rest_features(self, ops: np.ndarray) -> dict:
        """The rest of a forward's features: its roofline time per op class, and its op count."""
        ms = self.ops_ms(ops) if len(ops) else np.zeros(0)
        classes = ops[:, 3] if len(ops) else np.zeros(0)
        return {**{k: float(ms[classes == i].sum()) for i, k in enumerate(OP_CLASSES)}, "ops": float(len(ops))}


def roof_ms(ops: np.ndarray, device: Device) -> float:
    """The ops one after another, each at its roofline time."""
    return float(device.ops_ms(ops).sum()) if len(ops) else 0.0


def call_features(row: dict, backend: str, options: dict, dtype: str, projections_ms: float, device: Device) -> dict:
    """A call's features in ms (module docstring), and its roofline bound (the score GEMMs' measured cost not in it:
    a cost at one head dim, not a bound at every one; on a GPU the larger of the compute, the traffic and the
    exponentials, which a fused kernel overlaps, rather than their sum)."""
    compute = row["flops"] / device.flops * 1e3
    memory = float(device.moved_ms(bytes_moved(backend, row, dtype, **options),
                                   working_set(backend, row, dtype, **options)))
    gemms = row["score_elements"] / device.score_gemm * 1e3 \
        if device.score_gemm and writes_tables(backend, row, dtype, **options) else 0.0
    softmax = row["score_elements"] / device.softmax * 1e3 if device.softmax else 0.0
    faulted = row.get("faulted_bytes")  # a recorded call's new pages as counted; else the tables of fresh_min and up
    pages = float(device.new_pages_ms(faulted if faulted is not None and faulted == faulted and device.fresh_min
                                      else new_page_bytes(backend, row, dtype, device.fresh_min, **options)))
    core, self_ = max(compute, gemms, memory) + softmax, row["kind"] == "self"
    bound = max(compute, memory, softmax) if device.gpu else max(compute, memory) + softmax
    return {"core_self": core * self_, "core_cross": core * (not self_), "projections": projections_ms,
            "overhead": 1.0, "fixed_ms": pages, "roofline_ms": bound + pages + projections_ms}


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (Lawson and Hanson's active set: the columns let in one at a time by
    how much they would lower the error, any whose coefficient turns negative let out again)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = x.shape[1]
    coef, free = np.zeros(n), np.zeros(n, bool)
    tol = 10 * max(x.shape) * np.finfo(float).eps * max(np.abs(x).sum(axis=0).max(initial=0.0), 1.0)
    for _ in range(3 * n + 1):
        grad = x.T @ (y - x @ coef)
        if free.all() or grad[~free].max() <= tol:
            break
        free[np.flatnonzero(~free)[np.argmax(grad[~free])]] = True
        while True:
            trial = np.zeros(n)
            trial[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
            if np.all(trial[free] > 0):
                coef = trial
                break
            out = free & (trial <= 0)
            step = np.min(coef[out] / (coef[out] - trial[out]))
            coef = coef + step * (trial - coef)
            free &= coef > tol
            coef[~free] = 0.0
    return coef
