"""attnprof tune (a model by name, at a size) and profiler.tune (a user's pipeline or module, its shapes from one
profiled generation): the search (search.py), the proof (proof.py), the map and the run.

What is stored (out): a run of kind `tune` (store.RUN_KINDS), a cell per candidate backend with one row per call of
the forward (its shape's figures, as attnprof replay stores them: show, diff and the dashboard read it), and the
map's own cell, backend `tuned`: per call its block's backend's figures with the choice (chosen, runner_up,
runner_up_ms, why), and the proof's figures; beside it the map, tuned.json, which `attnprof run --backend` and
profiler.apply take."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..attention import mix
from ..attention.backends import check_options
from .. import devices
from ..measure.replay import block_of, cell_of, shape_of
import torch

from ..attention.apply import denoiser
from ..attention.recorder import attention_modules
from ..spec import CellSpec, InputError
from ..store import check_writable
from . import proof, search
from .store import MAP_FILE, store

PIPELINE_PROOF_ROUNDS = 4  # a generation is many forwards: fewer rounds of it


@dataclass
class Tuned:
    """What a tune found: map (the document tuned.json holds: profiler.apply takes it), path (where the file was
    written; None where nothing was stored), run_dir, and the map's cell and block rows (what show prints)."""

    map: dict
    path: Path | None = None
    run_dir: Path | None = None
    cell: dict = field(default_factory=dict, repr=False)
    blocks: list[dict] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        from ..report.show import format_tuned

        return format_tuned(self.cell, self.blocks, self.path)


@dataclass
class Search:
    """One tune's inputs and what the search found, as the proof and the store read them."""

    base: CellSpec  # the forward's shape (model, size, batch, dtype, device)
    rows: list[dict]  # its calls
    keys: list[tuple]  # the candidates
    shapes: dict  # search.measure_shapes'
    blocks: dict  # search.choose's: block -> entry
    single: tuple | None
    left: dict = field(default_factory=dict)
    note: str = ""
    budget: int | None = None
    planned: dict = field(default_factory=dict)  # planned forward peaks: "mix" and each candidate's label
    timing: tuple[int, int, int] = (3, 1, search.ROUNDS)  # repeats, warm-up and rounds of each shape's timing


def check_proof_rounds(rounds: int, where: str = "--proof-rounds") -> None:
    """The proof's rounds, before anything is timed: the noise rule judges no fewer than MIN_SAMPLES samples, so fewer
    rounds would always read "not judged" and the map would be kept or dropped on nothing."""
    from ..report.compare import MIN_SAMPLES

    if rounds < MIN_SAMPLES:
        raise InputError(f"{where} {rounds} is too small: the noise rule judges {MIN_SAMPLES} samples at least "
                         f"(report/compare.MIN_SAMPLES); use {MIN_SAMPLES} or more")


def tune_model(model: str, width: int, height: int, batch: int = 1, dtype: str = "float32", device: str = "cpu",
               budget: int | None = None, names: list[str] | None = None, options: dict | None = None,
               repeats: int = 3, warmup: int = 1, rounds: int = search.ROUNDS, proof_rounds: int = proof.ROUNDS,
               out: str | Path | None = "results", command: str = "", say=lambda line: None) -> Tuned:
    """attnprof tune --model MODEL --size WxH: the forward's calls and each candidate's transient in them from the
    planner's trace (fake tensors, planner/forward.py), the search, the proof on the U-Net forward, the run and the
    map (under out; None: none)."""
    from ..planner.forward import mixed_peak, trace

    check_proof_rounds(proof_rounds, "proof_rounds")
    if out is not None:
        check_writable(out)  # before the trace and the timing: a tune lost at its end to a bad --out is all of it
    dims = tuple(sorted({r["head_dim"] for r in trace(model, width, height, batch, dtype, "cpu", [])["rows"]}))
    keys, left = search.candidates(names, options or {}, device, dtype, dims)
    traced = trace(model, width, height, batch, dtype, devices.get(device).torch.type, [k[0] for k in keys],
                   {k[0]: dict(k[1]) for k in keys})
    rows, base = traced["rows"], CellSpec(model, width, height, batch, dtype, "sdpa", device)
    fits = search.check_budget(traced, keys, budget) if budget else None  # before anything is timed
    say(f"{len(keys)} backends, {len(search.distinct(rows))} distinct shapes of {len(rows)} calls: "
        + ", ".join(map(search.label_of, keys)))
    shapes = search.measure_shapes(rows, keys, base, repeats, warmup, rounds, say)
    peak = lambda key: traced["backends"].get(key[0], {}).get("predicted_forward_peak_bytes")  # noqa: E731
    blocks = search.choose(rows, shapes, fits, lambda row, key: search.need_bytes(traced, row, key), budget)
    single, _, note = search.best_single(rows, shapes, keys, peak, budget)
    found = Search(base, rows, keys, shapes, blocks, single, left, note, budget,
                   {"mix": mixed_peak(traced, {b: e["backend"] for b, e in blocks.items()})[
                       "predicted_forward_peak_bytes"], **{search.label_of(k): peak(k) for k in keys}},
                   (repeats, warmup, rounds))
    contenders = _contenders(found)
    if len(contenders) > 1:
        say(f"the proof: the whole U-Net forward, {' against '.join(contenders)}, interleaved")
    timed = proof.prove_model(base, contenders, proof_rounds) if len(contenders) > 1 else {}
    return _finish(found, timed, "U-Net forward", out, command, say)


def tune_command(model, size, batch, dtype, budget, backend, option, device, repeats, warmup, rounds, proof_rounds,
                 out, quiet) -> int:
    """attnprof tune: the command line's values checked before any work, then tune_model; the map printed."""
    from ..fmt import progress, typed
    from ..spec import parse_bytes, parse_options
    from ..unet import models

    device = devices.resolve(devices.parse(device, "--device"))
    models.resolve(model)
    if size and len(size) > 1:
        raise InputError("tune takes one --size: a map is for the shapes of one forward")
    sizes, batch, dtype = devices.given_shape(size, batch, dtype, device, say=True)
    budget = parse_bytes(budget, "--budget") if budget else None
    for key, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0), ("rounds", rounds, 2)):
        if value < least:
            raise InputError(f"--{key} {value} is too small: use {least} or more")
    check_proof_rounds(proof_rounds)
    for name in backend or []:
        if name.endswith(".json"):
            raise InputError(f"--backend {name}: tune times backends by name; run a map with attnprof run --backend")
    print(tune_model(model, *sizes[0], batch, dtype, device, budget, backend, parse_options(option), repeats, warmup,
                     rounds, proof_rounds, out, typed(), progress("tune", quiet)))
    return 0


def tune(target, *args, budget=None, backends: list[str] | None = None, options: dict | None = None,
         repeats: int = 3, warmup: int = 1, rounds: int = search.ROUNDS,
         proof_rounds: int = PIPELINE_PROOF_ROUNDS, out: str | Path | None = "results", say=None,
         **kwargs) -> Tuned:
    """profiler.tune(pipe) (or pipe.unet): the U-Net's attention calls of one generation (target(*args, **kwargs);
    a pipeline's default: an empty prompt, 2 steps, its default size), each distinct shape's backends timed alone on
    the pipeline's device and dtype, the fastest per block, proved by whole generations (the map against the best
    single backend, interleaved); the user's processors are as they were after. Returns the map (Tuned: apply it
    with profiler.apply(pipe, tuned)); with out, stores the run and tuned.json there."""
    from ..record.session import profile

    say = say or (lambda line: None)
    check_proof_rounds(proof_rounds, "profiler.tune: proof_rounds")
    if out is not None:
        check_writable(out, "out=")
    if budget is not None:
        raise InputError("profiler.tune: budget= needs the planner's forward of a model by name: attnprof tune "
                         "--model NAME --size WxH --budget SIZE")
    call = _generation(target, args, kwargs)
    with profile(target, out=None) as prof:
        call()
    base, rows = _recorded(prof)
    keys, left = search.candidates(backends, options or {}, base.device, base.dtype,
                                   tuple(sorted({r["head_dim"] for r in rows})))
    shapes = search.measure_shapes(rows, keys, base, repeats, warmup, rounds, say)
    blocks = search.choose(rows, shapes)
    single, _, note = search.best_single(rows, shapes, keys)
    found = Search(base, rows, keys, shapes, blocks, single, left, note, timing=(repeats, warmup, rounds))
    modules = attention_modules(denoiser(target))
    contenders = _contenders(found)
    with torch.no_grad():
        timed = proof.timed(modules, call, contenders, devices.get(base.device), proof_rounds) \
            if len(contenders) > 1 else {}
    return _finish(found, timed, "generation", out, "profiler.tune", say)


def _generation(target, args: tuple, kwargs: dict):
    """One generation of the target, as the user calls it: a pipeline's with an empty prompt and 2 steps where no
    prompt is given; a module's with its forward's inputs, which must be given."""
    if isinstance(target, torch.nn.Module):
        if not args and not kwargs:
            raise InputError("profiler.tune: give the module's forward inputs (profiler.tune(unet, sample, t, "
                             "encoder_hidden_states=...)), or tune the pipeline (profiler.tune(pipe))")
    elif not args and "prompt" not in kwargs and "prompt_embeds" not in kwargs:
        kwargs = {"prompt": "", "num_inference_steps": 2, **kwargs}
    return lambda: target(*args, **kwargs)


def _recorded(prof) -> tuple[CellSpec, list[dict]]:
    """(the forward's shape, its calls) of a profiled generation: the U-Net's calls of its first forward."""
    calls = prof.calls
    mine = calls[calls["component"].isin(("unet", "model"))] if len(calls) else calls
    if not len(mine):
        raise InputError("profiler.tune: the generation made no attention call of a U-Net: give a Stable "
                         "Diffusion pipeline (pipe) or its U-Net with its inputs")
    first = mine[(mine["generation"] == 0) & (mine["pass_index"] == mine["pass_index"].min())]
    f = prof.facts
    base = CellSpec(f"{f['pipeline']} {f['denoiser']}", int(f["width"]), int(f["height"]), int(f["batch"]),
                    f["dtype"], "sdpa", f["device"])
    rows = [{**r, "upcast": r.get("upcast") or ""} for r in first.sort_values("call_index").to_dict("records")]
    return base, rows


def _contenders(found: Search) -> dict[str, str]:
    """The proof's contenders as map texts: the map, the best single backend, sdpa (diffusers' default processor)
    where it ran every call and is not the best; none but the map where it is the single backend everywhere."""
    text = mix.canonical(mix.entries(search.entries_text(found.blocks, found.single), "tuned"))
    out = {proof.MIX: text}
    if found.single and any(e["backend"] != found.single[0] for e in found.blocks.values()):
        out[search.label_of(found.single)] = proof.single_text(found.single)
    sdpa = next((k for k in found.keys if k[0] == "sdpa"), None)
    runs_all = sdpa and all(sdpa in found.shapes[shape_of(r)]["figures"] for r in found.rows)
    if runs_all and any(e["backend"] != "sdpa" for e in found.blocks.values()):
        out.setdefault(search.label_of(sdpa), proof.single_text(sdpa))
    return out


def _finish(found: Search, timed: dict, what: str, out, command: str, say) -> Tuned:
    """The proof judged, the map decided (the single backend everywhere where the mix was no faster), the map's
    document and rows, stored under out (None: not stored)."""
    verdicts = _judge(found, timed, what)
    verdicts["kept_why"] = _kept_why(found, verdicts)
    kept, why = (found.single if verdicts["kept_why"] else None), verdicts["kept_why"]
    if kept:
        shapes = {r["block"]: shape_of(r) for r in found.rows}
        found = replace(found, blocks={b: _kept(e, kept, found.shapes[shapes[b]]["figures"], what, why)
                                       for b, e in found.blocks.items()},
                        planned={**found.planned, "mix": found.planned.get(search.label_of(kept))})
    doc = _document(found, verdicts, kept)
    spec = CellSpec(*[getattr(found.base, k) for k in ("model", "width", "height", "batch", "dtype")],
                    mix.NAME, found.base.device, tuple(sorted(check_options(mix.NAME, {
                        "file": MAP_FILE, "map": mix.canonical(mix.entries(doc, MAP_FILE))}).items())))
    cell, blocks = _map_rows(found, spec, verdicts, doc)
    if out is None:
        return Tuned(doc, None, None, cell, blocks)
    return Tuned(doc, *store(found, doc, cell, blocks, Path(out), command, say), cell, blocks)


def _kept_why(found: Search, verdicts: dict) -> str:
    """Why the map keeps the single backend in every block, or "" where it keeps the mix: the mixed forward "no
    faster" than it by the noise rule, or off the fp32 reference beyond the dtype's tolerance where the single one is
    not."""
    single = verdicts.get("single")
    if not single:
        return ""
    contenders = verdicts["contenders"]
    mixed, alone = contenders.get(proof.MIX, {}), contenders.get(single["label"], {})
    if mixed.get("error_ok") is False and alone.get("error_ok") is not False:
        return f"{mixed['max_rel_err']:.1e} off the fp32 reference, beyond the {found.base.dtype} tolerance"
    return "" if single["faster"] else "no faster"


def _kept(entry: dict, kept: tuple, figures: dict, what: str, why: str) -> dict:
    """A block's entry where the map keeps the single backend (why: _kept_why's): the single backend and its figures
    at the block's shape; the mix's pick as its runner-up (`proposed`)."""
    proposed = search.key_of(entry["backend"], entry["options"])
    if proposed == kept:
        return {**entry, "proposed": search.label_of(proposed)}
    return {**entry, "backend": kept[0], "options": dict(kept[1]), "time_ms": figures[kept]["time_ms"],
            "iqr_ms": figures[kept]["iqr_ms"], "max_rel_err": figures[kept]["max_rel_err"],
            "proposed": search.label_of(proposed), "runner_up": search.label_of(proposed),
            "runner_up_ms": entry["time_ms"],
            "why": f"kept {search.label_of(kept)}: the mixed {what} was {why}" + (" than it" if why == "no faster"
                                                                                 else "")
                   + f" (the mix's pick here: {search.label_of(proposed)})"}


def _judge(found: Search, timed: dict, what: str) -> dict:
    """The proof's figures: each contender's samples and median, and the map against the best single backend and
    against sdpa (proof.judged)."""
    import statistics

    out = {"what": what, "rounds": len(timed.get(proof.MIX, {}).get("samples_ms", [])), "contenders": {
        name: {"samples_ms": t["samples_ms"], "median_ms": statistics.median(t["samples_ms"]),
               **({"max_rel_err": t["max_rel_err"], "error_ok": t["error_ok"]} if "max_rel_err" in t else {})}
        for name, t in timed.items()}}
    mixed = timed.get(proof.MIX, {}).get("samples_ms")
    for role, key in (("single", found.single), ("sdpa", next((k for k in found.keys if k[0] == "sdpa"), None))):
        name = search.label_of(key) if key else None
        if mixed and name in timed:
            out[role] = {"label": name, **proof.judged(timed[name]["samples_ms"], mixed)}
    return out


def _document(found: Search, verdicts: dict, kept) -> dict:
    """The map file's document: what runs (blocks, default: mix.entries reads these), and for people the forward it
    was tuned for, the candidates left out, the planned peaks and the proof."""
    b = found.base
    doc = {"attnprof": "processor map (attnprof tune)", "version": 1, "model": b.model, "width": b.width,
           "height": b.height, "batch": b.batch, "dtype": b.dtype, "device": b.device,
           "budget_bytes": found.budget, "single": search.label_of(found.single) if found.single else None,
           "kept_single": bool(kept), "note": found.note, "left_out": found.left,
           "planned_forward_peak_bytes": found.planned, "proof": verdicts,
           **search.entries_text(found.blocks, found.single)}
    for block, entry in doc["blocks"].items():
        entry.update({k: v for k, v in found.blocks[block].items() if k not in entry})
    return doc


def _map_rows(found: Search, spec: CellSpec, verdicts: dict, doc: dict) -> tuple[dict, list[dict]]:
    """The map's cell (backend tuned) and its block rows: per call its block's backend's figures (a replay's rows:
    measure/replay.block_of) with the choice; the cell's attention summed from them, the proof's figures."""
    from ..measure.limits import cell_peaks, device_limits, roof_of

    peaks = cell_peaks(device_limits(spec.device, [spec.dtype]), spec.dtype)
    blocks = []
    for row in found.rows:
        e = found.blocks[row["block"]]
        key = search.key_of(e["backend"], e["options"])
        figures = found.shapes[shape_of(row)]["figures"][key]
        blocks.append({**block_of(spec, row, figures, None, roof_of(peaks)), "chosen": search.label_of(key),
                       "runner_up": e["runner_up"], "runner_up_ms": e["runner_up_ms"], "why": e["why"]})
    cell = cell_of(spec, blocks, peaks, time.time())
    mixed = verdicts["contenders"].get(proof.MIX, {})
    single, vs_sdpa = verdicts.get("single") or {}, verdicts.get("sdpa") or {}
    runs = verdicts["contenders"].get(single.get("label"), {}) if doc["kept_single"] else mixed  # what the map runs
    cell.update(kind="tune", tune_what=verdicts["what"], tune_rounds=verdicts["rounds"],
                proof_ms=mixed.get("median_ms"), proof_samples_ms=mixed.get("samples_ms"),
                versus=single.get("label") or doc["single"], speedup=single.get("speedup"),
                speedup_low=single.get("speedup_low"), speedup_high=single.get("speedup_high"),
                verdict=single.get("verdict"), verdict_note=single.get("verdict_note"),
                versus_ms=verdicts["contenders"].get(single.get("label"), {}).get("median_ms"),
                sdpa_speedup=vs_sdpa.get("speedup"), sdpa_verdict=vs_sdpa.get("verdict"),
                sdpa_ms=verdicts["contenders"].get(vs_sdpa.get("label"), {}).get("median_ms"),
                kept_single=doc["kept_single"], kept_why=verdicts["kept_why"], tune_note=found.note,
                max_rel_err=runs.get("max_rel_err"), error_ok=runs.get("error_ok"),
                predicted_forward_peak_bytes=found.planned.get("mix"), budget_bytes=found.budget,
                backends_used=", ".join(sorted({b["chosen"] for b in blocks})))
    return cell, blocks

