"""The time model's steps of make gpu-check: two judges of a run's tables (the audit's N8 and N9,
../shared/gpu/h200-audit-2026-12-04.md section 5) and one model check, a short generation timed against its
prediction (issue 52). verdicts.py holds Verdict, evidence() and Skip; plan.py wires these into STEPS.

- N8, device_limits_are_rates: the device's small limits are rates, not costs per launch (measure/limits.py): the
  cache's bandwidth at least 0.9x the memory's; softmax's rate at least the memory's bandwidth over a table's read
  and write (B / (2 x itemsize): B/4 in fp16; judged on CUDA, reported on the CPU, whose exponentials are
  compute-bound); and every call's roofline floor (roofline_time_ms, timing.attach) at most 1.1x its kernels on at
  least 95% of the calls.
- N9, time_model_fits_kernel_times_across_models: the time model on kernel targets (planner/kernels.py), each model's
  cells predicted from a fit to the other model's alone (sd15 <-> sdxl), summed per backend: within [0.8, 1.25] of
  their kernel sums; the cells admitted, none of them with a warm-up below 1.
- short_generation_matches_its_prediction: SD 1.5 at 512x512, 10 steps under guidance, sdpa: the generation timed
  eager (wall clock, after a warm-up generation) and the U-Net's forward replayed from a CUDA graph, each against the
  time model's prediction for this GPU (its published figures, this host's per-op figure): within [0.8, 1.25].
"""
from __future__ import annotations

import statistics
import time

import pandas as pd

from .verdicts import Skip, Verdict, evidence, ok_cells, records, said, what

CACHE_SHARE_MIN = 0.9  # N8: the cache's bandwidth over the memory's
FLOOR_OVER_KERNELS = 1.1  # N8: a call's floor at most this times its kernels
FLOOR_SHARE = 0.95  # N8: on at least this share of the calls
CROSS = (0.8, 1.25)  # N9 and the generation: predicted over measured
GENERATION = ("sd15", 512, 10)  # the short generation: pipeline, size, steps


def _kernel_ms(row: dict, device: str):
    """A call's kernel time (planner/kernels.kernel_ms); on the CPU its time_ms (the host's clock is the device's)."""
    from ..planner.kernels import kernel_ms

    return row.get("time_ms") if device == "cpu" else kernel_ms(row)


def _limit_rows(ok: pd.DataFrame, device: str) -> tuple[list[dict], list[str], list[str]]:
    """N8's limits, one row per distinct limits (cells share them): (evidence, failures, figures)."""
    rows, failed, said_ = [], [], []
    for r in records(ok.drop_duplicates(["device_peak_bytes_per_s", "dtype"])):
        memory, cache, softmax = r.get("device_peak_bytes_per_s"), r.get("device_cache_bytes_per_s"), \
            r.get("device_softmax_per_s")
        share = cache / memory if cache and memory else float("nan")
        ok_cache = share >= CACHE_SHARE_MIN
        rows.append(evidence(r, "cells", "device_cache_bytes_per_s", "device_peak_bytes_per_s",
                             f"B_c / B >= {CACHE_SHARE_MIN} (ratio {share:.3f})", ok_cache))
        if not ok_cache:
            failed.append(f"cache bandwidth {cache or 0:.3g} B/s over memory's {memory or 0:.3g}: {share:.3f}")
        item = 2 if r["dtype"] in ("float16", "bfloat16") else 4
        s_share = softmax / (memory / (2 * item)) if softmax and memory else float("nan")
        judged = device != "cpu"
        ok_s = s_share >= 1 or not judged
        rows.append(evidence(r, "cells", "device_softmax_per_s", "device_peak_bytes_per_s",
                             f"S / (B / {2 * item}) >= 1 (ratio {s_share:.3f})" + ("" if judged else
                                                                                  ": reported on the CPU"), ok_s))
        if not ok_s:
            failed.append(f"softmax {softmax or 0:.3g} /s over B/{2 * item}: {s_share:.3f}")
        said_.append(f"{r['dtype']}: B_c/B {share:.2f}, S/(B/{2 * item}) {s_share:.2f}")
    return rows, failed, said_


def device_limits_are_rates(cells, blocks, device) -> Verdict:
    """N8 (module docstring): the cache's bandwidth and softmax's rate against the memory's, and each call's floor
    against its kernels. One row per distinct limits; per cell its highest floor / kernels, and each call over."""
    ok = ok_cells(cells)
    rows, failed, said_ = _limit_rows(ok, device)
    calls = blocks[blocks["cell_id"].isin(ok["cell_id"])] if len(blocks) else blocks
    if "roofline_time_ms" not in calls or not calls["roofline_time_ms"].notna().any():
        failed.append("no call has a roofline_time_ms (the sweep attaches each call's floor: planner/timing.attach)")
        return Verdict("; ".join(said_) + "; no floors to judge", rows, failed)
    recs = [dict(r, kernel_ms=_kernel_ms(r, device)) for r in records(calls)]
    judged = [r for r in recs if r.get("roofline_time_ms") is not None and r["kernel_ms"]]
    for r in judged:
        r["floor_ratio"] = r["roofline_time_ms"] / r["kernel_ms"]
    over = [r for r in judged if r["floor_ratio"] > FLOOR_OVER_KERNELS]
    share = 1 - len(over) / len(judged) if judged else 0.0
    worst = {}
    for r in judged:
        if r["cell_id"] not in worst or r["floor_ratio"] > worst[r["cell_id"]]["floor_ratio"]:
            worst[r["cell_id"]] = r
    for r in list(worst.values()) + over[:50]:
        rows.append(evidence(r, "blocks", "roofline_time_ms", "kernel_ms", f"floor <= {FLOOR_OVER_KERNELS} x the "
                             f"kernels (ratio {r['floor_ratio']:.3f})", r["floor_ratio"] <= FLOOR_OVER_KERNELS))
    if share < FLOOR_SHARE:
        failed.append(f"{len(over)} of {len(judged)} calls have a floor above {FLOOR_OVER_KERNELS}x their kernels "
                      f"({100 * share:.1f}% within, at least {100 * FLOOR_SHARE:.0f}% needed)")
    return Verdict("; ".join(said_) + f"; floors within {FLOOR_OVER_KERNELS}x the kernels on {len(judged) - len(over)}"
                   f" of {len(judged)} calls ({100 * share:.1f}%; {len(judged)} of {len(calls)} judged)", rows, failed)


def _kernel_rows(cells: pd.DataFrame, blocks: pd.DataFrame, device: str) -> pd.DataFrame:
    """The run's block rows as planner/kernels.py reads them: each with its cell's warm-up, repeats, status and GPU;
    on the CPU their time_ms as the kernel time."""
    keep = [c for c in ("cell_id", "warmup", "repeats", "status", "device_name", "device_arch",
                        "device_peak_flops_per_s", "device_peak_bytes_per_s") if c in cells]
    rows = blocks.drop(columns=[c for c in keep if c != "cell_id" and c in blocks]).merge(cells[keep], on="cell_id")
    if "run_id" not in rows:
        rows["run_id"] = "run"
    for c in ("upcast", "sdpa_kernel"):
        rows[c] = rows[c].fillna("") if c in rows else ""
    return rows.assign(gpu_time_ms=rows["time_ms"]) if device == "cpu" else rows


def _samples(rows: pd.DataFrame, device: str) -> list[dict]:
    """Each admitted call's features on the published figures of the GPU that ran it, else on its cell's measured
    peaks (the CPU, a GPU not in the table)."""
    from .. import gpus
    from ..planner import kernels
    from ..planner.timing import Device

    out = []
    for (name, flops, memory, dtype), mine in rows.groupby(
            [rows.get("device_name", pd.Series("", index=rows.index)).fillna(""), "device_peak_flops_per_s",
             "device_peak_bytes_per_s", "dtype"], dropna=False):
        table = gpus.named_in(name) if device != "cpu" else None
        if table and table["tflops"].get(dtype):
            out += kernels.samples(mine, Device(table["tflops"][dtype] * 1e12, table["bytes_per_s"]))
        elif flops == flops and memory == memory:  # measured peaks, where the table has no such GPU
            out += kernels.samples(mine, Device(flops, memory))
    return out


def time_model_fits_kernel_times_across_models(cells, blocks, device) -> Verdict:
    """N9 (module docstring): per backend, each model's kernel sum predicted from a fit to the other model's cells
    alone; the cells the fit admitted and refused (warm-up below 1 or fewer than 3 repeats, event-timed)."""
    from ..planner import kernels

    ok = ok_cells(cells)
    rows_in = _kernel_rows(ok, blocks[blocks["cell_id"].isin(ok["cell_id"])], device)
    admitted, refused = kernels.admit(rows_in)
    rows = [evidence(r, "cells", ["warmup", "repeats"], rule="refused by the time model: " +
                     next(x for x in refused if f"cell {r['cell_id']})" in x).split(": ", 1)[1], ok=True)
            for r in records(ok) if any(f"cell {r['cell_id']})" in x for x in refused)]
    cold = [r for r in records(admitted.drop_duplicates("cell_id")) if not (r.get("warmup") or 0) >= 1]
    failed = [f"{what(r)}: admitted with warm-up {r.get('warmup')}" for r in cold]
    if admitted["model"].nunique() < 2:
        raise Skip(f"the admitted cells are of {admitted['model'].nunique()} model(s): two are needed "
                   f"({len(refused)} refused)")
    found = kernels.cross_model(_samples(admitted, device))
    for r in found:
        good = CROSS[0] <= r["ratio"] <= CROSS[1]
        rows.append(said(f"{r['model']} {r['backend']}: predicted {r['predicted_ms']:.4g} ms from a fit to "
                         f"{r['from']} alone, kernels {r['kernel_ms']:.4g} ms ({r['ratio']:.3f}x)",
                         f"within [{CROSS[0]}, {CROSS[1]}]", good))
        if not good:
            failed.append(f"{r['model']} {r['backend']}: predicted / kernels {r['ratio']:.3f}")
    ratios = [r["ratio"] for r in found]
    span = f"{min(ratios):.3f}..{max(ratios):.3f}" if ratios else "none"
    return Verdict(f"cross-model fits of {len(found)} (model, backend) sums: predicted / kernels {span}; "
                   f"{admitted['cell_id'].nunique()} cells admitted, {len(refused)} refused, warm-up-0 cells "
                   f"admitted: {len(cold)}", rows, failed)


def generation_verdict(measured: dict, predicted: dict) -> Verdict:
    """The short generation's figures against the time model's: the eager generation (seconds) and, where measured,
    the U-Net's forward replayed from a CUDA graph (ms), each within CROSS."""
    rows, failed, parts = [], [], []
    for what, m, p, unit in (("eager generation", measured.get("eager_s"), predicted["eager_s"], "s"),
                             ("U-Net forward from a CUDA graph", measured.get("graph_ms"), predicted["graph_ms"],
                              "ms")):
        if m is None:
            parts.append(f"{what}: not measured ({measured.get('why_no_graph', 'no CUDA')})")
            continue
        ratio = p / m
        good = CROSS[0] <= ratio <= CROSS[1]
        parts.append(f"{what}: measured {m:.4g} {unit}, predicted {p:.4g} {unit} ({ratio:.2f}x)")
        rows.append(said(parts[-1], f"predicted / measured within [{CROSS[0]}, {CROSS[1]}]", good))
        if not good:
            failed.append(f"{what}: predicted / measured {ratio:.3f}")
    bound = predicted.get("bound")
    return Verdict("; ".join(parts) + (f"; predicted {bound}-bound (eager), host {predicted['host']}" if bound else ""),
                   rows, failed)


def measure_generation(device: str, pipeline: str, size: int, steps: int, dtype: str, generations: int = 3) -> dict:
    """One generation of the pipeline's parts (planner/pipeline.py: random weights from their configs) on the device,
    as diffusers' pipeline runs them: the text encoder for the prompt and the negative prompt, `steps` U-Net forwards
    at batch 2 (classifier-free guidance 7.5) each with a DDIM step, one VAE decode. {"eager_s": the median wall time
    of `generations` after one warm-up, synchronized; on CUDA "graph_ms": the U-Net's forward at batch 2 replayed
    from a CUDA graph (devices.replay_ms, the median of 20), else "why_no_graph"}."""
    import diffusers
    import torch
    import transformers

    from .. import devices
    from ..planner.pipeline import PIPELINES, TEXT_ENCODERS
    from ..spec import torch_dtype
    from ..unet import models

    parts, dev, tdt = PIPELINES[pipeline], devices.get(device), torch_dtype(dtype)
    with dev.guard(), torch.no_grad():
        unet = models.build(parts["unet"], weights="random", device=device, dtype=dtype).eval()
        vae = models.build(parts["vae"], weights="random", device=device, dtype=dtype).eval()
        cls, config = TEXT_ENCODERS[parts["text"][0]]
        with torch.device(dev.torch):
            text = getattr(transformers, cls)(transformers.CLIPTextConfig(**config)).to(tdt).eval()
        scheduler = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                            clip_sample=False, set_alpha_to_one=False, steps_offset=1)
        ids, side = torch.zeros(1, 77, dtype=torch.int64, device=dev.torch), size // 8

        def generate():
            emb = torch.cat([text(ids)[0], text(ids)[0]])  # the negative prompt's, then the prompt's
            scheduler.set_timesteps(steps)
            lat = torch.randn(1, unet.config.in_channels, side, side, device=dev.torch, dtype=tdt)
            for t in scheduler.timesteps:
                uncond, cond = unet(torch.cat([lat] * 2), t, encoder_hidden_states=emb).sample.chunk(2)
                lat = scheduler.step(uncond + 7.5 * (cond - uncond), t, lat).prev_sample
            return vae.decode(lat / vae.config.scaling_factor).sample, emb

        wall = []
        for _ in range(generations + 1):
            dev.synchronize()
            t0 = time.perf_counter()
            _, emb = generate()
            dev.synchronize()
            wall.append(time.perf_counter() - t0)
        out = {"eager_s": statistics.median(wall[1:])}
        if dev.torch.type != "cuda":
            return {**out, "why_no_graph": "CUDA graphs need a GPU"}
        x, t = torch.randn(2, unet.config.in_channels, side, side, device=dev.torch, dtype=tdt), \
            torch.tensor(500, device=dev.torch)
        try:
            out["graph_ms"] = statistics.median(dev.replay_ms(lambda: unet(x, t, encoder_hidden_states=emb), 1, 20))
        except RuntimeError as e:  # a capture that fails says why, never a silent gap
            out["why_no_graph"] = f"capture failed: {' '.join(str(e).split())[:200]}"
    return out


def predicted_generation(device: str) -> dict:
    """The time model's figures for GENERATION on the GPU of this device (the table's by its name: its published
    figures, the kernel times of GPUs, this box's own host per op, measured here: host_us_per_op(HERE)): {"eager_s",
    "graph_ms" (the U-Net's forward from a CUDA graph), "bound", "host"}."""
    import torch

    from .. import gpus
    from ..planner.calibration import target
    from ..planner.generation import GenerationSpec, predict_generation
    from ..planner.host import HERE

    name = torch.cuda.get_device_name(torch.device(device))
    gpu = gpus.named_in(name)
    if gpu is None:
        raise Skip(f"{name} is not a GPU of the table (attnprof gpus): no published figures to predict from")
    pipeline, size, steps = GENERATION
    spec = GenerationSpec(pipeline, size, size, steps, 7.5, backend="sdpa", dtype="float16")
    g = predict_generation(spec, *target("cuda", "float16", gpu["name"], host_us=HERE), "cuda")  # this box's host
    unet = next(p for p in g["parts"] if p["part"] == "denoise")
    return {"eager_s": g["total_s"], "graph_ms": unet["graph_ms"], "bound": g["bound"], "host": g["host"]}


def need_transformers() -> None:
    """The short generation's text encoder is transformers' CLIPTextModel, in its measurement (measure_generation)
    and in its prediction (planner/pipeline.text_ops). The lent GPU machine has no transformers
    (../shared/gpu/README.md): Skip, naming what is missing and what to carry (docs/gpu.md), rather than FAIL on a
    ModuleNotFoundError after minutes of device time."""
    try:
        from transformers import CLIPTextConfig, CLIPTextModel  # noqa: F401
    except ImportError as e:  # transformers itself, or a module it imports (regex), or one too old for it
        missing = getattr(e, "name", None)
        why = (f"no module {missing!r} here" if missing else " ".join(str(e).split())[:160])
        raise Skip(f"needs transformers (the text encoder's CLIPTextModel) and what it imports: {why}; carry their "
                   "wheels in .whl/ beside diffusers' (docs/gpu.md, carrying transformers)") from None


def short_generation_matches_its_prediction(ctx) -> Verdict:
    """SD 1.5 at 512x512, 10 steps under guidance 7.5, sdpa, float16: the generation measured eager and the U-Net's
    forward from a CUDA graph, against the time model's prediction for this GPU, eager and graphed."""
    need_transformers()
    ctx.need_cuda()
    predicted = predicted_generation(ctx.device)
    pipeline, size, steps = GENERATION
    return generation_verdict(measure_generation(ctx.device, pipeline, size, steps, "float16"), predicted)
