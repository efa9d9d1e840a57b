"""The host's part of an eager forward on a GPU, priced apart from its kernels.

On a GPU the host dispatches and launches every op of an eager forward, one after another, while the GPU runs the
kernels behind it (the H200 run at batch 1: the GPU busy 6-42% of each forward, the host setting the pace); the two
overlap op by op (planner/physics.overlap). Replayed from a CUDA graph (torch.cuda.CUDAGraph, or torch.compile's
reduce-overhead mode) a forward launches once: it takes its kernels' time alone. The host's time of a forward is its
ops (forward_ops: the walk's, planner/forward.py, every aten op it dispatches that moves bytes, and each call's
attention core under the forward's backend, which the walk leaves out: core_ops) times the host's time per op:
- given (--host-us-per-op US): a figure of the user's own host;
- for a GPU of the table (--gpu), by default its published machine's, fitted to published timings, else the range of
  the published machines (planner/published.host_range);
- this machine's (--host-us-per-op here; on a GPU box, where its stored runs hold no host-bound forward): an eager
  forward of tiny-sd15 (SD 1.5's topology: its modules, its ops and diffusers' Python around them, with few
  channels) at 64x64 on this CPU in one thread, the fastest of HOST_FORWARDS, over its ops: the host's work per op
  with a CPU kernel of next to nothing where a GPU's launch would be. Cached per CPU (cache_dir()/host.json) with
  the time it was measured, said with it, and measured again after HOST_MAX_AGE_S.
"""
from __future__ import annotations

import functools
import time

HOST_FORWARDS = 20
HOST_FILE = "host.json"
HOST_VERSION = 3  # what an op is (forward_ops): a figure cached under another count is measured again
HOST_MAX_AGE_S = 24 * 3600  # this machine's cached figure is measured again after a day (its load moves it)
GIVEN = "given (--host-us-per-op)"
HERE = "here"  # --host-us-per-op here: this machine's own host


def host_us_per_op(given: float | str = HERE, clock=time.perf_counter, now=time.time) -> tuple[float, str]:
    """(host microseconds per op of an eager diffusers forward, where the figure comes from): a number given, else
    this machine's (module docstring), measured anew where its cached figure is older than HOST_MAX_AGE_S, its
    time and age said."""
    if given != HERE:
        return float(given), GIVEN
    from ..env import cache_dir
    from ..measure.limits import device_key
    from ..store import add_to_cache, read_cache

    key = f"{device_key('cpu')} | ops v{HOST_VERSION}"
    path = cache_dir() / HOST_FILE
    entry = read_cache(path).get(key)
    if not entry or now() - entry.get("measured_s", 0) > HOST_MAX_AGE_S:
        entry = {"us_per_op": measure_us_per_op(clock), "measured_s": now(),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now()))}
        add_to_cache(path, key, entry)
    age = (now() - entry["measured_s"]) / 3600
    return entry["us_per_op"], (f"this machine's host ({entry['us_per_op']:.1f} us an op: an eager tiny-sd15 forward "
                                f"on its CPU, measured {entry['measured_at']}, {age:.1f} h ago, measured again after "
                                f"{HOST_MAX_AGE_S // 3600} h)")


def measure_us_per_op(clock=time.perf_counter) -> float:
    """Host microseconds per op of tiny-sd15's eager forward at 64x64 (batch 2, as under guidance) on this CPU in
    one thread: the fastest of HOST_FORWARDS forwards over its ops (forward_ops: diffusers' default processor, sdpa)."""
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
    return best * 1e6 / forward_ops(walk("tiny-sd15", 64, 64, 2, "float32"), "sdpa", {}, "float32")  # its processors


def forward_ops(w: dict, backend: str = "sdpa", options: dict | None = None, dtype: str = "float16") -> int:
    """The ops an eager forward dispatches under this backend: the walk's (every op outside its attention calls, and
    each call's own: its projections and layouts) and each call's attention core under the backend (core_ops: one
    fused kernel's few for sdpa, a table's for naive, a Python loop of chunks' for sliced, split and subquad), which
    the walk leaves out."""
    cores = sum(core_ops(backend, options or {}, row, dtype) for row in w["rows"])
    return len(w["rest"]) + sum(len(c) for c in w["calls"]) + cores


CALL_SHAPE = ("kind", "batch", "heads", "head_dim", "tokens_q", "tokens_k", "upcast")


def core_ops(backend: str, options: dict, row: dict, dtype: str) -> int:
    """The ops one call's attention core dispatches under the backend (a map's: its block's): the backend's processor
    on fake tensors of the call's shape, less the same call with its core left out (the walk's count of it)."""
    from ..attention import backends

    name, opts = backends.for_call(backend, options, row)
    return _core_ops(name, tuple(sorted(backends.check_options(name, opts).items())),
                     tuple(row.get(k) or "" if k == "upcast" else row[k] for k in CALL_SHAPE), dtype)


@functools.lru_cache(maxsize=1024)
def _core_ops(name: str, options: tuple, shape: tuple, dtype: str) -> int:
    """core_ops of one call shape (CALL_SHAPE's values); a backend whose processor does not run on fake CPU tensors
    (a CUDA-only kernel: xformers, flash-attn, SDPA forced to a CUDA kernel; a plugin's that refuses them) is one
    fused kernel behind its Python, as sdpa's core is (assumed)."""
    from ..attention.backends import KERNEL_ERRORS
    from .forward import how_traced

    if name != "sdpa" and how_traced(name, "cpu", dtype) != "processor":
        return _core_ops("sdpa", (), shape, dtype)
    without = _without_core(shape, dtype)
    try:
        return _looped_ops(name, dict(options), shape, dtype) - without
    except KERNEL_ERRORS:  # a plugin's processor that does not run on fake tensors
        if name == "sdpa":
            raise
        return _core_ops("sdpa", (), shape, dtype)


@functools.lru_cache(maxsize=1024)
def _without_core(shape: tuple, dtype: str) -> int:
    """The ops of one call of this shape with its core left out (the walk's count of it): one count for every
    backend asked of the shape."""
    return _call_ops("sdpa", {}, shape, dtype, core=False)


def _looped_ops(name: str, options: dict, shape: tuple, dtype: str) -> int:
    """_call_ops of one call, where a chunked core's loops (memory.loops) run many times counted from calls of the
    same shape with two or three chunks in each: every chunk of a regular loop (_regular) dispatches the same ops, so
    the count is affine in each loop's iterations (per outer one a fixed count, per inner one another), and two calls
    (one loop varied) or three (two) give it exactly at any size (tests/test_timing.py holds it against the direct
    count on every call of SD 1.5 at 1024x1024, SD 2.1-v at 768x768 and tiny-sd15's few tokens), where a direct count
    at 36864 tokens dispatches thousands of chunks on fake tensors (the Planner page's time chart, tiny-sd15 at five
    sizes for 14 backends: 16.1 s of CPU, 11.6 s so). A loop of three chunks or fewer, or one that is not regular
    as it is or at two or three chunks, runs as it is."""
    from ..attention.chunked import score_size
    from ..spec import torch_dtype
    from .memory import loops as loops_of

    kind, batch, heads, head_dim, tokens_q, tokens_k, upcast = shape
    tokens_k = tokens_k if kind == "cross" else tokens_q
    scores = batch * heads * tokens_q * tokens_k  # the call's row, as the recorder writes it
    row = {"batch": batch, "heads": heads, "head_dim": head_dim, "tokens_q": tokens_q, "tokens_k": tokens_k,
           "score_elements": scores, "score_bytes": scores * score_size(upcast, torch_dtype(dtype).itemsize)}
    found = loops_of(name, row, dtype, **options)
    if found is None:
        return _call_ops(name, options, shape, dtype)
    loops, made = found
    counts = [_up(t, c) for t, c in loops]
    varied = [n > 3 and _regular(t, c) and all(_regular(t, _up(t, k)) and _up(t, _up(t, k)) == k for k in (2, 3))
              for n, (t, c) in zip(counts, loops)]

    def ops(*k: int) -> int:  # the call with k chunks in each varied loop, in order; the others' chunks as they are
        chunks, k = [], list(k)
        for vary, (t, c) in zip(varied, loops):
            chunks.append(_up(t, k.pop(0)) if vary else c)
        return _call_ops(name, made(*chunks), shape, dtype)

    if sum(varied) == 1:  # ops = f(2) + (N - 2) * (f(3) - f(2)), the other loop (if any) at its own chunks
        two = ops(2)
        return two + (counts[varied.index(True)] - 2) * (ops(3) - two)
    if sum(varied) == 2:
        f22, f23, f32 = ops(2, 2), ops(2, 3), ops(3, 2)  # a + 2b + 4c, a + 2b + 6c, a + 3b + 6c
        inner, outer = (f23 - f22) // 2, f32 - f23
        return f22 - 2 * outer - 4 * inner + counts[0] * outer + counts[0] * counts[1] * inner
    return _call_ops(name, options, shape, dtype)


def _up(a: int, b: int) -> int:
    return -(-a // b)


def _regular(tokens: int, chunk: int) -> bool:
    """Whether a loop's chunks are all part of the tensor (not the whole of it) and of two rows or more, the last
    one too: the chunks that dispatch the same ops each."""
    return 1 < chunk < tokens and tokens % chunk != 1


def _call_ops(name: str, options: dict, shape: tuple, dtype: str, core: bool = True) -> int:
    """The ops (planner/forward.OpCount's: those that move bytes) of one call of the backend's processor on fake CPU
    tensors: a diffusers Attention of the call's heads, head dim and upcast, its inputs of its batch and tokens."""
    from contextlib import nullcontext

    import torch
    from diffusers.models.attention_processor import Attention
    from torch._subclasses.fake_tensor import FakeTensor

    from ..attention import backends
    from ..spec import torch_dtype
    from .forward import OpCount, _NoCore, fake_mode

    kind, batch, heads, head_dim, tokens_q, tokens_k, upcast = shape
    dt, width = torch_dtype(dtype), heads * head_dim
    with torch.device("meta"):
        attn = Attention(query_dim=width, heads=heads, dim_head=head_dim, cross_attention_dim=width if kind == "cross"
                         else None, upcast_attention=upcast == "attention", upcast_softmax=upcast == "softmax").to(dt)
    mode, count = fake_mode(), OpCount()
    with mode, torch.no_grad():
        attn = attn._apply(lambda t: FakeTensor(mode, t, torch.device("cpu"))).eval()
        x = torch.empty(batch, tokens_q, width, dtype=dt)  # (B, Tq, C)
        context = torch.empty(batch, tokens_k, width, dtype=dt) if kind == "cross" else None  # (B, Tk, C)
        processor = backends.make_processor(name, **options)
        with count, (nullcontext() if core else _NoCore()):
            processor(attn, x, context)
    return len(count.rest)
