"""What the time model (planner/timing.py) learns from a recorded generation (attnprof record, profiler.profile), and
which stored runs it leaves out.

A recorded generation is calibration data where its components are models the planner can trace: each component's
class and config (stored with the record) matched to a registry model (configs/models: the same class, every key the
registry's config sets equal) or to a text encoder the pipeline planner knows (planner/pipeline.py). Such a
generation gives, per matched component, its attention calls (the U-Net's and the VAE's, each call's median over
the component's forwards, under the backend the record ran: a named one, or `loaded` where every processor is
diffusers' AttnProcessor2_0, which is sdpa) and the rest of its forward (the component's time per forward less its
calls'); and once, the generation's own overhead: its wall time less every component's forwards (the scheduler,
latents, the image's post-processing), fitted to steps, pixels and a constant.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..attention import backends
from ..env import cache_dir
from ..spec import InputError, parse_dtype
from ..measure.limits import LIMIT_KEYS, machine_key
from .published import published_calibration
from .timing import (CALL_FEATURES, REST_FEATURES, Device, fit_model, forward_samples, mean_error, predict, roof_ms,
                     walked_plan)

CALIBRATION_FILE = "time-calibration.json"

GENERATION_FEATURES = ("steps", "pixels", "one")
LOADED_AS = {"AttnProcessor2_0": "sdpa", "AttnProcessor": "naive"}  # a record of loaded processors, all of one class


def passed_why(manifest: dict) -> str | None:
    """Why the time model leaves a run out, or None: a kind it is not fitted on (a replay)."""
    from ..store import kind_of

    kind = kind_of(manifest)
    return None if kind.calibrates else f"{kind.name}: not forwards of a model timed whole"


def weight(manifest: dict) -> tuple[float, str | None]:
    """A run's weight in the fit, and why it is less than 1: a run whose own calibrations say the machine moved
    while it ran by d (report/compare.unsteady) counts 1/d^2, its residuals as large as the speed it ran at."""
    from ..report.compare import drift, unsteady

    why = unsteady(manifest)
    if not why:
        return 1.0, None
    d = drift(manifest)
    return 1 / d ** 2, f"weighted 1/{d ** 2:.2f}: {why}"


def _same(a, b) -> bool:
    norm = lambda v: [norm(x) for x in v] if isinstance(v, (list, tuple)) else v  # noqa: E731
    return norm(a) == norm(b)


def public_config(module: torch.nn.Module) -> dict:
    """A component's public config as JSON holds it (diffusers' config, transformers' to_dict()): what the time
    model matches to a model it can trace."""
    config = getattr(module, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return json.loads(json.dumps({k: v for k, v in config.items() if not str(k).startswith("_")}, default=str))


def named(cls: str, config: dict) -> str | None:
    """The registry model or text encoder whose config this component's is, or None."""
    from ..unet import kinds, models
    from .pipeline import TEXT_ENCODERS

    found = [(len(c), name) for name, kind, c in models.registry_configs()
             if kinds.KINDS[kind].cls == cls and all(_same(config.get(k), v) for k, v in c.items())]
    found += [(len(c), name) for name, (text_cls, c) in TEXT_ENCODERS.items()
              if text_cls == cls and all(_same(config.get(k), v) for k, v in c.items())]
    return max(found)[1] if found else None


def record_backend(cell: dict) -> str | None:
    """The backend whose calls a recorded cell timed: the one it ran, or what its loaded processors are."""
    if cell["backend"] in backends.BACKENDS:
        return cell["backend"]
    kinds = [part.split(" x")[0] for part in str(cell.get("processors") or "").split(", ") if part]
    return LOADED_AS.get(kinds[0]) if len(set(kinds)) == 1 else None


def record_samples(run, manifest: dict, keep=None) -> tuple[list[dict], list[dict]]:
    """The time model's samples from a recorded generation (module docstring): (attention calls, rests), the rests
    holding one `generation` sample per cell."""
    from ..spec import InputError

    facts = manifest.get("record") or {}
    names = {c: named(v["class"], v["config"]) for c, v in (facts.get("configs") or {}).items()}
    table, blocks = run.read()
    calls, rests = [], []
    for cell in (table[table["status"] == "ok"] if len(table) else table).to_dict("records"):
        if keep and not keep(cell):
            continue
        backend = record_backend(cell)
        comps = json.loads(cell.get("components") or "[]")
        for comp in comps:
            model = names.get(comp["component"])
            if not model or not comp["forwards"]:
                continue
            try:
                c, r = _component_samples(model, comp, cell, blocks, manifest, backend)
            except InputError:
                continue
            calls += c if backend else []
            rests.append(r)
        if ((facts.get("cells") or {}).get(cell["cell_id"]) or {}).get("cut_short"):
            continue  # its last generation cut short by a Ctrl-C (profile keeps its steps): no whole generation
        generations = int(facts.get("generations") or 1)
        outside = cell["generation_s"] * 1e3 - sum(c["time_ms"] for c in comps)
        rests.append({"component": "generation", "cell_id": cell["cell_id"], "steps": float(cell["steps"] or 0),
                      "pixels": float(cell["width"] * cell["height"] * images(cell, blocks)), "one": 1.0,
                      "overhead_ms": outside / generations, "floor_ms": 0.0})
    return calls, rests


def images(cell: dict, blocks) -> int:
    """How many images the generation decoded: the VAE's batch where it has attention calls, else the cell's."""
    vae = blocks[(blocks["cell_id"] == cell["cell_id"]) & (blocks.get("component") == "vae")] \
        if "component" in blocks else blocks.iloc[0:0]
    return int(vae["batch"].iloc[0]) if len(vae) else int(cell["batch"])


def _component_samples(model: str, comp: dict, cell: dict, blocks, manifest: dict,
                       backend: str | None) -> tuple[list[dict], dict]:
    """One component's samples: its calls (under backend) and its rest per forward."""
    from .pipeline import TEXT_ENCODERS, text_ops

    per_forward = comp["time_ms"] / comp["forwards"]
    cell_id = cell["cell_id"]
    if model in TEXT_ENCODERS:
        device = Device.of(manifest, cell["dtype"])
        ops = text_ops(model, cell["dtype"], images(cell, blocks))
        return [], {**device.rest_features(ops), "floor_ms": roof_ms(ops, device), "cell_id": cell_id,
                    "dtype": cell["dtype"], "component": comp["component"], "rest_ms": per_forward}
    rows = blocks[(blocks["cell_id"] == cell_id) & (blocks["component"] == comp["component"])] \
        .sort_values("call_index").to_dict("records")
    batch = int(rows[0]["batch"]) if rows else images(cell, blocks)
    attention = comp["attention_ms"] / comp["forwards"]
    forward = {**cell, "batch": batch, "backend": backend or "sdpa", "backend_options": "{}",
               "forward_time_ms": per_forward, "attention_time_ms": attention}
    calls, rest = forward_samples(model, forward, rows, manifest, (), cell_id)
    calls = [{**c, "component": comp["component"]} for c in calls]
    return calls, {**rest, "component": comp["component"], "forward_time_ms": per_forward,
                   "attention_time_ms": attention}


def fit_generation(rests: list[dict]) -> dict | None:
    """The generation's own overhead fitted to its samples (None where no recorded generation gave one)."""

    found = [r for r in rests if r.get("component") == "generation"]
    return fit_model(found, GENERATION_FEATURES, "overhead_ms") if found else None


def _settings(cell: dict) -> tuple:
    return tuple(sorted(json.loads(cell["settings"]).items()))


def samples(results: Path, key: str, passed: dict | None = None,
            keep=None) -> tuple[list[dict], list[dict], dict, list[str]]:
    """From every ok cell of the runs under results measured on the machine of this limits key (limits.machine_key:
    a run of ours, whose process keeps its memory, and a user's recorded generation, whose does not, each sample
    priced on its own run's limits): (one sample per attention call, one per forward's rest, the device's limits
    from the latest run of this very key, the run ids). Sweep cells give the U-Net's calls and rest; recorded
    generations (calibration.py) each component's and the generation's own overhead. A run of a kind the time model
    is not fitted on (store.RUN_KINDS: a replay), or is passed over and named in `passed` (run id -> why); one whose
    calibrations say the machine moved while it ran is weighted down (calibration.weight) and named there too.
    keep(cell) -> bool, where given, chooses the cells (a held-out test leaves some out)."""
    from ..store import Unreadable, kind_of, readable_runs

    calls, rests, limits, runs = [], [], {}, []
    for run, manifest in readable_runs(Path(results)):
        why = passed_why(manifest)
        if why:
            if passed is not None:
                passed[run.id] = why
            continue
        w, why = weight(manifest)
        own = (manifest.get("device_limits") or {}).get("key")
        if not own or machine_key(own) != machine_key(key) or not manifest.get("device_peak_bytes_per_s"):
            continue
        if own == key:  # the limits are the key's own (a process that keeps its memory pays no new pages)
            limits = {k: manifest[k] for k in LIMIT_KEYS if k in manifest}
        reader = record_samples if kind_of(manifest).name == "record" else _sweep_samples
        try:
            c, r = reader(run, manifest, keep)
        except Unreadable as e:  # its cells or blocks torn: passed over, named
            if passed is not None:
                passed[run.id] = f"unreadable: {e}"
            continue
        runs.append(run.id)
        if why and passed is not None:
            passed[run.id] = why
        calls += [{**s, "run": run.id, "weight": w} for s in c]
        rests += [{**s, "run": run.id, "weight": w} for s in r]
    return calls, rests, limits, runs


def _sweep_samples(run, manifest: dict, keep=None) -> tuple[list[dict], list[dict]]:
    table, blocks = run.read()
    ok = table[table["status"] == "ok"] if len(table) else table
    calls, rests = [], []
    for cell in ok.to_dict("records"):
        if keep and not keep(cell):
            continue
        if cell["backend"] not in backends.BACKENDS or not cell.get("attention_time_ms") == \
                cell.get("attention_time_ms"):  # a plugin's backend not loaded here; no attention time (fused)
            continue
        rows = blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index").to_dict("records")
        try:
            c, r = forward_samples(cell["model"], cell, rows, manifest, _settings(cell))
        except InputError:  # its model no longer resolves here (a file moved, a hub id not cached)
            continue
        calls += c
        rests.append({**r, "component": "unet", "forward_time_ms": cell["forward_time_ms"],
                      "attention_time_ms": cell["attention_time_ms"]})
    return calls, rests


def calibrate(results: Path, key: str, write: bool = True, keep=None, host_us=None) -> dict | None:
    """The time model of the device of this limits key, fitted to its stored runs under results (None where it has
    none): {"key", "runs", "limits", "backends": {group: fit}, "rest": {dtype: fit}, "generation": fit or None,
    "passed_over": {run: why}}, each backend's fit with its leave-one-out error of the forward too. Written to the
    calibration file under the key."""
    passed: dict[str, str] = {}
    cuda = kernel_calibration(results, key, host_us)
    if cuda is not None:
        return cuda
    calls, rests, limits, runs = samples(results, key, passed, keep)
    if not rests:
        return None
    odd = outlier(calls, rests)
    if odd:
        run, error, others = odd
        calls, rests = [c for c in calls if c["run"] != run], [r for r in rests if r["run"] != run]
        runs = [r for r in runs if r != run]
        passed[run] = (f"its leave-one-out error {error:.0f}% is over {OUTLIER_TIMES:g}x the other runs' median "
                       f"{others:.0f}%: left out of the fit (an odd size or a machine that moved; move "
                       f"{Path(results) / run} out of {results} to keep it out for good)")
    out = {"key": key, "results": str(results), "runs": runs, "limits": limits, "backends": {}, "rest": {},
           "passed_over": passed, "generation": fit_generation(rests)}
    for dtype in sorted({c["dtype"] for c in rests if "dtype" in c}):
        fitted = fit_model([c for c in rests if c.get("dtype") == dtype], REST_FEATURES, "rest_ms")
        out["rest"][dtype] = fitted
    for group in sorted({c["group"] for c in calls}):
        fitted = fit_model([c for c in calls if c["group"] == group], CALL_FEATURES, "time_ms")
        fitted["loo_forward"] = _forward_loo(fitted, [c for c in calls if c["group"] == group], rests, out["rest"])
        fitted["loo_forward_error_pct"] = mean_error(fitted["loo_forward"])
        fitted["runs"] = len({c["run"] for c in calls if c["group"] == group})
        out["backends"][group] = fitted
    if write:
        from ..store import add_to_cache

        add_to_cache(calibration_path(), key, _lean(out))
    return out


OUTLIER_TIMES = 5.0  # a run whose leave-one-out error is over this many times the others' median is left out


def outlier(calls: list[dict], rests: list[dict]) -> tuple[str, float, float] | None:
    """The run the fit leaves out, its leave-one-out error and the other runs' median (percent), or None. Each run
    is left out whole and predicted from a fit to the others: its calls per backend group, its rests per dtype, its
    error the largest of those, a prediction p of a measured m off by max(p/m, m/p) - 1 (a run 8x slower or 8x
    faster than predicted: 700% either way, where |p - m| / m calls the slower one 88%). The worst run is left out
    where there are three or more and its error is over MAX_ERROR_PCT and over OUTLIER_TIMES x the others' median;
    once: the rest are the fit's (issue 64: one run at 8x8 among tiny-sd15's others made every prediction after it
    'no prediction (leave-one-out error 756%)', naming no run)."""
    from .timing import MAX_ERROR_PCT

    parts = [([c for c in calls if c["group"] == g], CALL_FEATURES, "time_ms") for g in {c["group"] for c in calls}]
    parts += [([r for r in rests if r.get("dtype") == d], REST_FEATURES, "rest_ms")
              for d in {r["dtype"] for r in rests if "dtype" in r}]
    errors: dict[str, float] = {}
    for mine, features, target in parts:
        for e in fit_model(mine, features, target, group="run")["loo"]:
            p, m = e["predicted_ms"], e["measured_ms"]
            off = 100 * (max(p / m, m / p) - 1) if p > 0 and m > 0 else 0.0
            errors[e["cell_id"]] = max(errors.get(e["cell_id"], 0.0), off)
    if len(errors) < 3:
        return None
    worst = max(errors, key=errors.get)
    others = float(np.median([v for r, v in errors.items() if r != worst]))
    return (worst, errors[worst], others) if errors[worst] > max(MAX_ERROR_PCT, OUTLIER_TIMES * others) else None


def kernel_calibration(results: Path, key: str, host_us=None) -> dict | None:
    """The time model of a CUDA device of this limits key (planner/kernels.py): each attention kernel fitted to the
    kernel times its stored runs under results hold (never their event times), on its measured limits; the rest of a
    forward fitted to its forwards' kernels less their attention calls' (cuda_forwards); the host's time per op
    (box_host). The cells refused and a fit resting on one cell named in passed_over. None where no CUDA run has the
    key."""
    from ..store import readable_runs
    from . import kernels

    rows, passed = kernels.stored_rows(results, key=key)
    if not len(rows):
        return None
    limits = next(({k: m[k] for k in LIMIT_KEYS if k in m} for _, m in reversed(readable_runs(Path(results)))
                   if (m.get("device_limits") or {}).get("key") == key), {})
    admitted, refused = kernels.admit(rows)
    out = {"key": key, "results": str(results), "runs": sorted(set(rows["run_id"])), "limits": limits,
           "backends": {}, "rest": {}, "generation": None, "kernels": {}, "kernel_source": "",
           "passed_over": {line.split(": ", 1)[0]: line.split(": ", 1)[-1] for line in passed + refused}}
    rests, hosts = cuda_forwards(results, key, set(zip(admitted["run_id"], admitted["cell_id"])))
    for dtype in sorted({r["dtype"] for r in rests}):
        out["rest"][dtype] = fit_model([r for r in rests if r["dtype"] == dtype], REST_FEATURES, "rest_ms")
    out["host"] = box_host(hosts, host_us, results)
    s = []
    for dtype, mine in admitted.groupby("dtype") if len(admitted) else []:
        s += kernels.samples(mine, Device.of(limits, dtype))
    try:
        fitted = kernels.fit(s)
    except InputError as e:
        out["passed_over"]["fit"] = str(e)
        out["kernel_source"] = "roofline bound on this device's measured limits (no admitted fit)"
        return out
    out["kernels"] = {k: kernels.coefficients(fitted, k) for k in fitted["kernels"]}
    rest = "; the rest of a forward fitted to " + ", ".join(f"{f['cells']} forwards' kernels ({d})"
                                                            for d, f in out["rest"].items()) if out["rest"] else \
        "; the rest of a forward at its roofline (no stored forward with its kernels' time, forward_gpu_ms)"
    out["kernel_source"] = (f"kernel times of {fitted['cells']} cells ({fitted['calls']} calls) in "
                            f"{len(out['runs'])} runs of this device{rest}")
    return out


def cuda_forwards(results: Path, key: str, admitted: set) -> tuple[list[dict], list[dict]]:
    """From the admitted cells ((run id, cell id)) of the CUDA runs under results of this limits key, timed by their
    kernels (time_source cupti) with their forward's kernels (forward_gpu_ms): (one sample per forward's rest, its
    rest_ms the forward's kernels less its attention calls' (attention_time_ms: each call's kernels, projections
    included), the walk's features on the device's limits; one per host-bound forward (bound "host": the GPU busy
    under passes.BUSY_SHARE of it), its host's us an op: its plain forward's time over its ops (host.forward_ops))."""
    from ..store import kind_of, readable_runs
    from .forward import walk
    from .host import forward_ops

    rests, hosts = [], []
    for run, m in readable_runs(Path(results)):
        if (m.get("device_limits") or {}).get("key") != key or not kind_of(m).calibrates or \
                kind_of(m).name == "record":
            continue
        cells, blocks = run.read()
        for cell in cells.to_dict("records"):
            if (run.id, cell["cell_id"]) not in admitted or cell.get("time_source") != "cupti" or \
                    not _known(cell.get("forward_gpu_ms")) or not _known(cell.get("attention_time_ms")):
                continue
            mine = blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index").to_dict("records")
            try:
                _, rest = forward_samples(cell["model"], {**cell, "forward_time_ms": cell["forward_gpu_ms"]}, mine,
                                          m, _settings(cell))
            except InputError:  # its model no longer resolves here, or its calls are not the walk's
                continue
            rests.append({**rest, "cell_id": f"{run.id} {cell['cell_id']}"})
            if cell.get("bound") == "host" and _known(cell.get("forward_time_ms")):
                w = walk(cell["model"], int(cell["width"]), int(cell["height"]), int(cell["batch"]), cell["dtype"],
                         _settings(cell))
                ops = forward_ops(w, cell["backend"], json.loads(cell["backend_options"] or "{}"), cell["dtype"])
                hosts.append({"cell": f"{run.id} {cell['cell_id']}", "us_per_op": cell["forward_time_ms"] * 1e3 / ops})
    return rests, hosts


def _known(v) -> bool:
    return v is not None and v == v


def box_host(hosts: list[dict], given, results: Path) -> dict:
    """A GPU box's host, in us an op: given (--host-us-per-op), else the median over its stored host-bound forwards
    (cuda_forwards), else this machine's own (host.host_us_per_op: the box's CPU), each said."""
    import statistics

    from .host import HERE, host_us_per_op

    if given is None and hosts:
        us = statistics.median(h["us_per_op"] for h in hosts)
        return {"us_per_op": us, "source": f"this GPU box's host, {us:.1f} us an op: the median over its {len(hosts)} "
                                           f"host-bound forwards under {results} (each plain forward's time over its "
                                           "ops)"}
    us, source = host_us_per_op(HERE if given is None else given)
    return {"us_per_op": us, "source": source + ("" if given is not None else
                                                 " (no host-bound forward stored under the results)")}


def _lean(out: dict) -> dict:
    """The calibration as stored: without the per-sample predictions."""
    strip = lambda f: {k: v for k, v in f.items() if k != "predicted"} if f else f  # noqa: E731
    return {**out, "backends": {g: strip(f) for g, f in out["backends"].items()},
            "rest": {d: strip(f) for d, f in out["rest"].items()}, "generation": strip(out["generation"])}


def _forward_loo(fitted: dict, calls: list[dict], rests: list[dict], rest_fits: dict) -> list[dict]:
    """Each forward of the U-Net left out: its calls' and its rest's predictions from fits to the other cells. A cell
    (its cell_id: its spec) may stand in several runs, each a forward of the same calls: its U-Net's calls predicted
    over all of them, shared out among its forwards (a recorded generation's VAE calls not among them)."""
    attention: dict[str, float] = {}
    for c, p in zip(calls, fitted["predicted"]):
        if c.get("component", "unet") == "unet":
            attention[c["cell_id"]] = attention.get(c["cell_id"], 0.0) + p
    forwards: dict[str, int] = {}
    for r in rests:
        if r.get("component") == "unet":
            forwards[r["cell_id"]] = forwards.get(r["cell_id"], 0) + 1
    out = []
    for dtype, fit in rest_fits.items():
        mine = [r for r in rests if r.get("dtype") == dtype]
        for r, p in zip(mine, fit["predicted"]):
            if r.get("component") == "unet" and r["cell_id"] in attention and p == p:
                out.append({"cell_id": r["cell_id"], "measured_ms": r["forward_time_ms"],
                            "predicted_ms": attention[r["cell_id"]] / forwards[r["cell_id"]] + p})
    return out


def calibration_path() -> Path:
    return cache_dir() / CALIBRATION_FILE


def target(device: str, dtype: str, gpu_name: str | None = None, results: str | None = None,
           kept: bool | None = None, host_us: float | None = None) -> tuple | None:
    """(limits, calibration, gpu) of the device to predict for: the GPU table's gpu_name (its published figures, its
    attention kernels fitted to the kernel times of its architecture, kept with the project and under results, its
    host priced apart: published_calibration), or this machine's device (its measured limits, calibrated on the
    stored runs under results made on it); None for CUDA on a machine without a GPU and no gpu_name. kept
    (measure/limits.device_key): True for a cell of ours (its runs, attnprof run and sweep), False for a user's own
    generation (attnprof record's runs), None for this process as it is. host_us: the host's microseconds per op
    (--host-us-per-op: a number, or host.HERE for this machine's; None: on a GPU of the table its published
    machine's host, else the published machines' with their range (planner/published.host_range); on a GPU box its
    stored host-bound forwards', planner/host.py)."""
    from .. import gpus
    from ..measure.limits import device_key, device_limits

    check_target(device, gpu_name, results, host_us)
    if gpu_name:
        gpu = gpus.get(gpu_name)
        return gpus.limits(gpu, dtype), published_calibration(gpu, dtype, results and Path(results), host_us), gpu
    if device == "cuda" and not torch.cuda.is_available():
        return None
    calibration = calibrate(Path(results), device_key(device, kept), host_us=host_us) if results else None
    if calibration and dtype in calibration["limits"].get("device_peak_flops", {}) and \
            "device_memory" in calibration["limits"]:
        return calibration["limits"], calibration, None
    if kept:
        from .. import devices

        devices.keep_memory()  # the limits measured as a cell's process has them
    return device_limits(device, [dtype]), calibration, None


def check_target(device: str, gpu_name: str | None, results, host_us) -> None:
    """--results and --host-us-per-op before any work, each refused in one line where it would be ignored: a
    --results that is not a folder; a host figure that is not a positive number or `here`, or given where no host is
    priced apart (this machine's CPU, whose ops run on its host: their time is the measured one)."""
    from ..store import results_folder
    from .host import HERE

    if results is not None and not results_folder(results).is_dir():  # a file: said as such
        raise InputError(f"--results {results}: no such folder (the stored runs to calibrate on); give the folder "
                         "runs were written to (attnprof runs --results DIR lists them)")
    if host_us is None:
        return
    if host_us != HERE and not (isinstance(host_us, (int, float)) and host_us > 0):
        raise InputError(f"--host-us-per-op {host_us}: give microseconds above 0, or `here` for this machine's")
    if not gpu_name and (device != "cuda" or not torch.cuda.is_available()):
        raise InputError("--host-us-per-op prices a GPU's host: give it with --gpu NAME (a GPU you lack) or --device "
                         "cuda on a GPU box; on this machine's CPU the ops run on the host and their time is measured"
                         + ("" if device != "cuda" else " (and there is no GPU here)"))


def predict_cells(cells: list, limits: dict, results: Path) -> dict[str, dict]:
    """Per cell of a sweep, before it runs: its predicted forward and attention time and each call's, on the device
    whose limits the sweep measured, calibrated on the runs under results made on it."""
    calibration = calibrate(Path(results), limits["device_limits"]["key"]) if Path(results).is_dir() else None
    out = {}
    for c in cells:  # the calls of one shape are every backend's: one walk per shape (the preflight's trace made it)
        eager = tuple(s for s in c.settings if s[0] != "compile")  # a compiled U-Net predicted as eager
        p = walked_plan(c.model, c.width, c.height, c.batch, c.dtype, eager)
        t = predict(p, c.backend, c.options, limits, calibration, device=c.device.split(":")[0])
        out[c.cell_id] = {"predicted_forward_time_ms": t["predicted_forward_time_ms"],
                          "predicted_attention_time_ms": t["predicted_attention_time_ms"],
                          "time_source": f"{t['time_backend']}: {t['time_source']}",
                          "time_kind": t["time_kind"], "time_error_pct": t["time_error_pct"],
                          "predicted_call_times_ms": [r["predicted_time_ms"] for r in p["blocks"]],
                          "roofline_call_times_ms": [r["roofline_time_ms"] for r in p["blocks"]]}
    return out


def harness_overhead(results: Path, key: str) -> dict | None:
    """What a cell of the finished runs of this device under results took beyond its forwards (its wall_s less its
    warm-up, timed and probe forwards: the model's build, the reference, the probes, the worker), and what a run took
    beyond its cells (its wall time less its cells': the preflight, the limits, the calibrations): the medians, or
    None where there is no such run."""
    from ..store import kind_of, readable_runs

    cells, runs = [], []
    for run, m in readable_runs(Path(results)):
        sweep = m.get("sweep") or {}
        if not kind_of(m).calibrates or (m.get("device_limits") or {}).get("key") != key or \
                not m.get("ended_at") or m.get("interrupted") or "repeats" not in sweep:
            continue
        table = run.cells()
        if not len(table) or "wall_s" not in table:
            continue
        n = int(sweep.get("warmup", 0)) + int(sweep["repeats"]) + 1
        ok = table[(table["status"] == "ok") & table["wall_s"].notna()]
        cells += (ok["wall_s"] - n * ok["forward_time_ms"] / 1e3).tolist()
        from datetime import datetime

        wall = (datetime.fromisoformat(m["ended_at"]) - datetime.fromisoformat(m["created_at"])).total_seconds()
        runs.append(max(0.0, wall - float(table["wall_s"].fillna(0).sum())))
    if not cells:
        return None
    return {"cell_s": float(np.median(cells)), "run_s": float(np.median(runs)), "cells": len(cells), "runs": len(runs)}


def by_size(model: str, sizes: list[tuple[int, int]], names: list[str], dtype: str, batch: int,
            gpu_name: str) -> list[dict]:
    """Each backend's predicted attention and forward time per size on a GPU of the table (the dashboard's Planner
    page): one row per (backend, size)."""
    from .. import gpus

    gpu = gpus.get(gpu_name)
    limits = gpus.limits(gpu, parse_dtype(dtype))
    calibration = published_calibration(gpu, parse_dtype(dtype))
    rows = []
    for w, h in sizes:
        for name in names:
            t = predict(walked_plan(model, w, h, batch, dtype), name, {}, limits, calibration, gpu=gpu)
            rows.append({"backend": name, "size": f"{w}x{h}", "pixels": w * h, "gpu": gpu["name"],
                         "attention_ms": t["predicted_attention_time_ms"], "forward_ms": t["predicted_forward_time_ms"],
                         "source": t["time_source"]})
    return rows
