"""The host's part of an eager forward on a GPU, priced apart from its kernels.

On a GPU the host dispatches and launches every op of an eager forward, one after another, while the GPU runs the
kernels behind it: the forward takes the longer of the two, and that one bounds it (the H200 run at batch 1: the GPU
busy 6-42% of each forward, the host setting the pace). Replayed from a CUDA graph (torch.cuda.CUDAGraph, or
torch.compile's reduce-overhead mode) a forward launches once: it takes its kernels' time alone. The host's time of a
forward is its ops (the walk's, planner/forward.py: every aten op it dispatches) times the host's time per op:
- given (--host-us-per-op): a figure of the user's own host;
- else this machine's (host_us_per_op): an eager forward of tiny-sd15 (SD 1.5's topology: its modules, its ops and
  diffusers' Python around them, with few channels) at 64x64 on this CPU in one thread, the fastest of HOST_FORWARDS,
  over its ops: the host's work per op with a CPU kernel of next to nothing where a GPU's launch would be. An
  estimate of a GPU box's host from this one, said so; cached per CPU (cache_dir()/host.json).
"""
from __future__ import annotations

import time

HOST_FORWARDS = 20
HOST_FILE = "host.json"
GIVEN = "given (--host-us-per-op)"


def host_us_per_op(given: float | None = None, clock=time.perf_counter) -> tuple[float, str]:
    """(host microseconds per op of an eager diffusers forward, where the figure comes from): module docstring."""
    if given is not None:
        return float(given), GIVEN
    from ..env import cache_dir
    from ..measure.limits import device_key
    from ..store import add_to_cache, read_cache

    key = device_key("cpu")
    path = cache_dir() / HOST_FILE
    entry = read_cache(path).get(key)
    if not entry:
        entry = {"us_per_op": measure_us_per_op(clock), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}
        add_to_cache(path, key, entry)
    return entry["us_per_op"], (f"this machine's host ({entry['us_per_op']:.1f} us an op: an eager tiny-sd15 forward "
                                 f"on its CPU, measured {entry['measured_at']}; --host-us-per-op for another)")


def measure_us_per_op(clock=time.perf_counter) -> float:
    """Host microseconds per op of tiny-sd15's eager forward at 64x64 (batch 2, as under guidance) on this CPU in
    one thread: the fastest of HOST_FORWARDS forwards over the walk's ops."""
    import torch

    from ..unet import models
    from .forward import walk

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        unet = models.build("tiny-sd15", weights="random", dtype="float32").eval()
        x, t = torch.randn(2, 4, 8, 8), torch.tensor([10.0])
        enc = torch.randn(2, 77, unet.config.cross_attention_dim)
        best = float("inf")
        with torch.no_grad():
            for _ in range(HOST_FORWARDS):
                t0 = clock()
                unet(x, t, encoder_hidden_states=enc)
                best = min(best, clock() - t0)
    finally:
        torch.set_num_threads(threads)
    return best * 1e6 / forward_ops(walk("tiny-sd15", 64, 64, 2, "float32"))


def forward_ops(w: dict) -> int:
    """The ops a forward dispatches (a walk's: outside its attention calls and inside them, the attention's own
    kernels counted with the calls' other ops by the backends that run them apart)."""
    return len(w["rest"]) + sum(len(c) for c in w["calls"])


def bounded(gpu_ms: float, host_ms: float) -> dict:
    """An eager forward's time (the longer of its kernels' and its host's), what bounds it, and its time replayed
    from a CUDA graph (the kernels')."""
    return {"eager_ms": max(gpu_ms, host_ms), "graph_ms": gpu_ms, "gpu_ms": gpu_ms, "host_ms": host_ms,
            "bound": "host" if host_ms > gpu_ms else "gpu"}
