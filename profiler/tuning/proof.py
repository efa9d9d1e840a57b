"""attnprof tune's proof: the whole forward (a U-Net's; for a user's pipeline, one generation) with the map against
the best single backend (and against sdpa, diffusers' default processor, where it is neither), in ABBA rounds
(rounds.interleaved) on the device's clock, no hooks, no per-call events: each contender's processors on every
Attention module (made once, set before each of its runs), one warm-up run each, then one run per round. The
speed-up is the single backend's median over the map's, between the quartiles' ratios, with the noise rule's
verdict (compare.time_verdict: an improvement only where the ratio passes the threshold and the quartiles part).
For a U-Net, each contender's output against the fp32 reference forward's (measure/cell.ModelCache: the same
seeded weights and inputs)."""
from __future__ import annotations

import torch

from ..attention import backends, mix
from .. import devices
from ..attention.processor import for_module
from ..attention.recorder import attention_modules
from ..measure.rounds import interleaved
from ..measure.rows import TOLERANCE, without_collection
from ..report.compare import IMPROVEMENT, THRESHOLD, quartiles, time_verdict
from ..spec import CellSpec, InputError

ROUNDS = 6  # whole forwards per contender (MIN_SAMPLES, 3, is what the noise rule judges at the least)
MIX = "mix"


def single_text(key: tuple) -> str:
    """A single backend as a map's entries: its default, no block of its own."""
    return mix.canonical({"blocks": {}, "default": [key[0], dict(key[1]), None]})


def _kept(out):
    """What of a run's output is compared: a tensor as float on the CPU, anything else (a pipeline's) as it is."""
    return out.float().cpu() if isinstance(out, torch.Tensor) else out


def timed(modules: dict, run_once, contenders: dict[str, str], dev, rounds: int) -> dict[str, dict]:
    """{contender: {"samples_ms": one per round, "output": its warm-up run's}}, each contender's processors (a map's
    entries: contenders' texts) on `modules` for its runs; the modules' own processors put back after."""
    made = {}
    for name, text in contenders.items():
        unplaced = mix.Unplaced(text, backends.make_processor)
        made[name] = {block: for_module(unplaced.for_block(block), m) for block, m in modules.items()}
        refused = [block for block, p in made[name].items() if p is None]
        if refused:  # an added-KV block (SimpleCrossAttn) that only naive and sdpa run
            raise InputError(f"{name} cannot stand in for {refused[0]} (added-KV attention): tune with naive or sdpa")
    own = {block: m.processor for block, m in modules.items()}
    outputs: dict[str, object] = {}

    def runner(name: str):
        def run() -> float:
            for block, m in modules.items():
                m.set_processor(made[name][block])
            dev.synchronize()
            clock = dev.interval()
            clock.start()
            out = run_once()
            clock.stop()
            dev.synchronize()
            outputs.setdefault(name, _kept(out))
            return clock.ms()
        return run

    try:
        with without_collection():
            for name in contenders:  # warm-up: first runs (allocations, kernel choices, caches) are not timed
                runner(name)()
            samples = interleaved({name: runner(name) for name in contenders}, rounds)
    finally:
        for block, m in modules.items():
            m.set_processor(own[block])
    return {name: {"samples_ms": samples[name], "output": outputs[name]} for name in contenders}


def prove_model(spec: CellSpec, contenders: dict[str, str], rounds: int = ROUNDS) -> dict[str, dict]:
    """timed() over the cell's U-Net forward (seeded random weights, its inputs) on its device, each contender's
    max_rel_err against the fp32 reference forward and error_ok by the dtype's tolerance."""
    from ..measure.cell import ModelCache

    devices.keep_memory()  # timed as a cell is
    cache = ModelCache()
    reference, _ = cache.reference(spec)  # before the model under test is built: never beside it
    work, unet = cache.get(spec.model, spec.dtype, spec.device, spec.settings)
    dev = devices.get(spec.device)
    with torch.no_grad(), dev.guard(), work.applied(unet):
        inputs = work.inputs(unet, spec.batch, spec.width, spec.height)
        found = timed(attention_modules(unet), lambda: work.forward(unet, inputs), contenders, dev, rounds)
        del inputs
    del unet, cache
    dev.release()
    scale = max(float(reference.abs().max()), 1e-12)
    for f in found.values():
        f["max_rel_err"] = float((f.pop("output") - reference).abs().max()) / scale
        f["error_ok"] = f["max_rel_err"] <= TOLERANCE[spec.dtype]
    return found


def judged(base: list[float], mixed: list[float]) -> dict:
    """The map against a single backend: the speed-up (the backend's median over the map's), its range between the
    quartiles' ratios (the backend's first over the map's third, third over first) and the noise rule's verdict
    (improvement where the map is faster beyond it; else why not)."""
    _, verdict, why = time_verdict(base, mixed, THRESHOLD)
    (a1, am, a3), (b1, bm, b3) = quartiles(base), quartiles(mixed)
    return {"speedup": am / bm, "speedup_low": a1 / b3, "speedup_high": a3 / b1, "verdict": verdict,
            "verdict_note": why, "faster": verdict == IMPROVEMENT}
