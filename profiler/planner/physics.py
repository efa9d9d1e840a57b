"""A GPU's eager forward op by op: each kernel at its class's achieved share of the GPU's peaks, the host's dispatch
of each op, and the two overlapped as they run.

The walk (planner/forward.py) gives every op of the forward in order, each with its FLOPs, bytes moved and class,
and where each attention call sits among them. On a GPU of the table (gpus.py) an op's kernel takes
    max(FLOPs / P_class, bytes / B) / e_class + t0
with P_class the dtype's dense peak at the clock the board holds (gpus.sustained; a float32 convolution at the TF32
rate, cuDNN's default), B the bandwidth, e_class the architecture's achieved share for the op's class (convolution,
matmul; norms and the other ops as memory-bound: memory) and t0 a kernel's minimum. An attention call's own ops
(projections, layouts) are priced the same way; its core is either a fused kernel, at the kernel's fit to kernel
times (planner/kernels.py, carried across architectures by the published shares) times the architecture's attention
factor, or an unfused one (naive, sliced, the chunked backends, SDPA's math kernel) that passes over its score tables:
its bytes (memory.bytes_moved, the cast passes of diffusers' upcast counted) at the share of the bandwidth sm90's
unfused kernels reached (naive's for the chunked backends) on every architecture until a GPU of it measures them
(assumed; `unfused`, 1 today: scaling it by an architecture's memory share over sm90's missed the one published naive
row by 52% with its GPU left out, against 30% as it is). A core is never under its FLOPs at CEILING of the peak;
every share is at most CEILING: no kernel runs at its datasheet's peak. On the architecture of the kernel times
(sm90) an attention call is priced whole by its kernel's fit (its projections, its minimum: measured).

The shares are fitted in half precision. A compute class's share under CEILING says its kernels are held back by
work that is not the tensor cores' (a convolution's layout passes, its tiles' loads), which a dtype of lower peak does
not slow: so in float32 (convolutions at TF32, half FP16's rate; matmuls at FP32, or TF32 where set) a convolution or
matmul keeps its achieved FLOP/s up to CEILING of the dtype's own peak (`relieved`: its share times half precision's
peak over the dtype's, at most CEILING), and one already at CEILING slows by the whole ratio. Memory-bound ops are
priced by their bytes, which float32 doubles: no relief. Assumed, and checked on the one published float32 row (the
fast-diffusion tutorial's SDXL on an A100: float32 over bfloat16 1.65x fitted, 1.53x with its GPU left out, against
the 1.59x it ran; one share per class whatever the dtype read 1.95x), never fitted.

The host dispatches op after op (us per op, planner/host.py; an attention core's ops as the backend's processor runs
them: host.core_ops), and the GPU runs each kernel once the host issued it and the kernel before it ended: a two-stage
pipeline, whose time is the last kernel's end,
    max over j of (host time to issue op j + the GPU time of ops j..n),
so a forward is bound by neither its host nor its GPU alone where stretches of small kernels (the low-resolution
blocks, the attention calls' layouts) leave the GPU waiting on the host between stretches of large ones. Replayed
from a CUDA graph (torch.cuda.CUDAGraph, torch.compile's reduce-overhead) the host's launches are gone: the kernels'
sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import gpus
from ..attention import backends
from .forward import OP_CLASSES

CEILING = 0.9  # no class of kernel above 90% of the peak compute or bandwidth
SHARES = ("convolution", "matmul", "memory", "attention", "unfused")
CORE_FUSED, CORE_UNFUSED = len(OP_CLASSES), len(OP_CLASSES) + 1  # item kinds beside the op classes


@dataclass(frozen=True)
class Shares:
    """One architecture's achieved efficiencies: convolution, matmul and memory are shares of the peak (compute, or the
    bandwidth for memory-bound ops); attention the fused kernels' time over their kernel fit carried to this
    architecture (1: as carried); unfused the unfused cores' time over sm90's kernel fit of them (their traffic at
    the shares of the bandwidth sm90's naive and math kernels reached, or naive's for the chunked backends; 1:
    assumed on every architecture); op_ms a kernel's minimum time."""

    convolution: float
    matmul: float
    memory: float
    attention: float = 1.0
    unfused: float = 1.0
    op_ms: float = 0.0005

    def coefficients(self) -> dict:
        """The rest of a forward's coefficients per op class (planner/timing.py's rest fit): 1 / share, norms and the
        other ops memory-bound, and a kernel's minimum an op."""
        return {"convolution": 1 / self.convolution, "matmul": 1 / self.matmul, "norm": 1 / self.memory,
                "other": 1 / self.memory, "ops": self.op_ms}


@dataclass(frozen=True)
class Stream:
    """A forward's kernels in order: roofline ms (at 100% of the class's peak or the bandwidth; a core's item: the
    roofline of its call's own ops where the call is priced whole, else 0), kind (an OP_CLASSES index, or CORE_FUSED /
    CORE_UNFUSED), a core's ms at its kernel fit (sm90's, carried), a core's FLOPs' ms at the
    peak, the host's ops for each, the attention call each belongs to (-1: none)."""

    roof: np.ndarray
    kind: np.ndarray
    core: np.ndarray
    compute: np.ndarray
    host: np.ndarray
    call: np.ndarray
    launches: np.ndarray  # the kernel minimums each item takes (0 for a call priced whole by its kernel fit)
    calls: int
    kernels: tuple  # each call's core: its kernel's name, or "unfused"
    relief: np.ndarray  # per op class, half precision's peak over the dtype's (relieved; 1 in half precision)


def stream(w: dict, backend: str, options: dict, dtype: str, gpu: dict, kernels: dict, tf32: bool = False) -> Stream:
    """The walk's ops and attention cores in the forward's order on the GPU; kernels: each fused kernel's fitted
    coefficients there (planner/kernels.gpu_kernels); tf32: float32 matmuls at the TF32 rate (gpus.peak_flops)."""
    from .host import core_ops
    from .roofline import Device, call_features

    dtype = w.get("dtype", dtype)  # what the model computes in: an upcast VAE's float32 at float32's rates
    peaks = np.array([gpus.peak_flops(gpu, dtype, k, tf32) for k in OP_CLASSES])
    relief = np.array([max(1.0, gpus.peak_flops(gpu, _half(gpu), k) / p) if k in ("convolution", "matmul") else 1.0
                       for k, p in zip(OP_CLASSES, peaks)])
    device = Device(float(peaks[1]), gpu["bytes_per_s"], gpu=True)
    fused = Device(gpus.peak_flops(gpu, dtype, "attention"), gpu["bytes_per_s"], gpu=True)
    parts, at, start, names = [], [*w["at"], len(w["rest"])], 0, []

    def roof_of(o: np.ndarray) -> np.ndarray:
        return np.maximum(o[:, 0] / peaks[o[:, 3].astype(int)], o[:, 1] / device.bandwidth) * 1e3

    def ops(o: np.ndarray, call: int):
        zero, one = np.zeros(len(o)), np.ones(len(o))
        parts.append((roof_of(o), o[:, 3].astype(int), zero, zero, one, np.full(len(o), call), one))

    for i, (row, own) in enumerate(zip(w["rows"], w["calls"])):
        ops(w["rest"][start:at[i]], -1)
        start = at[i]
        row = _with_sdpa_kernel(row, backend, dtype, gpu)  # the kernel PyTorch picks there: fused, or math's tables
        kernel = backends.call_kernel(backend, row, gpu["arch"])
        n = core_ops(backend, options, row, dtype)
        names.append("unfused" if unfused(backend, row, dtype, options) else kernel)
        fit = kernel if kernel in kernels or names[-1] != "unfused" else "naive"
        on = device if names[-1] == "unfused" else fused  # a fused core's GEMMs at its own rate (gpus.peak_flops)
        f = call_features(row, backend, options, dtype, 0.0, on)
        c = fused_coefficients(kernels, fit, gpu)
        ms, launches, own_roof = f["core_self"] * c["core_self"] + f["core_cross"] * c["core_cross"], n, 0.0
        if measured(kernels, fit):  # the call whole at its kernel fit here: its own ops, its minimum, its pages
            own_roof = float(roof_of(own).sum()) if len(own) else 0.0
            ms += c["projections"] * own_roof + c["overhead"] + f["fixed_ms"]
            n, launches = n + len(own), 0
        else:
            ops(own, i)
        core = (own_roof, CORE_UNFUSED if names[-1] == "unfused" else CORE_FUSED, ms,
                row["flops"] / on.flops * 1e3)
        parts.append(tuple(np.array([v]) for v in (*core, n, i, launches)))
    ops(w["rest"][start:], -1)
    cols = [np.concatenate([p[j] for p in parts]) for j in range(7)]
    return Stream(*cols[:5], cols[5].astype(int), cols[6], len(w["rows"]), tuple(names), relief)


def _half(gpu: dict) -> str:
    """The half-precision dtype the shares were fitted in (float16, or bfloat16 where the table has no float16)."""
    return "float16" if gpu["tflops"]["float16"] else "bfloat16"


def _with_sdpa_kernel(row: dict, backend: str, dtype: str, gpu: dict) -> dict:
    """The call with the SDPA kernel PyTorch's rule picks on the GPU's architecture (kernel_choice.sdpa_rule), where the
    backend lets PyTorch pick and the row does not say."""
    from ..attention import kernel_choice

    if row.get("sdpa_kernel") or not backends.uses_sdpa(backend):
        return row
    target = kernel_choice.gpu_target(gpu["arch"])
    return {**row, "sdpa_kernel": kernel_choice.sdpa_rule(dtype, row["head_dim"], row["tokens_k"], target)}


def unfused(backend: str, row: dict, dtype: str, options: dict) -> bool:
    """Whether a call's core writes its score tables (naive, sliced, the chunked backends, SDPA's math kernel: the
    backend's memory model, memory.writes_tables, with the SDPA kernel the row says PyTorch picks)."""
    from .memory import writes_tables

    return writes_tables(backend, row, dtype, **options)


def measured(kernels: dict, kernel: str) -> bool:
    """Whether a kernel's fit is of kernel times on this architecture (its calls priced whole by it: their
    projections and layouts at the fit's coefficient, which holds their small tensors' L2 reuse on sm90, 0.36 of
    the bandwidth's time)."""
    return kernels.get(kernel, {}).get("scaled") == "fitted on this architecture"


def fused_coefficients(kernels: dict, kernel: str, gpu: dict) -> dict:
    """A fused kernel's coefficients on the GPU: its kernel fit, else its published share of the peak (gpus.ATTENTION,
    else the memory-efficient kernels' assumed share): a roofline at an assumed efficiency."""
    if kernel in kernels:
        return kernels[kernel]["coefficients"]
    share = gpus.ATTENTION.get(kernel, {}).get(gpu["arch"]) or gpus.efficiency("efficient", gpu["arch"])
    return {"core_self": 1 / share[0], "core_cross": 1 / share[0]}


BASES = ("roofline", "carried kernels", "measured kernels")  # worst first


def basis(s: Stream, kernels: dict, gpu: dict, data_arch: str) -> str:
    """What a backend's attention time rests on, the least of its calls': 'measured kernels' (kernel times of this
    architecture: its kernel fit, or for an unfused core the share naive's kernels reached there), 'carried kernels'
    (another architecture's, carried by published shares) or 'roofline' (no kernel fit: an assumed share)."""
    def one(name: str) -> int:
        if name == "unfused":
            return 2 if gpu["arch"] == data_arch else 1
        if name not in kernels:
            return 0
        return 2 if measured(kernels, name) else 1

    return BASES[min((one(k) for k in set(s.kernels)), default=2)]


def relieved(coefficient, relief):
    """A class's time over its roofline (1 / its share) at a dtype whose rate is `relief` times lower than the half
    precision it was fitted in: the share rises toward CEILING by that factor, never falls (module docstring)."""
    return np.minimum(coefficient, np.maximum(1 / CEILING, np.asarray(coefficient) / relief))


def kernel_ms(s: Stream, shares: Shares) -> np.ndarray:
    """Each item's GPU time (module docstring); a core never under its FLOPs at CEILING of the peak."""
    coef = shares.coefficients()
    per_class = relieved(np.array([coef[k] for k in OP_CLASSES]), s.relief)
    kind = s.kind.astype(int)
    ops = s.roof * per_class[np.minimum(kind, len(OP_CLASSES) - 1)]
    factor = np.where(kind == CORE_FUSED, shares.attention, shares.unfused)
    g = np.where(kind >= CORE_FUSED, np.maximum(s.core * factor, s.compute / CEILING), ops)
    return g + shares.op_ms * s.launches


def overlap(host_ops: np.ndarray, g: np.ndarray, us_per_op: float) -> dict:
    """The forward's eager time as the two-stage pipeline runs it (module docstring: each item's host ops, then its
    kernels' g ms), its kernels' and its host's sums, its time from a CUDA graph (the kernels'), and which of the two
    bounds it (the longer sum)."""
    issued = np.cumsum(host_ops) * us_per_op / 1e3  # when the host has issued each item
    done = np.cumsum(g)
    eager = float(np.max(issued + done[-1] - (done - g))) if len(g) else 0.0
    gpu, host = float(done[-1]) if len(g) else 0.0, float(issued[-1]) if len(g) else 0.0
    return {"eager_ms": eager, "gpu_ms": gpu, "host_ms": host, "graph_ms": gpu,
            "bound": "host" if host > gpu else "gpu"}


def per_call(s: Stream, g: np.ndarray) -> np.ndarray:
    """Each attention call's GPU time: its own ops and its core."""
    inside = s.call >= 0
    return np.bincount(s.call[inside], weights=g[inside], minlength=s.calls)


def floor_ms(s: Stream, w: dict, backend: str, options: dict, dtype: str, gpu: dict) -> np.ndarray:
    """Each item at 100% of its peaks (the roofline bound: a core's FLOPs or its own traffic), no kernel minimum."""
    from .memory import bytes_moved

    dtype = w.get("dtype", dtype)
    core = s.kind.astype(int) >= CORE_FUSED
    peak = [gpus.peak_flops(gpu, dtype, "attention" if k == CORE_FUSED else "matmul") for k in s.kind[core]]
    cores = np.array([max(r["flops"] / p, bytes_moved(backend, r, dtype, **options) / gpu["bytes_per_s"]) * 1e3
                      for r, p in zip(w["rows"], peak)])
    floor = s.roof.copy()
    floor[core] = cores + s.roof[core]  # a call priced whole: its own ops' roofline with its core's
    return floor


def price(p: dict, w: dict, backend: str, options: dict, gpu: dict, cal: dict) -> dict:
    """A plan's forward on a GPU of the table (published.published_calibration's "physics"): each call's kernel time
    and roofline into its blocks (in place), and the totals: its kernels (attention, the rest), its host, the eager
    forward (overlap) with its range (the kernels within the prediction's uncertainty, the host within its range),
    its time from a CUDA graph, its bound and what its attention rests on (basis)."""
    ph, dtype = cal["physics"], p["dtype"]
    s = stream(w, backend, options, dtype, gpu, cal["kernels"])
    g = kernel_ms(s, Shares(**ph["shares"]))
    roof = floor_ms(s, w, backend, options, dtype, gpu)
    calls, floors = per_call(s, g), per_call(s, roof)
    for row, t, f in zip(p["blocks"], calls, floors):
        row.update(predicted_time_ms=float(t), roofline_time_ms=float(f))
    u, mid = ph["u"], overlap(s.host, g, ph["host_us"])
    fast, slow = overlap(s.host, g / (1 + u), ph["host_low"]), overlap(s.host, g * (1 + u), ph["host_high"])
    attention = float(calls.sum())
    return {"predicted_attention_time_ms": attention, "predicted_rest_time_ms": mid["gpu_ms"] - attention,
            "predicted_forward_time_ms": mid["eager_ms"], "predicted_forward_low_ms": fast["eager_ms"],
            "predicted_forward_high_ms": slow["eager_ms"], "predicted_gpu_time_ms": mid["gpu_ms"],
            "predicted_host_time_ms": mid["host_ms"], "predicted_graph_time_ms": mid["graph_ms"],
            "predicted_graph_low_ms": fast["graph_ms"], "predicted_graph_high_ms": slow["graph_ms"],
            "bound": mid["bound"], "host_source": ph["host_source"],
            "roofline_attention_time_ms": float(floors.sum()), "roofline_forward_time_ms": float(roof.sum()),
            "time_basis": f"attention: {basis(s, cal['kernels'], gpu, ph['data_arch'])}; the rest: {ph['rest_basis']}",
            "rest_ops": len(w["rest"])}


def ordered(w: dict, rest_ms: np.ndarray, call_ms, core_ops) -> tuple[np.ndarray, np.ndarray]:
    """(host ops, GPU ms) of a forward's items in order, from its rest ops' times and each call's whole (its own ops
    and its core's: core_ops of each call): what overlap() takes where a call is priced whole (a GPU box's fit)."""
    host, g, start, at = [], [], 0, [*w["at"], len(w["rest"])]
    for i, t in enumerate(call_ms):
        host += [np.ones(at[i] - start), [len(w["calls"][i]) + core_ops[i]]]
        g += [rest_ms[start:at[i]], [t]]
        start = at[i]
    host.append(np.ones(len(w["rest"]) - start))
    g.append(rest_ms[start:])
    return np.concatenate(host), np.concatenate(g)
