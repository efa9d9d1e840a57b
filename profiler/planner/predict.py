"""The time model's one front door: the predicted times that plan, fit and plan --pipeline print, from the command
line (cli.py) and from Python (api.py) alike. Each takes where to predict for as the CLI names it (device, gpu,
results, host_us: calibration.target) and returns None or "" where there is nothing to predict for (CUDA on a machine
without a GPU, and no gpu)."""
from __future__ import annotations

from ..errors import InputError
from . import calibration, timing


def plans(found: list[dict], backend: str | None, dtype: str, device: str, gpu: str | None = None,
          results: str | None = None, host_us: float | None = None) -> None:
    """Each plan's predicted times (planner/timing.py) for backend (sdpa where None), added to it: on gpu's published
    figures, or on this machine's device, calibrated on the runs under results made on it."""
    from .. import gpus

    where = calibration.target(device, dtype, gpu, results, kept=True, host_us=host_us)
    if where is None:
        return
    limits, calibrated, table_gpu = where
    for p in found:
        timing.predict(p, backend or "sdpa", p["backend_options"], limits, calibrated, table_gpu, device)
        if table_gpu:
            p["totals"]["gpu_figures"] = gpus.describe(table_gpu, dtype)


def fit_lines(result: dict, model: str, settings: tuple, every: bool, dtype: str, batch: int, device: str,
              gpu: str | None = None, results: str | None = None, host_us: float | None = None) -> str:
    """Each backend's predicted forward time at its largest size, added to the fit's entries; the lines to print
    (every: a line per backend, else one per distinct answer)."""
    where = calibration.target(device, dtype, gpu, results, kept=True, host_us=host_us)
    if where is None:
        return ""
    from .fit import distinct

    lines, entries = [], {b["backend"]: b for b in result.get("backends", [])}
    for b in result.get("backends", []) if every else distinct(result.get("backends", [])):
        if b.get("largest"):
            p = timing.walked_plan(model, *b["largest"], batch, dtype, settings)
            t = timing.predict(p, b["backend"], {}, *where, device)
            for name in [b["backend"], *b.get("also", [])]:
                entries[name]["predicted_forward_time_ms"] = t["predicted_forward_time_ms"]
                if t.get("time_basis"):
                    entries[name]["time_basis"] = t["time_basis"]
            span = f" ({t['predicted_forward_low_ms']:,.1f} to {t['predicted_forward_high_ms']:,.1f})" \
                if "predicted_forward_low_ms" in t else ""
            lines.append(f"  {b['backend']:14s} {t['predicted_forward_time_ms']:12,.1f} ms at "
                         f"{p['width']}x{p['height']}{span}" + (f"; rests on {t['time_basis']}"
                                                              if t.get("time_basis") else ""))
    return "\n".join(["", f"forward time at the largest size ({t['time_source']}):", *lines]) if lines else ""


def step_line(result: dict, pipeline: str, settings: dict, cfg: bool, dtype: str, batch: int, device: str,
              gpu: str | None = None, results: str | None = None, host_us: float | None = None) -> str:
    """A whole generation's predicted time per denoising step at its largest size, added to the result: the U-Net's
    forward (with its ControlNet where given) at the step's batch (twice the images under classifier-free
    guidance); the line to print."""
    from ..unet.workload import check_settings
    from .pipeline import PIPELINES, pipeline_name

    where = calibration.target(device, dtype, gpu, results, kept=False, host_us=host_us)
    if where is None or not result.get("largest"):
        return ""
    unet = PIPELINES[pipeline_name(pipeline)]["unet"]
    p = timing.walked_plan(unet, *result["largest"], batch * (2 if cfg else 1), dtype, check_settings(unet, settings))
    t = timing.predict(p, result["backend"], {}, *where, device)
    result["predicted_step_time_ms"] = t["predicted_forward_time_ms"]
    if t.get("time_basis"):
        result["time_basis"] = t["time_basis"]
    return (f"\ntime per denoising step at {p['width']}x{p['height']}: {t['predicted_forward_time_ms']:,.1f} ms "
            f"({t['time_source']})" + (f"; it rests on {t['time_basis']}" if t.get("time_basis") else ""))


def generations(specs: list, dtype: str, device: str, gpu: str | None = None, results: str | None = None,
                host_us: float | None = None) -> list[dict]:
    """plan --pipeline: each generation's predicted time (planner/generation.py); bad input where there is nothing
    to predict for."""
    from .generation import predict_generation

    where = calibration.target(device, dtype, gpu, results, kept=False, host_us=host_us)
    if where is None:
        raise InputError("no GPU here to predict for: give --gpu NAME (attnprof gpus), or --device cpu "
                         "[--results DIR] for this machine's CPU")
    return [predict_generation(s, *where, device) for s in specs]
