"""profiler.profile: a user's own generation profiled as it runs, around the code they already have.

    with profile(pipe, out="results") as prof:
        images = pipe(prompt, num_inference_steps=30).images
    prof.calls, prof.components, prof.run_dir; print(prof)

The target is a diffusers pipeline (its components: unet, controlnet, vae, text and image encoders) or any module
that holds diffusers Attention modules (a U-Net, a ControlNet, a VAE: the component `model`). Every attention call is
recorded at the call itself (recorder.Recorder: hooks on each Attention module, the measuring core that attnprof run
uses too), so whatever processor runs is recorded and left in place: the user's, one a pipeline sets mid-call
(perturbed-attention guidance), IP-Adapter's modules; with backend=NAME that backend's processors are swapped in for
the generation and the user's restored after. The output is the same as an unprofiled run's: nothing is changed.

- time: on the CPU a host clock per call and per component forward; on CUDA each call's time is its kernels' (the
  profiler's CUPTI durations over the generation, credited to the call by correlation id, as attnprof run times a
  call: no synchronize per call), with the host's time in it beside (host_ms); a component's forward by CUDA
  events. The profiler's own cost is in the host's times and the wall time, not in the kernels';
- where a call's time went, its attention core apart from its projections, in one pair of columns on both devices:
  on CUDA attn_kernel_ms, the kernels of its core (trace.py), and proj_kernel_ms, its other kernels (to_q, to_k,
  to_v, to_out, layout copies); on the CPU proj_kernel_ms, its projection modules' own time (to_q, to_k, to_v,
  to_out[0], the added-KV ones, CLIP's q/k/v/out_proj: probes.ProjectionClock, hooks on the CPU only), and
  attn_kernel_ms the rest of its host time (the core, with the reshapes and norms around it): the two sum to
  time_ms. The hooks cost a forward of tiny-sd15 on the CPU 2-3% (0.5-0.6 ms of 24 ms: profile()
  runs with them and without, interleaved);
- memory: on CUDA the allocator's peak per call over what it began with (its statistics, no synchronize); on the
  CPU none (that takes the profiler's allocation trace: attnprof run measures it in a probe pass), as the notes say;
- generation: each call of the target pipeline in the block is one (its class's __call__ wrapped for the block to
  note where each begins and its wall time; a module target's forwards at one shape are one); step: the index of
  the denoiser's forward (the U-Net's, a ControlNet's) the call ran in, from 0 in each generation; empty outside the
  loop;
- a compiled component (torch.compile, compile_repeated_blocks) keeps its compiled graph: its forwards are timed, its
  attention calls are not recorded one by one (hooks inside it would change what is compiled), and a note says so;
- trace=True: a Chrome / Perfetto trace of the generation in the run, each attention call a range named by its
  component, block and shape.

The run it stores (out=None: none) is a run of kind `record` (store.RUN_KINDS): a cell per distinct pipeline,
denoiser, dtype, size and batch (cells.py: generations at two sizes are never samples of one another), one block row
per call of a forward with the per-forward times as its samples, and every call with its step in
calls-<cell_id>.parquet.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

from ..attention import backends, mix
from ..attention.apply import elsewhere
from .. import devices
from ..measure.probes import CallTimer, ProjectionClock, traced
from ..measure.trace import call_samples, events
from ..planner.calibration import public_config
from ..attention.recorder import (Recorder, attention_modules, clip_attention_modules, projection_modules,
                                  unrecorded_attention)
from ..spec import InputError
from .cells import DENOISERS, Profile, store
from .summary import components_of

LOOP = ("unet", "controlnet", "transformer", "prior", "model")  # components that run once per denoising step
CALL_COLUMNS = ["component", "block", "generation", "step", "pass_index", "call_index", "kind", "batch", "heads",
                "head_dim", "tokens_q", "tokens_k", "ip_tokens_k", "score_elements", "score_bytes", "flops", "time_ms",
                "host_ms", "attn_kernel_ms", "proj_kernel_ms", "peak_bytes", "faulted_bytes", "stage", "level", "upcast"]


def components(target) -> dict[str, torch.nn.Module]:
    """The modules to profile by name: a pipeline's nn.Module components (diffusers' `components`), or the target
    itself as `model`."""
    if isinstance(target, torch.nn.Module):
        return {"model": target}
    found = {name: m for name, m in (getattr(target, "components", None) or {}).items()
             if isinstance(m, torch.nn.Module)}
    if not found:
        raise InputError(f"profile: {type(target).__name__} is neither a diffusers pipeline nor a torch module: give "
                         "the pipeline (pipe) or one of its models (pipe.unet)")
    return found


def compiled(module: torch.nn.Module) -> bool:
    """Whether the module, or a block of it, runs compiled (torch.compile's wrapper, or nn.Module.compile as
    diffusers' compile_repeated_blocks does it)."""
    return type(module).__name__ == "OptimizedModule" or any(
        m._compiled_call_impl is not None for m in module.modules() if hasattr(m, "_compiled_call_impl"))


def pass_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """What a forward of the component is: a VAE's encoder and decoder (pipelines call vae.decode, not its
    forward), else the module itself."""
    parts = [getattr(module, p, None) for p in ("encoder", "decoder")]
    if type(module).__name__.startswith("Autoencoder") and all(isinstance(p, torch.nn.Module) for p in parts):
        return parts
    return [module]


def _device(target, found: dict) -> torch.device:
    """Where the generation runs: its components' device; a pipeline whose components wait on the CPU for
    offloading (their parameters there, CUDA here) runs on its _execution_device (a walk of diffusers' offload
    hooks: 10 ms, so only then)."""
    params = (p for m in found.values() for p in m.parameters())
    device = next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))
    if device.type == "cpu" and torch.cuda.is_available() and not isinstance(target, torch.nn.Module):
        device = getattr(target, "_execution_device", device)
    return torch.device(device)


def meter(device, trace: bool = False) -> CallTimer:
    """A generation's meter of calls: each on the host's clock (on the CPU the device's; on CUDA the host's own time in
    the call, its kernels read from the trace by its range: rows()), the allocator's peak per call where the device
    counts one, on the CPU the new pages each touched (faulted_bytes: whichever of glibc's moving thresholds gave
    them), a named range per call with trace and always on CUDA. On the CPU it times the component forwards too."""
    dev = devices.get(device)
    return CallTimer(dev, peaks=True, ranges=trace or dev.kernel_clock, key="uid", name=_range_name, faults=True,
                     meter="host" if dev.kernel_clock else "device")


def _range_name(row: dict) -> str:
    """A trace range's name: 'unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1 2x4096x4096' (component,
    block, batch x query tokens x key tokens) for an attention call, 'unet forward' for a component's forward."""
    if row["block"] == "forward":
        return f"{row['component']} forward"
    return f"{row['component']}.{row['block']} {row['batch']}x{row['tokens_q']}x{row['tokens_k']}"


class _Tagged:
    """The meter of one component: each row tagged with the component and a key unique in the session, then told
    to the session's one CallTimer (and, on the CPU, to its ProjectionClock: the call open around its projections)."""

    def __init__(self, meter: CallTimer, component: str, uid, projections: ProjectionClock | None = None):
        self.meter, self.component, self.uid, self.projections = meter, component, uid, projections

    def before(self, row: dict) -> None:
        row["component"], row["uid"] = self.component, next(self.uid)
        if self.projections:
            self.projections.opened(row["uid"])
        self.meter.before(row)

    def after(self, row: dict) -> None:
        self.meter.after(row)
        if self.projections:
            self.projections.closed()


class Session:
    """The hooks of one profiled generation: a Recorder per component with attention modules (its calls), a timed
    forward per component, the backend's processors where one is asked for."""

    def __init__(self, target, backend: str | None = None, options: dict | None = None, trace: bool = False):
        self.target, self.found = target, components(target)
        self.device = _device(target, self.found)
        self.backend, self.options, self.trace = backend, options or {}, trace
        if backend:
            backends.check_backend_name(backend)
            options = backends.check_options(backend, self.options)
            self.factory = lambda: backends.make_processor(backend, **options)  # noqa: E731
        self.meter = meter(self.device, trace)
        self.kernels = self.meter.device.kernel_clock  # CUDA: calls' kernels from the trace of the generation
        self.projections = None if self.kernels else ProjectionClock(self.meter.clock)  # the CPU: hooks time them
        self.forward_meter = CallTimer(self.meter.device, key="uid") if self.kernels else self.meter  # by events
        self.uid = itertools.count()
        self.recorders: dict[str, Recorder] = {}
        self.modules = {name: attention_modules(m) for name, m in self.found.items()}  # each component's, by path
        denoiser = self.modules.get("unet") or self.modules.get("model")
        if backend and mix.is_map(backend) and denoiser:  # a map tuned for another model: one line
            line = elsewhere(options, denoiser)
            if line:
                warnings.warn(line, stacklevel=2)
        self.unrecorded: dict[str, str] = {}  # component: its attention modules that no hook records, counted
        self.forwards: list[dict] = []
        self.notes: list[str] = []
        self.facts: dict = {}
        self._open: list[dict] = []
        self.calls: list[dict] = []  # each generation: the first uid in it, when it began, its wall time
        self.latents: dict[int, tuple] = {}  # each generation's latent shape: its denoiser's first sample's
        self.module = isinstance(target, torch.nn.Module)  # a module target: a generation per run of one shape
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Session":
        try:
            if self.module:
                self._begin_generation()
            self._mark_calls()
            for name, module in self.found.items():
                self._component(name, module)
            if self.trace or self.kernels:
                self.prof = self._stack.enter_context(traced(self.meter.device, memory=False, shapes=self.trace))
        except BaseException:
            self._stack.close()
            raise
        return self

    def _mark_calls(self) -> None:
        """Each call of the target pipeline a generation of its own: its class's __call__ wrapped for the block
        (put back on exit) to note where each call begins (the next row's uid) and its wall time. Calls of other
        pipelines, and a call inside a call, pass through; a module target has one generation."""
        owner = next((k for k in type(self.target).__mro__ if "__call__" in vars(k)), None)
        if isinstance(self.target, torch.nn.Module) or owner is None or owner is object:
            return
        original, session = vars(owner)["__call__"], self

        def __call__(pipe, *args, **kwargs):
            if pipe is not session.target or getattr(session, "_inside", False):
                return original(pipe, *args, **kwargs)
            session._inside = True
            session._begin_generation()
            try:
                return original(pipe, *args, **kwargs)
            finally:
                session._end_generation()
                session._inside = False

        owner.__call__ = __call__
        self._stack.callback(setattr, owner, "__call__", original)

    def _component(self, name: str, module: torch.nn.Module) -> None:
        passes = pass_modules(module)
        inside = [p for p in passes if getattr(p, "_compiled_call_impl", None) is not None]  # module.compile()
        if inside:
            self.notes.append(f"{name} was compiled with module.compile(): its forwards are not timed and its "
                              "attention calls not recorded (a hook on it runs inside its compiled graph and would "
                              "change what is compiled); torch.compile(module) leaves its forwards timeable")
            self._not_recorded(name, {**self.modules[name], **clip_attention_modules(module)})
            return
        for part in passes:
            self._stack.callback(part.register_forward_pre_hook(self._forward_begins(name), with_kwargs=True).remove)
            self._stack.callback(part.register_forward_hook(self._forward_ends, always_call=True).remove)
        modules = self._recordable(name, module)
        if not modules:
            return
        if compiled(module):
            self.notes.append(f"{name} runs compiled: its forwards are timed, its attention calls are not recorded "
                              "one by one (hooks inside the compiled graph would change what is compiled); attnprof "
                              "run --compile measures a compiled U-Net's calls")
            self._not_recorded(name, modules)
            return
        if self.backend:
            foreign = sorted({type(m.processor).__name__ for m in self.modules[name].values()
                              if type(m.processor).__name__.startswith(("IPAdapter", "CustomDiffusion"))})
            if foreign:
                raise InputError(f"profile: backend={self.backend!r} would replace {name}'s {', '.join(foreign)} "
                                 "processors, and with them what they add: profile with backend=None (the loaded "
                                 "processors)")
        rec = Recorder(module, processor=self.factory if self.backend else None, label=name,
                       around=_Tagged(self.meter, name, self.uid, self.projections), passes=passes, modules=modules,
                       step="step" if name in LOOP else "forward")
        self.recorders[name] = self._stack.enter_context(rec)
        if self.projections:
            self.projections.hook([p for m in modules.values() for p in projection_modules(m)], self._stack)

    def _recordable(self, name: str, module: torch.nn.Module) -> dict:
        """The component's attention modules that the recorder's hooks record (diffusers' Attention, transformers'
        CLIP attention), by path; the others named in the notes and kept in `unrecorded`."""
        clip = clip_attention_modules(module)
        unknown = unrecorded_attention(module)
        if unknown:
            self.unrecorded[name] = _counted(unknown)
            self.notes.append(f"{name}'s attention modules {self.unrecorded[name]} are not recorded (attnprof records "
                              "diffusers' Attention and transformers' CLIP attention): their calls and time are in "
                              f"no attention figure of {name}")
        if clip and self.backend:
            self.notes.append(f"{name}'s attention (CLIP's, x{len(clip)}) runs as transformers runs it: "
                              f"backend={self.backend!r} replaces diffusers' processors only")
        return {**self.modules[name], **clip}

    def _not_recorded(self, name: str, modules: dict) -> None:
        """A component whose attention modules are all left unrecorded (compiled): named in `unrecorded`."""
        counts: dict[str, int] = {}
        for m in modules.values():
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        if counts:
            self.unrecorded[name] = _counted(counts)

    def _begin_generation(self, uid: int | None = None) -> None:
        """A generation begins: a call of the target pipeline, or (a module target) the block, and each forward of
        its denoiser at a shape other than the last one's. uid: the first row in it (default: the next)."""
        if self.module and self.calls:
            self._end_generation()
        self.calls.append({"uid": next(self.uid) if uid is None else uid, "t0": time.perf_counter(), "wall_s": None})

    def _end_generation(self) -> None:
        self.meter.device.synchronize()
        self.calls[-1]["wall_s"] = time.perf_counter() - self.calls[-1]["t0"]

    def _latent(self, sample, uid: int) -> None:
        """A denoiser forward's sample: its generation's latent shape where it has none yet (a module target's next
        forward at another shape begins a generation of its own)."""
        if not (isinstance(sample, torch.Tensor) and sample.ndim >= 4):
            return
        shape = tuple(sample.shape)
        if self.module and self.latents and self.latents[len(self.calls) - 1] != shape:
            self._begin_generation(uid)
        self.latents.setdefault(max(0, len(self.calls) - 1), shape)
        self.facts.setdefault("dtype", str(sample.dtype).removeprefix("torch."))

    def _forward_begins(self, name: str):
        def begin(module, args, kwargs) -> None:
            row = {"component": name, "uid": next(self.uid), "block": "forward"}
            if name in DENOISERS:
                self._latent(kwargs.get("sample", args[0] if args else None), row["uid"])
            self.forwards.append(row)
            self._open.append(row)
            self.forward_meter.before(row)
        return begin

    def _forward_ends(self, module, args, output) -> None:
        self.forward_meter.after(self._open.pop())

    def __exit__(self, *exc) -> None:
        """The hooks removed, the user's processors back. A Ctrl-C inside a forward leaves it open (KeyboardInterrupt
        passes by forward hooks, always_call's too): `cut` is then the first row of it, the rows from there on those
        of a step that never ended (ended()), and its meters' ranges are closed."""
        self.cut = min((r["uid"] for r in self._open), default=None)
        self._stack.close()
        while self._open:
            self.forward_meter.after(self._open.pop())

    def ended(self, rows: list[dict]) -> list[dict]:
        """The rows (attention calls, forwards) of the steps that ended: those before `cut`."""
        return [r for r in rows if self.cut is None or r["uid"] < self.cut]

    def rows(self) -> list[dict]:
        """Every attention call of the steps that ended, in order, with its component, step, time (on CUDA its
        kernels') and (CUDA) peak; where its time went (split()): attn_kernel_ms, its attention core's, and
        proj_kernel_ms, its projections'."""
        self.meter.collect()
        if self.forward_meter is not self.meter:
            self.forward_meter.collect()
        windows = call_samples(events(self.prof), self.meter.ranges) if self.kernels else {}
        out = []
        for name, rec in self.recorders.items():
            for r in rec.rows:
                host = self.meter.samples.get(r["uid"], [float("nan")])[0]
                seen = (windows.get(r["uid"]) or [{}])[0] if self.kernels else self.split(r["uid"], host)
                out.append({**{k: v for k, v in r.items() if k != "uid"},
                            "block": r["block"] if name in ("unet", "model") else f"{name}.{r['block']}",
                            "step": r["pass_index"] if name in LOOP else None,
                            "time_ms": (seen.get("gpu_time_ms") or 0.0) if self.kernels else host, "host_ms": host,
                            "attn_kernel_ms": seen.get("attn_kernel_ms"), "proj_kernel_ms": seen.get("proj_kernel_ms"),
                            "peak_bytes": self.meter.peak.get(r["uid"]),
                            "faulted_bytes": self.meter.faulted.get(r["uid"]), "uid": r["uid"]})
        return sorted(self.ended(out), key=lambda r: r["uid"])

    def split(self, uid: int, host_ms: float) -> dict:
        """On the CPU, where a call's host time went: proj_kernel_ms, its projections' (ProjectionClock: to_q, to_k,
        to_v, to_out[0], ..., on the clock of its own time), and attn_kernel_ms, the rest (its attention core, with
        the reshapes and norms around it); None where none of its projections ran (a module without any)."""
        proj = self.projections.ms.get(uid) if self.projections else None
        if not proj or host_ms != host_ms:
            return {}
        return {"attn_kernel_ms": max(0.0, host_ms - proj), "proj_kernel_ms": proj}


def _counted(classes: dict[str, int]) -> str:
    """Modules counted by class, as the output names them: 'Attention x32, T5Attention x24'."""
    return ", ".join(f"{k} x{v}" for k, v in sorted(classes.items()))


def _component_table(session: Session) -> pd.DataFrame:
    """Per component what it is: its class, whether its attention is recorded (`recorded`) and the modules of it
    that are not (`not_recorded`: compiled, or of a kind the recorder has no hook for); its figures come from the
    calls and forwards (components_of)."""
    return pd.DataFrame([{"component": name, "class": type(m).__name__,
                          "recorded": name in session.recorders or name not in session.unrecorded,
                          "not_recorded": session.unrecorded.get(name, "")} for name, m in session.found.items()])


@contextlib.contextmanager
def profile(target, out: str | Path | None = "results", backend: str | None = None, options: dict | None = None,
            trace: bool = False, command: str = "profiler.profile"):
    """Profile what runs inside the block: a diffusers pipeline or a module holding diffusers Attention modules.
    Yields a Profile, filled when the block ends (its calls, components, summary and the stored run under `out`;
    out=None stores none). backend=NAME runs the block with that backend's processors and restores the user's.
    A Ctrl-C in the block: the steps that ended are kept (the one under way dropped), stored as a partial cell of a
    run marked interrupted, said in one line on stderr, and the KeyboardInterrupt goes on up."""
    prof, stopped = Profile(target=type(target).__name__), None
    session = Session(target, backend, options, trace)
    with session:
        t0 = time.perf_counter()
        try:
            yield prof
        except KeyboardInterrupt as e:
            stopped = e
        session.meter.device.synchronize()
        prof.wall_s = time.perf_counter() - t0
        if session.module:
            session._end_generation()
        session.processors = _processors(session)  # while a backend's are still in
    _fill(prof, target, session, trace, stopped is not None)
    if out is not None:
        prof.run_dir = store(prof, Path(out), command, partial=stopped is not None)
    if stopped is not None:
        if out is not None:
            print(f"profile: interrupted: {_kept(prof)}", file=sys.stderr, flush=True)
        raise stopped


def _fill(prof: Profile, target, session: Session, trace: bool, stopped: bool) -> None:
    """The Profile of the session's generation(s): its calls, forwards, generations, components, notes and facts."""
    calls = by_generation(pd.DataFrame(session.rows()), session.calls)
    prof.calls = calls[[c for c in CALL_COLUMNS if c in calls]] if len(calls) else pd.DataFrame(columns=CALL_COLUMNS)
    forwards = pd.DataFrame([{"component": f["component"], "uid": f["uid"],
                              "time_ms": session.forward_meter.samples[f["uid"]][0]}
                             for f in session.ended(session.forwards)], columns=["component", "uid", "time_ms"])
    prof.forwards = forwards.assign(generation=generation_of(forwards["uid"], session.calls))[
        ["component", "generation", "time_ms"]]
    prof.generations = _generations(session, prof.calls, prof.forwards, prof.wall_s)
    prof.components = components_of(_component_table(session), prof.calls, prof.forwards)
    prof.notes = session.notes + ([] if session.meter.peaks else [
        f"no per-call peak memory on {session.device.type}: only a CUDA allocator counts one without changing the "
        "run (attnprof run measures the CPU's in a probe pass)"])
    prof.facts = _facts(target, session, prof)
    if stopped:  # the last generation cut short: no sample of a whole generation's time (calibration.record_samples)
        prof.facts["cut_short"] = True
        prof.notes.append(f"interrupted (Ctrl-C) in generation {len(prof.generations) - 1}: its steps that ended "
                          "are kept, the one under way is not")
    prof.traces = [_trace_bytes(session)] if trace else []


def _kept(prof: Profile) -> str:
    """What a Ctrl-C in the block left: the steps kept and where they are stored."""
    steps = int(prof.generations["steps"].sum()) if len(prof.generations) else 0
    kept = f"the {steps} step{'' if steps == 1 else 's'} that ended"
    if prof.run_dir is None:
        return f"nothing stored ({kept}: no step's size is known)" if steps else "no step ended: nothing stored"
    return (f"{kept} kept as a partial cell of run {prof.run_dir.name} under {prof.run_dir.parent}, marked "
            f"interrupted (attnprof show {prof.run_dir})")


def generation_of(uids, marks: list[dict]) -> list[int]:
    """The generation each row (by its uid) ran in: where it began among the generations' first uids (a row before
    the first in the first)."""
    starts = [m["uid"] for m in marks]
    return [max(0, bisect.bisect_right(starts, uid) - 1) for uid in uids] if starts else [0] * len(uids)


def by_generation(calls: pd.DataFrame, marks: list[dict]) -> pd.DataFrame:
    """The calls with their generation (generation_of) and their step counted within it (0..N-1: the denoiser's
    forward of that generation)."""
    if not len(calls):
        return calls
    calls = calls.assign(generation=generation_of(calls["uid"], marks))
    first = calls.groupby(["generation", "component"])["step"].transform("min")
    return calls.assign(step=(calls["step"] - first).astype("Int64"))


def _generations(session: Session, calls: pd.DataFrame, forwards: pd.DataFrame, wall_s: float) -> pd.DataFrame:
    """One row per generation: its wall time, its steps (the denoiser's forwards in it: by their attention calls, or
    where none was recorded by the forwards timed) and its size (its latent shape: batch, and height and width times
    the VAE's scale; 0x0 where no denoiser forward ran in it)."""
    walls = [c["wall_s"] for c in session.calls] or [wall_s]
    loop = calls[calls["component"].isin(DENOISERS)] if len(calls) else calls
    steps = loop.groupby("generation")["step"].nunique() if len(loop) else \
        forwards[forwards["component"].isin(DENOISERS)].groupby("generation").size()
    scale = getattr(session.target, "vae_scale_factor", 8)
    rows = []
    for i, wall in enumerate(walls):
        latent = session.latents.get(i)
        rows.append({"generation": i, "wall_s": wall, "steps": int(steps.get(i, 0)),
                     "batch": int(latent[0]) if latent else 1, "height": int(latent[-2]) * scale if latent else 0,
                     "width": int(latent[-1]) * scale if latent else 0})
    return pd.DataFrame(rows, columns=["generation", "wall_s", "steps", "batch", "height", "width"])


def _facts(target, session: Session, prof: Profile) -> dict:
    """What the generation was: the pipeline, the denoiser's config hash (its public keys: diffusers' private ones,
    such as _use_default_values, come in another order in each process), its size and steps (the first
    generation's: cells_of gives each size its own), guidance, scheduler."""
    denoiser = next((session.found[n] for n in DENOISERS if n in session.found), None)
    denoiser = getattr(denoiser, "_orig_mod", denoiser)  # torch.compile's wrapper: the module it compiled
    config = {k: v for k, v in dict(getattr(denoiser, "config", {}) or {}).items() if not k.startswith("_")}
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    first = prof.generations.iloc[0] if len(prof.generations) else {"batch": 1, "width": 0, "height": 0, "steps": 0}
    return {"generations": len(prof.generations), "pipeline": type(getattr(target, "_orig_mod", target)).__name__,
            "denoiser": f"{type(denoiser).__name__} {digest}" if denoiser is not None else None,
            "source": getattr(getattr(denoiser, "config", None), "_name_or_path", None) or None,
            **{k: int(first[k]) for k in ("batch", "width", "height", "steps")},
            "dtype": session.facts.get("dtype", "float32"), "guidance": getattr(target, "_guidance_scale", None),
            "scheduler": type(getattr(target, "scheduler", None)).__name__ if hasattr(target, "scheduler") else None,
            "device": str(session.device), "processors": session.processors, "backend": session.backend,
            "time_source": "cupti" if session.kernels else "host clock",
            "configs": {name: {"class": type(m).__name__, "config": public_config(m)}
                        for name, m in session.found.items() if public_config(m)}}


def _processors(session: Session) -> str:
    counts: dict[str, int] = {}
    for modules in session.modules.values():
        for m in modules.values():
            counts[type(m.processor).__name__] = counts.get(type(m.processor).__name__, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _trace_bytes(session: Session) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        session.prof.export_chrome_trace(str(path))
        return path.read_bytes()
