"""make gpu-check's judges of the time model (gpu_check/model_judges.py: the audit's N8 and N9) and its short
generation against the prediction, each made to FAIL on bad data and to PASS on good: the H200 run's own tables
(docs/gpu-check-2026-12-04), as stored and with what its limits gave, and synthetic figures. Nothing here times
anything but the tiny generation whose figures no verdict depends on."""
from pathlib import Path

import pandas as pd
import pytest

from profiler import gpus
from profiler.gpu_check import model_judges as mj
from profiler.gpu_check.verdicts import Context, Skip
from profiler.planner import timing

RUN = Path(__file__).resolve().parent.parent / "docs" / "gpu-check-2026-12-04"
HOW = {"core run": (1, 3), "event time": (2, 10), "oom": (0, 1)}  # gpu_check/checks.py's warm-up and repeats then


@pytest.fixture(scope="module")
def h200():
    """(cells, blocks) of the H200 run's core cells and its OOM step's cold cell, each cell with its warm-up and
    repeats as the checks of that run measured them."""
    cells, blocks = pd.read_csv(RUN / "cells.csv"), pd.read_csv(RUN / "blocks.csv")
    keep = cells["step"].isin(["core run", "oom"])
    cells = cells[keep].assign(warmup=lambda c: c["step"].map(lambda s: HOW[s][0]),
                               repeats=lambda c: c["step"].map(lambda s: HOW[s][1]))
    return cells, blocks[blocks["cell_id"].isin(cells["cell_id"]) & blocks["step"].isin(["core run", "oom"])]


def _floors(blocks: pd.DataFrame, limits: dict) -> pd.DataFrame:
    """Each call's roofline_time_ms as the sweep attaches it (planner/timing.predict on these limits)."""
    out = []
    for (model, width, backend), calls in blocks.groupby(["model", "width", "backend"], sort=False):
        p = timing.walked_plan(model, int(width), int(width), 1, "float16")
        timing.predict(p, backend, {}, limits, None, device="cuda")
        floors = [b["roofline_time_ms"] for b in p["blocks"]]
        out.append(calls.sort_values("call_index").assign(roofline_time_ms=floors))
    return pd.concat(out)


def test_n8_fails_on_the_limits_the_h200_run_stored_and_passes_on_rates(h200):
    """As stored: the L2's copy at 1.35e12 B/s below DRAM's 4.24e12, softmax at 3.74e11 /s (the audit's solved rate:
    costs per launch), and on those limits the floors above 1.1x the kernels on most SDPA calls: FAIL. With a cache
    bandwidth and softmax rate that are rates (synthetic: B_c = B, S = B/2) and the floors on the H200's published
    figures: PASS, every call within."""
    cells, blocks = h200
    core = cells[cells["step"] == "core run"]
    stored = core.assign(device_softmax_per_s=3.7363e11)
    recorded = {"device_peak_flops": {"float16": 6.458e14}, "device_peak_bytes_per_s": 4.2408e12,
                "device_memory": {"cache_bytes": 62914560, "cache_bytes_per_s": 1.3527e12},
                "device_softmax_per_s": {"float16": 3.7363e11}, "device_limits": {"device": "cpu"}}
    calls = blocks[blocks["step"] == "core run"]
    # the recorded model's floors (the cache priced as measured, exponentials added to the GEMMs): Device.of refuses
    # that cache now, so they are made with it given whole
    old = timing.Device(6.458e14, 4.2408e12, 62914560, 1.3527e12, softmax=3.7363e11)
    rows = []
    for (model, width, backend), mine in calls.groupby(["model", "width", "backend"], sort=False):
        w = timing.walk(model, int(width), int(width), 1, "float16")
        floors = [timing.call_features(r, backend, {}, "float16", timing.roof_ms(o, old), old)["roofline_ms"]
                  for r, o in zip(mine.sort_values("call_index").fillna({"upcast": ""}).to_dict("records"), w["calls"])]
        rows.append(mine.sort_values("call_index").assign(roofline_time_ms=floors))
    bad = mj.device_limits_are_rates(stored, pd.concat(rows), "cuda")
    assert bad.failed and "cache bandwidth 1.35e+12 B/s over memory's 4.24e+12: 0.319" in bad.failed[0]
    assert any("softmax 3.74e+11" in f for f in bad.failed) and any("have a floor above 1.1x" in f for f in bad.failed)
    good_cells = core.assign(device_cache_bytes_per_s=core["device_peak_bytes_per_s"],
                             device_softmax_per_s=core["device_peak_bytes_per_s"] / 2)
    h = gpus.get("H200")
    good = mj.device_limits_are_rates(good_cells, _floors(calls, gpus.limits(h, "float16")), "cuda")
    assert good.failed == [] and "floors within 1.1x the kernels on 1032 of 1032 calls" in good.figure


def test_n8_fails_where_the_sweep_attached_no_floors(h200):
    cells, blocks = h200
    core = cells[cells["step"] == "core run"]
    v = mj.device_limits_are_rates(core.assign(device_cache_bytes_per_s=5e12, device_softmax_per_s=3e12),
                                   blocks[blocks["step"] == "core run"], "cuda")
    assert v.failed == ["no call has a roofline_time_ms (the sweep attaches each call's floor: planner/timing.attach)"]


def test_n9_passes_on_the_h200_kernel_times_and_refuses_the_cold_cell(h200):
    """The H200 run's cells on their kernel times (gpu_time_ms): each model's sums predicted from the other's within
    [0.8, 1.25] for every backend; the OOM step's cell (warm-up 0, 1 repeat) refused by name, none admitted cold."""
    cells, blocks = h200
    v = mj.time_model_fits_kernel_times_across_models(cells, blocks, "cuda")
    assert v.failed == [], v.failed
    assert "12 cells admitted, 1 refused, warm-up-0 cells admitted: 0" in v.figure
    assert any("warm-up 0 (at least 1), 1 repeats (at least 3)" in r["rule"] and r["cell_id"] == "594b2133bb32"
               for r in v.evidence)
    assert sum(r["table"] == "check" for r in v.evidence) == 12  # 6 backends x 2 models


def test_n9_fails_where_one_models_kernels_do_not_scale_as_the_models_say(h200):
    """sdxl's kernel times 1.6x what the H200 ran (as if its calls were timed on another clock): the fit to sd15
    predicts them short, the fit to sdxl predicts sd15 long: FAIL for every backend."""
    cells, blocks = h200
    scaled = blocks.assign(gpu_time_ms=blocks["gpu_time_ms"] * blocks["model"].map({"sdxl-base": 1.6}).fillna(1.0))
    v = mj.time_model_fits_kernel_times_across_models(cells, scaled, "cuda")
    assert len(v.failed) == 12 and all("predicted / kernels" in f for f in v.failed)


def test_n9_refuses_event_timed_cells_and_skips_with_one_model(h200):
    """A run stored before CUPTI kernel times whose calls lack gpu_time_ms: every cell refused as event-timed, and
    with no two models left the judge SKIPs (never a PASS)."""
    cells, blocks = h200
    with pytest.raises(Skip, match="two are needed"):
        mj.time_model_fits_kernel_times_across_models(cells, blocks.assign(gpu_time_ms=float("nan")), "cuda")


def test_the_short_generation_verdict_fails_off_the_prediction_and_passes_near_it():
    predicted = {"eager_s": 1.1, "graph_ms": 21.0, "bound": "host", "host": "given (--host-us-per-op)"}
    good = mj.generation_verdict({"eager_s": 1.0, "graph_ms": 20.0}, predicted)
    assert good.failed == [] and "eager generation: measured 1 s, predicted 1.1 s (1.10x)" in good.figure
    bad = mj.generation_verdict({"eager_s": 0.5, "graph_ms": 20.0}, predicted)
    assert bad.failed == ["eager generation: predicted / measured 2.200"]
    graphless = mj.generation_verdict({"eager_s": 1.0, "why_no_graph": "capture failed: x"}, predicted)
    assert graphless.failed == [] and "not measured (capture failed: x)" in graphless.figure


def test_the_short_generation_is_measured_on_the_cpu_and_skipped_without_cuda():
    """The measuring code runs whole on the tiny pipeline (SD 1.5's topology): a wall time, and no graph, said why;
    the check itself needs CUDA and SKIPs here."""
    m = mj.measure_generation("cpu", "tiny-sd15", 64, 2, "float32", generations=1)
    assert m["eager_s"] > 0 and m["why_no_graph"] == "CUDA graphs need a GPU" and "graph_ms" not in m
    with pytest.raises(Skip, match="needs a CUDA device"):
        mj.short_generation_matches_its_prediction(Context(device="cpu"))


def test_the_short_generation_skips_in_one_line_where_transformers_does_not_import(monkeypatch):
    """The lent GPU machine has no transformers: the step SKIPs before any device time, naming what is missing and
    where to read how to carry it, whether transformers itself is missing or a module it imports (regex), not a
    ModuleNotFoundError's FAIL."""
    import subprocess
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ModuleNotFoundError
    with pytest.raises(Skip) as e:
        mj.short_generation_matches_its_prediction(Context(device="cpu"))
    assert str(e.value) == ("needs transformers (the text encoder's CLIPTextModel) and what it imports: no module "
                            "'transformers' here; carry their wheels in .whl/ beside diffusers' (docs/gpu.md, carrying "
                            "transformers)")
    hidden_dependency = ("import sys; sys.modules['regex'] = None\n"
                         "from profiler.gpu_check import model_judges as mj\n"
                         "from profiler.gpu_check.verdicts import Skip\n"
                         "try:\n    mj.need_transformers()\nexcept Skip as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", hidden_dependency], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "'regex'" in out.stdout and "docs/gpu.md" in out.stdout, out.stdout + out.stderr
