"""Measure one cell: warm-up forwards, timed forwards, one probe pass (memory and kernel), error against an fp32
reference. Models are built once per (model, dtype, device) and kept for the cells that follow."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

from ..attention import backends, kernel_choice
from .. import devices
from ..unet import models
from ..unet.models import facts_of
from . import passes
from .probes import CallProbe, NvmlSampler, traced
from .rounds import abba
from .state import Watch
from .trace import attention_op, events, op_calls, trace_windows
from ..attention.recorder import Recorder, swapped
from ..attention.backends import REFERENCE_BACKEND, REFERENCE_DTYPE
from ..spec import CellSpec
from ..unet.workload import Workload
from .limits import roof_of
from .rows import TOLERANCE, attention_summary, block_row, cell_row, timed_forwards  # noqa: F401 (also cell's)


class ReferenceFailed(Exception):
    """The fp32 reference forward of a (model, size, batch) failed: every cell that needs it gets this message.
    It keeps no traceback, so that the failed forward's tensors are freed."""

    def __init__(self, message: str, oom: bool):
        super().__init__(message)
        self.oom = oom


class ModelCache:
    """The built models by (model, part, dtype, device) (a U-Net and its ControlNet are parts: a group's cells with
    and without the ControlNet share the U-Net), and the fp32 reference outputs by (model, settings, size, batch,
    device).

    Measure the backend, not the harness: the references of every shape the group will need (expect()) are
    computed first, by one fp32 model that is freed before the model under test is built, and kept on the CPU; so
    nothing of ours sits on the device beside the model under test (a model under test that computes in float32 is
    its own reference). Where the device cannot hold the fp32 model or its forward, the references are computed on
    the CPU, and the cells say so in `reference`. A folder or hub id loads its real weights; a registry config gets
    seeded random weights, the same values on every device. A reference that fails is tried once per shape: its
    failure is kept and given to every cell that needs it."""

    def __init__(self):
        self._parts: dict[tuple, torch.nn.Module] = {}
        self._refs: dict[tuple, tuple[torch.Tensor, str] | ReferenceFailed] = {}
        self._expected: set[tuple] = set()
        self.reference_forward_s = 0.0  # time in reference forwards not yet charged to a cell

    def get(self, model: str, dtype: str, device: str, settings: tuple = ()) -> tuple[Workload, torch.nn.Module]:
        """(the workload, the model under test) of a cell, built from the parts kept here."""
        w = Workload(model, settings)
        return w, w.build(lambda which: self._part(w, which, dtype, device))

    def _part(self, w: Workload, which: str, dtype: str, device: str) -> torch.nn.Module:
        key = (w.model, which, w.dtype(dtype), device)
        if key not in self._parts:
            self._parts[key] = w.make_part(which, "pretrained" if w.source.weights else "random", device, key[2])
        return self._parts[key]

    def keep_only(self, cells: list[CellSpec]) -> None:
        """Free the parts that none of these cells needs (a ControlNet once the cells that run it are done), so that
        nothing beside the model under test stays on the device."""
        needed = {(c.model, which, w.dtype(c.dtype), c.device) for c in cells
                  for w in [Workload(c.model, c.settings)] for which in w.parts()}
        gone = [key for key in self._parts if key not in needed]
        for key in gone:
            del self._parts[key]
        for device in {key[3] for key in gone}:
            devices.get(device).release()

    def expect(self, cells: list[CellSpec]) -> None:
        """The cells that will ask for references: the first ask computes all of theirs with one fp32 model."""
        self._expected.update(_ref_key(c) for c in cells)

    def reference(self, spec: CellSpec) -> tuple[torch.Tensor, str]:
        """(the fp32 reference output on the CPU, how it was computed) for the cell's shape."""
        key = _ref_key(spec)
        if key not in self._refs:
            self._expected.add(key)
            todo = sorted(k for k in self._expected if k not in self._refs and k[0] == key[0] and k[5] == key[5])
            self._references(todo, spec.dtype)
        ref = self._refs[key]
        if isinstance(ref, ReferenceFailed):
            raise ReferenceFailed(str(ref), ref.oom)
        return ref

    def _references(self, keys: list[tuple], dtype: str) -> None:
        device = keys[0][5]
        t0, parts, where, why = time.perf_counter(), {}, device, ""
        try:
            for key in keys:
                while key not in self._refs:
                    failure = None
                    try:
                        self._refs[key] = (self._forward(key, dtype, where, parts), _reference_label(where, device, why))
                    except Exception as e:  # kept as a message: the traceback would hold the failed tensors
                        failure = (devices.oom_message(e), _describe(e))
                    if failure:
                        parts.clear()
                        devices.get(where).release()
                        oom, described = failure
                        if oom and where != "cpu":  # the device cannot hold it: this shape and the rest on the CPU
                            where, why = "cpu", oom
                            continue
                        self._refs[key] = ReferenceFailed(f"the {REFERENCE_BACKEND}/{REFERENCE_DTYPE} reference "
                                                          f"forward failed: {oom or described}", oom is not None)
        finally:
            parts.clear()
            devices.get(device).release()  # the fp32 model's memory goes back before the model under test comes
            self.reference_forward_s += time.perf_counter() - t0

    def _forward(self, key: tuple, dtype: str, where: str, parts: dict) -> torch.Tensor:
        """The reference output of one shape: the cell's workload in float32 with the reference backend. A model
        under test that computes in float32 on this device is used as it is; else float32 parts made here."""
        model, settings, width, height, batch, device = key
        w = Workload(model, settings)
        if w.dtype(dtype) == REFERENCE_DTYPE and where == device:
            module = self.get(model, dtype, device, settings)[1]
        else:
            weights = "pretrained" if w.source.weights else "random"

            def part(which: str) -> torch.nn.Module:
                if which not in parts:
                    parts[which] = w.make_part(which, weights, where, REFERENCE_DTYPE)
                return parts[which]

            module = w.build(part)
        inputs = w.inputs(module, batch, width, height)
        with torch.no_grad(), devices.get(where).guard(), devices.full_fp32(), w.applied(module), \
                devices.nvtx_range(f"{model} {width}x{height} batch {batch} reference ({REFERENCE_BACKEND}, "
                                   f"{REFERENCE_DTYPE})"), \
                Recorder(module, processor=lambda: backends.make_processor(REFERENCE_BACKEND)):
            return w.forward(module, inputs).float().cpu()


def _ref_key(spec: CellSpec) -> tuple:
    return spec.model, spec.settings, spec.width, spec.height, spec.batch, spec.device


def _reference_label(where: str, device: str, why: str) -> str:
    label = f"{REFERENCE_BACKEND}/{REFERENCE_DTYPE}"
    return label if where == device else f"{label} on the CPU: {device} could not hold it ({why[:160]})"


def measure_cell(spec: CellSpec, cache: ModelCache, repeats: int = 3, warmup: int = 1, extra: dict | None = None,
                 trace_dir: Path | None = None) -> tuple[dict, list[dict]]:
    """One cell measured alone (measure_set of one): (cell row, block rows); a backend that fails is its row."""
    return measure_set([spec], cache, repeats, warmup, {spec.cell_id: extra or {}}, trace_dir)[0]


def measure_set(specs: list[CellSpec], cache: ModelCache, repeats: int = 3, warmup: int = 1,
                extras: dict | None = None, trace_dir: Path | None = None,
                full: bool = True) -> list[tuple[dict, list[dict]]]:
    """The cells of one shape (the same model, settings, size, batch, dtype and device; one backend each), measured
    together on their device (made current throughout): one model build and reference, each backend warmed up, then
    their forwards in interleaved rounds (passes.py), then each backend's memory pass and, on CUDA, its graph; the
    machine's state read before, between rounds and after (state.Watch). Returns (cell row, block rows) per spec, in
    order; a backend that fails (an allocation failure, an error) is its own row and the others go on. Raises where
    the shape itself cannot run (its reference, the model's build): run_set turns that into every cell's row.
    extras: each cell's extra by cell_id (execute/groups.py), whose device limits each call is placed against;
    trace_dir: where each cell's kernel-timing trace goes (its first profiled forwards, trace.save: CUDA only) as
    <cell_id>.kernels.json.gz, and with full its memory pass's Chrome / Perfetto trace (and on CUDA the allocator's
    memory snapshot of it), as <cell_id>.trace.json and <cell_id>.memory.pickle."""
    dev = devices.get(specs[0].device)
    with dev.guard():
        if dict(specs[0].settings).get("compile", "none") != "none":
            from .compiled import measure_compiled

            return [measure_compiled(s, cache, repeats, warmup, dev, (extras or {}).get(s.cell_id, {}), trace_dir)
                    for s in specs]
        return _measure_set(specs, cache, repeats, warmup, dev, extras or {}, trace_dir, full)


def _measure_set(specs, cache, repeats, warmup, dev, extras, trace_dir, full) -> list[tuple[dict, list[dict]]]:
    first = specs[0]
    reference = cache.reference(first)  # before the model under test is built: never beside it
    forwards_s, cache.reference_forward_s = cache.reference_forward_s, 0.0  # charged to the shape's first cell
    work, unet = cache.get(first.model, first.dtype, first.device, first.settings)
    inputs = work.inputs(unet, first.batch, first.width, first.height)
    failed, timing, compile_s = {}, {}, {}
    watch, rounds = Watch(dev), passes.rounds_for(repeats, dev.kernel_clock)
    with torch.no_grad(), work.applied(unet):
        weights = models.weights_bytes(unet)  # with what the settings add (IP-Adapter's projections)
        watch.before()
        for spec in specs:
            factory = passes.factory_of(spec)
            _guarded(spec, failed, dev, lambda: compile_s.update({spec.cell_id: _compile_pass(
                spec, work, unet, inputs, factory, dev)}))
            _guarded(spec, failed, dev, lambda: timing.update({spec.cell_id: passes.warm(
                work, unet, inputs, dev, factory, warmup, repeats, rounds)}))
            if trace_dir and spec.cell_id in timing:
                timing[spec.cell_id].keep = trace_dir / f"{spec.cell_id}.kernels.json.gz"
        for spec in abba([s for s in specs if s.cell_id in timing], rounds):
            if spec.cell_id not in failed:
                _guarded(spec, failed, dev, lambda: passes.one_round(work, unet, inputs, dev, passes.factory_of(spec),
                                                                     timing[spec.cell_id], rounds))
                watch.between()
        watch.after()
        state = watch.result()
        out = []
        for i, spec in enumerate(specs):
            if spec.cell_id in failed:
                out.append((failed[spec.cell_id], []))
                continue
            got = _guarded(spec, failed, dev, lambda: _finish(spec, work, unet, inputs, dev, reference, weights,
                                                              timing[spec.cell_id], extras.get(spec.cell_id, {}),
                                                              trace_dir if full else None))
            cell, blocks = (failed[spec.cell_id], []) if got is None else got
            if got is not None:
                c_s, c_fwd = compile_s.get(spec.cell_id) or (None, 0.0)
                cell.update(state, compile_s=c_s, timing_with=", ".join(backends.label(s.backend, s.backend_options)
                                                                         for s in specs if s is not spec) or None,
                            forwards_total_s=(forwards_s if i == 0 else 0.0) + c_fwd + timing[spec.cell_id].seconds)
            out.append((cell, blocks))
    return out


def _guarded(spec: CellSpec, failed: dict, dev, fn):
    """fn() for one backend of a shape; a failure becomes its row in `failed` (oom for every allocation failure,
    else error) and its memory goes back, so that the shape's other backends go on. None where it failed."""
    if spec.cell_id in failed:
        return None
    try:
        with devices.nvtx_range(f"{spec.model} {spec.size} batch {spec.batch} {spec.dtype} "
                                f"{backends.label(spec.backend, spec.backend_options)}"):  # the steps inside it
            return fn()
    except ReferenceFailed:
        raise
    except Exception as e:  # one backend's failure is its row; the shape's others go on
        oom = devices.oom_message(e)
        failed[spec.cell_id] = failed_cell(spec, "oom" if oom else "error", oom or _describe(e))
        dev.release()
        return None


def _finish(spec, work, unet, inputs, dev, reference, weights, t, extra, trace_dir) -> tuple[dict, list[dict]]:
    """A backend's memory pass, its graph (CUDA), and its rows from every pass's figures. The memory pass runs on a
    released allocator, with NVML's sampler on (only here: no thread runs while anything is timed): one plain forward
    (the forward's peak), then the probe forward, each call's allocator peak from a synchronize at its start, its
    kernels named from the trace."""
    factory = passes.factory_of(spec)
    dev.release()
    dev.begin_cell()
    probe = CallProbe(dev)
    snapshot = trace_dir / f"{spec.cell_id}.memory.pickle" if trace_dir and dev.memory_snapshot else None
    with NvmlSampler(dev) as nvml:
        peak = 0  # on the CPU the probe forward's trace gives the forward's peak
        if dev.allocator:
            with swapped(unet, lambda block, original: factory()):
                peak = timed_forwards(work, unet, inputs, dev, 0, 1)["forward_peak"]
        t0 = time.perf_counter()
        with Recorder(unet, processor=factory, around=probe) as probe_rec, dev.memory_history(snapshot), \
                traced(dev) as prof:
            work.forward(unet, inputs)
        t.seconds += time.perf_counter() - t0
    reserved, allocated = dev.reserved_max(), dev.allocated_max()
    graph = passes.graph_forward(work, unet, inputs, dev, factory)
    if trace_dir:
        prof.export_chrome_trace(str(trace_dir / f"{spec.cell_id}.trace.json"))
    per_call, cpu_forward_peak = trace_windows(prof, probe.ranges)
    roof = roof_of(extra)
    blocks = [block_row(spec, row, t.calls.get(row["call_index"], []), per_call.get(row["call_index"], {}),
                        probe.peak.get(row["call_index"]), roof,
                        passes.call_figures(t, row["call_index"], per_call.get(row["call_index"], {}),
                                            dev.kernel_clock, graph)) for row in probe_rec.rows]
    timed = {"forward_ms": t.forward, "forward_peak": peak, "output": t.output}
    cell = cell_row(spec, reference, inputs, weights, timed, None if dev.allocator else cpu_forward_peak, dev, nvml)
    cell.update(allocator_reserved_max_bytes=reserved if dev.allocator else None,
                allocator_allocated_max_bytes=allocated if dev.allocator else None,
                **attention_summary(blocks, roof), **passes.cell_figures(t, dev.kernel_clock, graph),
                attention_op_time_ms=op_time_ms(prof, spec.backend, len(blocks)), **sdpa_choices(spec, blocks),
                **_split(blocks))
    return cell, blocks


def _split(blocks: list[dict]) -> dict:
    """The calls' attention cores and the rest summed (per forward): where attention's time went."""
    def total(k: str) -> float | None:
        return sum(b[k] for b in blocks) if blocks and all(b.get(k) is not None for b in blocks) else None

    return {"attention_kernel_ms": total("attn_kernel_ms"), "attention_proj_ms": total("proj_kernel_ms"),
            "attention_host_ms": total("host_ms")}


def op_time_ms(prof, backend: str, calls: int) -> float | None:
    """The attention op's time summed over one traced forward (probes.op_calls: SDPA's kernel, xformers', flash-
    attn's, without the projections around it), where the trace holds one op per call; else None. What a compiled
    cell's per-call times are, so that an eager cell's attention share can be set beside a compiled one's."""
    pattern = attention_op(backend)
    ops = op_calls(events(prof), pattern) if pattern else []
    return sum(op["time_ms"] for op in ops) if pattern and len(ops) == calls else None


def sdpa_choices(spec: CellSpec, blocks: list[dict]) -> dict:
    """Where PyTorch picks the SDPA kernel (sdpa): each block's `sdpa_kernel_asked` (what torch._fused_sdp_choice
    answers on the cell's device, as the planner does where this process holds the device), and on CUDA
    `sdpa_kernel_rule` (what the planner's rule names with no GPU to ask) and the cell's `sdpa_rule_differs`: the
    shapes where the two differ (None where they agree)."""
    if not backends.picks_sdpa_kernel(spec.backend):
        return {}
    dev, differs = torch.device(spec.device), {}
    target = kernel_choice.gpu_target(index=dev.index or 0) if dev.type == "cuda" else None  # the cell's own GPU
    for b in blocks:
        b["sdpa_kernel_asked"] = kernel_choice.asked_sdpa_choice(spec.dtype, b["head_dim"], b["tokens_k"], dev)
        if target is None:
            continue
        b["sdpa_kernel_rule"] = kernel_choice.sdpa_rule(spec.dtype, b["head_dim"], b["tokens_k"], target)
        if b["sdpa_kernel_asked"] != b["sdpa_kernel_rule"]:
            differs[f"head_dim {b['head_dim']} tokens_k {b['tokens_k']}"] = \
                f"torch {b['sdpa_kernel_asked']}, rule {b['sdpa_kernel_rule']}"
    return {"sdpa_rule_differs": "; ".join(f"{k}: {v}" for k, v in differs.items()) or None} if target else {}


def _compile_pass(spec: CellSpec, work, unet, inputs, factory, dev) -> tuple[float | None, float]:
    """For a backend that compiles its kernel per shape (flex): one forward before the warm-up, so that every
    compile happens here and none in a timed forward. (the seconds spent in the calls that compiled: 0 where this
    process had compiled every shape already, the forward's seconds); (None, 0) for the other backends."""
    if not backends.compiles(spec.backend):
        return None, 0.0
    from ..attention.fused import CompileClock

    before, t0 = CompileClock.seconds, time.perf_counter()
    with Recorder(unet, processor=factory):
        work.forward(unet, inputs)
    dev.synchronize()
    return CompileClock.seconds - before, time.perf_counter() - t0


def failed_cell(spec: CellSpec, status: str, message: str, **extra) -> dict:
    return {**spec.as_row(), **facts_of(spec.model), "status": status, "error": message, **extra}


def _describe(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" (at {last.filename}:{last.lineno})" if last else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"


def run_set(specs: list[CellSpec], cache: ModelCache, repeats: int, warmup: int, extras: dict | None = None,
            trace_dir: Path | None = None, full: bool = True) -> list[tuple[dict, list[dict]]]:
    """measure_set with a failure of the whole shape (its reference, its model) turned into every cell's row: `oom`
    for every allocation failure (with the size asked for), else `error`. Unavailable backends never get here: the
    sweep's preflight records them."""
    started = time.time()
    devices.keep_memory()  # every cell timed in a process that keeps its memory (devices.keep_memory)
    dev = devices.get(specs[0].device)
    try:
        out = measure_set(specs, cache, repeats, warmup, extras, trace_dir, full)
    except ReferenceFailed as e:
        out = [(failed_cell(s, "oom" if e.oom else "error", str(e)), []) for s in specs]
    except Exception as e:  # any failure of the shape becomes its cells' rows; the run goes on
        oom = devices.oom_message(e)
        out = [(failed_cell(s, "oom" if oom else "error", oom or _describe(e)), []) for s in specs]
    finally:
        with dev.guard():
            dev.release()
    # where and how it ran: host, device name and UUID, and torch's intra-op threads in the process that measured it
    # (Ray's CPU workers run one each, whatever the driver's environment says); the shape's wall time shared out
    for cell, _ in out:
        cell.update(dev.identity(), torch_threads=torch.get_num_threads(), wall_s=(time.time() - started) / len(out))
    return out

