"""How a shape's cells are timed: the backends of one shape (a model with its settings, size, batch and dtype; one
cell each) measured together, their forwards in interleaved rounds, each pass's figures kept per backend (Timing).
cell.py runs the whole procedure; this module holds what each device's clock does in it.

The rounds (measure/rounds.abba): every backend once per round, the order reversed every other round (A B C, C B A,
...), at least two rounds where there are two timed forwards a backend or more, so that a host or a clock drifting
through the rounds weighs on each backend alike. Before the rounds each backend warms up; after them each has its
memory pass and, on CUDA, its graph (cell.py).

On the CPU (devices.Cpu: kernel_clock False) a backend's share of a round is hooked forwards, each call and each
forward timed by the host clock in the same forwards (CPU ops are synchronous; the recorder's hooks cost about 1%
of a forward there: make bench measures it): a call's time_ms is its host time, `time_source` "host clock".

On CUDA (devices.Cuda: kernel_clock True) a backend's share of a round is, each kind apart:
- PLAIN forwards: the backend's processors, no hooks, no events per call, no sampler thread; each forward timed by
  CUDA events around it and by the host clock to a synchronize after it (forward_time_ms, forward_host_ms). As
  triton.testing.do_bench: warm-up of at least WARM_FORWARDS forwards and WARM_S seconds, then at least MIN_PLAIN
  forwards and MIN_PLAIN_S seconds over the rounds (the count per round sized from the warm-up's forward time);
- one PLAIN PROFILED forward (no hooks): all its GPU kernels (forward_gpu_ms), those of attention cores apart;
- PROFILED hooked forwards (at least PROFILED over the rounds): a profiler range per call, no synchronize and no
  events per call; each call's kernels credited by correlation id (trace.py): the call's time_ms is their summed
  duration, median over the forwards, `time_source` "cupti"; attn_kernel_ms and proj_kernel_ms split it, gpu_span_ms
  is first kernel start to last kernel end;
- one HOST hooked forward: the host's clock per call, no events (host_ms: the call's Python and launches);
- one EVENT hooked forward: CUDA events per call, as the profiler timed calls before (event_ms, a diagnostic only:
  in a host-bound forward it is the host's time).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..attention import backends
from ..attention.recorder import Recorder, swapped
from .probes import CallTimer, traced
from .rows import timed_forwards
from .trace import call_samples, events, forward_kernels, save

WARM_FORWARDS, WARM_S = 3, 0.5  # CUDA: warm-up of at least this many plain forwards and seconds
MIN_PLAIN, MIN_PLAIN_S = 10, 1.0  # CUDA: plain forwards over the rounds, at least this many and seconds
PROFILED = 5  # CUDA: profiled hooked forwards over the rounds, at least
MIN_ROUNDS = 2
PLAIN_RANGE, HOOKED_RANGE = "attnprof::forward (plain)", "attnprof::forward (hooked)"


@dataclass
class Timing:
    """What one backend's timing passes measured (module docstring), its samples as they came."""

    calls: dict = field(default_factory=dict)  # call_index -> the headline's samples (ms): kernels, or host clock
    windows: dict = field(default_factory=dict)  # CUDA: call_index -> its trace window in each profiled forward
    host: dict = field(default_factory=dict)  # CUDA: call_index -> host clock samples of the host pass
    events: dict = field(default_factory=dict)  # CUDA: call_index -> event samples of the event pass
    forward: list = field(default_factory=list)  # the forward's samples (plain on CUDA, hooked on the CPU)
    forward_host: list = field(default_factory=list)  # the same forwards by the host clock, to a synchronize
    hooked: list = field(default_factory=list)  # CUDA: the host pass's forwards (events around the forward)
    forward_gpu: list = field(default_factory=list)  # CUDA: per plain profiled forward, its kernels' sum
    plain_attn: list = field(default_factory=list)  # CUDA: per plain profiled forward, its attention cores' kernels
    rows: list | None = None  # the recorder's rows of one forward: the calls
    output: torch.Tensor | None = None  # the first timed forward's output, on the CPU in float
    seconds: float = 0.0  # every forward of these passes
    per_round: int = 1  # plain (CUDA) or timed (CPU) forwards per round
    rounds: int = 0
    keep: object = None  # where the first profiled trace is saved (trace.save), if anywhere


def rounds_for(repeats: int, kernel_clock: bool) -> int:
    """How many rounds a shape's backends run: on the CPU one per timed forward (at least MIN_ROUNDS where there are
    as many), on CUDA MIN_ROUNDS (each round's share sized by the warm-up: warm())."""
    if kernel_clock:
        return MIN_ROUNDS
    return max(1, repeats)


GRAPH_REPLAYS = 20


def expected_forwards(kernel_clock: bool, warmup: int, repeats: int, forward_ms: float) -> float:
    """How many forwards of forward_ms one cell's passes cost (the sweep's predicted time): on the CPU its warm-up,
    timed and probe forwards; on CUDA the warm-up and the plain forwards by their minimums of count and time, the
    profiled, host and event forwards of the rounds, the memory pass's two, and the graphs' captures and replays."""
    if not kernel_clock:
        return warmup + repeats + 1
    rounds = rounds_for(repeats, True)
    each = max(forward_ms, 1e-3)
    warm = max(warmup, WARM_FORWARDS, WARM_S * 1e3 / each) + 2
    plain = max(MIN_PLAIN, repeats, MIN_PLAIN_S * 1e3 / each)
    profiled = rounds * (1 + max(1, math.ceil(PROFILED / rounds)) + 2)
    return warm + plain + profiled + 2 + 2 * (4 + GRAPH_REPLAYS)


def _forwards(work, unet, inputs, dev, n: int, t: Timing, timer=None) -> dict:
    timed = timed_forwards(work, unet, inputs, dev, 0, n, timer)
    t.seconds += timed["seconds"]
    if t.output is None:
        t.output = timed["output"]
    return timed


def warm(work, unet, inputs, dev, factory, warmup: int, repeats: int, rounds: int) -> Timing:
    """A backend's warm-up with its processors, and its Timing with the forwards per round sized. CPU: `warmup`
    hooked forwards, as the timed ones. CUDA: plain forwards until WARM_FORWARDS and WARM_S, one hooked and one
    profiled forward (the hooks' and the profiler's first costs), then the plain forwards per round that give
    MIN_PLAIN forwards and MIN_PLAIN_S seconds over `rounds` rounds."""
    t = Timing()
    if not dev.kernel_clock:
        with Recorder(unet, processor=factory, around=CallTimer(dev)):
            t.seconds += timed_forwards(work, unet, inputs, dev, warmup, 0)["seconds"]
        t.per_round = max(1, math.ceil(repeats / rounds))
        return t
    spent, n = [], 0
    with swapped(unet, lambda block, original: factory()):
        while n < max(warmup, WARM_FORWARDS) or sum(spent) < WARM_S * 1e3:
            spent += timed_forwards(work, unet, inputs, dev, 0, 1)["forward_ms"]
            n += 1
        with Recorder(unet, around=CallTimer(dev, ranges=True, meter="none")), traced(dev, memory=False,
                                                                                        shapes=False):
            work.forward(unet, inputs)
    t.seconds += sum(spent) / 1e3
    each = statistics.median(spent)
    t.per_round = max(math.ceil(max(MIN_PLAIN, repeats) / rounds), math.ceil(MIN_PLAIN_S * 1e3 / (each * rounds)))
    return t


def one_round(work, unet, inputs, dev, factory, t: Timing, rounds: int) -> None:
    """A backend's share of one round (module docstring)."""
    t.rounds += 1
    if not dev.kernel_clock:
        timer = CallTimer(dev)
        with Recorder(unet, processor=factory, around=timer) as rec:
            timed = _forwards(work, unet, inputs, dev, t.per_round, t, timer)
        _extend(t.calls, timer.samples)
        t.forward += timed["forward_ms"]
        t.forward_host += timed["host_ms"]
        t.rows = t.rows or rec.passes()[0]
        return
    with swapped(unet, lambda block, original: factory()):
        timed = _forwards(work, unet, inputs, dev, t.per_round, t)
        t.forward += timed["forward_ms"]
        t.forward_host += timed["host_ms"]
        _profiled(work, unet, inputs, dev, t, max(1, math.ceil(PROFILED / rounds)))
        for meter, into in (("host", t.host), ("device", t.events)):
            timer = CallTimer(dev, meter=meter)
            with Recorder(unet, around=timer):
                timed = _forwards(work, unet, inputs, dev, 1, t, timer)
            _extend(into, timer.samples)
            if meter == "host":
                t.hooked += timed["forward_ms"]


def _profiled(work, unet, inputs, dev, t: Timing, hooked: int) -> None:
    """One plain profiled forward and `hooked` profiled forwards with a range per call, in one trace: each call's
    windows, each forward's kernels (trace.py)."""
    ranges = CallTimer(dev, ranges=True, meter="none")
    t0 = time.perf_counter()
    with traced(dev, memory=False, shapes=False) as prof:
        with torch.profiler.record_function(PLAIN_RANGE):
            work.forward(unet, inputs)
        with Recorder(unet, around=ranges) as rec:
            for _ in range(hooked):
                with torch.profiler.record_function(HOOKED_RANGE):
                    work.forward(unet, inputs)
    t.seconds += time.perf_counter() - t0
    evs = events(prof)
    if t.keep is not None:  # the first profiled trace, kept to be read again (a GPU's, by a CPU test)
        save(evs, t.keep, {"ranges": ranges.ranges, "plain": PLAIN_RANGE, "hooked": HOOKED_RANGE})
        t.keep = None
    for key, windows in call_samples(evs, ranges.ranges).items():
        t.windows.setdefault(key, []).extend(windows)
        t.calls.setdefault(key, []).extend(w["gpu_time_ms"] or 0.0 for w in windows)
    plain = forward_kernels(evs, PLAIN_RANGE)
    t.forward_gpu += [f["gpu_ms"] for f in plain]
    t.plain_attn += [f["attn_ms"] for f in plain]
    t.rows = t.rows or rec.passes()[0]


def _extend(into: dict, samples: dict) -> None:
    for key, values in samples.items():
        into.setdefault(key, []).extend(values)


def graph_forward(work, unet, inputs, dev, factory, replays: int = GRAPH_REPLAYS) -> dict:
    """CUDA: the plain forward captured into a CUDA graph (static inputs) and replayed `replays` times, each replay
    timed by events (forward_graph_ms: the forward with no host in it), and the hooked forward captured with CUDA
    events per call recorded as graph nodes (graph_time_ms per call: the call's kernels back to back). Where capture
    fails, forward_graph_error says why; never a silent gap. {} on the CPU (no graphs there)."""
    if not dev.kernel_clock:
        return {}
    out: dict = {"forward_graph_samples_ms": [], "graph_call_samples_ms": {}}
    try:
        with swapped(unet, lambda block, original: factory()):
            graph = dev.capture(lambda: work.forward(unet, inputs))
            for _ in range(replays):
                out["forward_graph_samples_ms"].append(_replay_ms(dev, graph))
            del graph
            timer = CallTimer(dev, meter="graph")
            with Recorder(unet, around=timer):
                graph = dev.capture(lambda: (timer._pending.clear(), work.forward(unet, inputs)))
            for _ in range(replays):
                graph.replay()
                timer.read_graph()
            out["graph_call_samples_ms"] = {k: v[-replays:] for k, v in timer.samples.items()}
            del graph
    except Exception as e:  # what CUDA graphs cannot capture here: said in the row
        out["forward_graph_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"
    finally:
        with contextlib.suppress(Exception):
            dev.release()
    return out


def _replay_ms(dev, graph) -> float:
    interval = dev.interval()
    dev.synchronize()
    interval.start()
    graph.replay()
    interval.stop()
    dev.synchronize()
    return interval.ms()


def factory_of(spec):
    return lambda: backends.make_processor(spec.backend, **spec.options)


def _median(values) -> float | None:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else None


def call_figures(t: Timing, key: int, seen: dict, kernel_clock: bool, graph: dict | None = None) -> dict:
    """One call's columns beside its headline time (module docstring): where its time went (attn_kernel_ms and
    proj_kernel_ms: on the CPU the probe pass's share of its core's ops applied to the headline), host_ms,
    launch_bound (host time over its kernels' span), event_ms, graph_time_ms, time_source."""
    if not kernel_clock:
        time_ms = _median(t.calls.get(key, []))
        attn, proj = seen.get("attn_kernel_ms"), seen.get("proj_kernel_ms")
        share = attn / (attn + proj) if time_ms is not None and attn is not None and attn + proj > 0 else None
        return {"time_source": "host clock", "attn_kernel_ms": None if share is None else time_ms * share,
                "proj_kernel_ms": None if share is None else time_ms * (1 - share), "host_ms": time_ms,
                "gpu_span_ms": None, "launch_bound": None, "event_ms": None, "graph_time_ms": None}
    windows = t.windows.get(key, [])
    span, host = _median(w["gpu_span_ms"] for w in windows), _median(t.host.get(key, []))
    graphed = (graph or {}).get("graph_call_samples_ms", {}).get(key)
    return {"time_source": "cupti", "attn_kernel_ms": _median(w["attn_kernel_ms"] for w in windows),
            "proj_kernel_ms": _median(w["proj_kernel_ms"] for w in windows), "host_ms": host, "gpu_span_ms": span,
            "launch_bound": None if host is None or span is None else bool(host > span),
            "event_ms": _median(t.events.get(key, [])), "graph_time_ms": _median(graphed or [])}


BUSY_SHARE = 0.7  # a forward whose GPU is busy less than this share of it is bound by the host


def cell_figures(t: Timing, kernel_clock: bool, graph: dict | None = None) -> dict:
    """A cell's columns beside its forward time (module docstring): the forward by the host clock, and on CUDA its
    kernels (forward_gpu_ms), the GPU's busy share and the bound it gives, the hooked forward and the hooks' cost,
    the graphed forward or why there is none."""
    forward = _median(t.forward)
    out = {"time_source": "cupti" if kernel_clock else "host clock", "forward_host_ms": _median(t.forward_host),
           "timing_rounds": t.rounds}
    if not kernel_clock:
        return out
    gpu, hooked = _median(t.forward_gpu), _median(t.hooked)
    busy = 100 * gpu / forward if gpu is not None and forward else None
    graph = graph or {}
    return {**out, "forward_gpu_ms": gpu, "gpu_busy_pct": busy,
            "bound": None if busy is None else "host" if busy < 100 * BUSY_SHARE else "gpu",
            "plain_attn_kernel_ms": _median(t.plain_attn), "hooked_forward_ms": hooked,
            "hook_overhead_pct": 100 * (hooked / forward - 1) if hooked and forward else None,
            "forward_graph_ms": _median(graph.get("forward_graph_samples_ms", [])),
            "forward_graph_samples_ms": graph.get("forward_graph_samples_ms") or None,
            "forward_graph_error": graph.get("forward_graph_error")}
