"""A measured run of tiny-sd15 at 512x512 on the CPU: every field filled, memory against its model and against an
independent check, errors within tolerance, unavailable backends as rows; the store's round trip; CLI errors."""
import json
import re

import numpy as np
import pytest
import torch

from profiler.cli import main
from profiler.store import Run, list_runs
from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute
from tests.rss import fresh_process_peak_rss

MiB = 2**20
BLOCK_FIELDS = ["run_id", "cell_id", "model", "width", "height", "batch", "dtype", "backend", "device", "block",
                "stage", "level", "kind", "heads", "head_dim", "tokens_q", "tokens_k", "score_elements",
                "score_bytes", "flops", "time_ms", "time_samples_ms", "noisy", "peak_mem_bytes",
                "predicted_peak_bytes", "kernel", "status"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    sweep = Sweep(models=("tiny-sd15",), sizes=((512, 512),), dtypes=("float32",), device="cpu", repeats=2,
                  warmup=0, backends=(("naive", ()), ("sdpa-flash", ()), ("xformers", ())),
                  out=str(tmp_path_factory.mktemp("results")))
    outcome = execute(sweep, workers=False, progress=False, command="test")
    return Run.open(outcome.run_path)


def test_one_row_per_call_per_cell_with_every_field(run):
    blocks = run.blocks()
    assert blocks.groupby("backend").size().to_dict() == {"naive": 32, "sdpa-flash": 32}
    assert blocks[BLOCK_FIELDS].notna().all().all()
    assert (blocks["time_ms"] > 0).all() and blocks["time_samples_ms"].map(len).eq(2).all()
    assert set(blocks["status"]) == {"ok"}
    # each row carries the time model's prediction made before the run, and measured / predicted (planner/timing.py);
    # the results folder held no run of this device before, so the prediction is the roofline bound
    assert (blocks["predicted_time_ms"] > 0).all()
    assert np.allclose(blocks["predicted_time_ratio"], blocks["time_ms"] / blocks["predicted_time_ms"])
    ok = run.cells().query("status == 'ok'")
    assert ok["predicted_time_source"].str.contains("roofline bound on this device's measured limits").all()
    assert np.allclose(ok["forward_time_ratio"], ok["forward_time_ms"] / ok["predicted_forward_time_ms"])
    assert not (run.path / "traces").exists() and "trace_files" not in run.cells()  # --trace is off by default
    kernels = blocks.groupby("backend")["kernel"].first().to_dict()
    assert kernels["naive"] == "aten::baddbmm,aten::bmm"
    assert kernels["sdpa-flash"] == "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_naive_peak_matches_its_model_and_flash_stays_far_below(run):
    b = run.blocks()
    finest = b[(b["tokens_q"] == 4096) & (b["kind"] == "self")]
    naive, flash = finest[finest["backend"] == "naive"], finest[finest["backend"] == "sdpa-flash"]
    assert len(naive) == 5  # 2 down + 3 up self-attentions at the finest level
    ratio = naive["peak_mem_bytes"] / naive["predicted_peak_bytes"]
    assert ratio.between(0.9, 1.1).all(), ratio.tolist()
    assert (naive["peak_mem_bytes"] > 1000 * MiB).all()  # two 512 MiB score tables at once
    assert flash["peak_mem_bytes"].max() < naive["peak_mem_bytes"].min() / 10


def test_naive_peak_agrees_with_a_fresh_process_peak_rss(run):
    """The same block's call, alone in a fresh process."""
    rss = fresh_process_peak_rss("""
import torch
from diffusers.models.attention_processor import AttnProcessor
from profiler.unet import models
unet = models.build("tiny-sd15", weights="random", dtype="float32")
attn = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
attn.set_processor(AttnProcessor())
x = torch.randn(1, 4096, attn.to_q.in_features)
def call():
    with torch.no_grad():
        attn(x)
""")
    b = run.blocks()
    measured = b[(b["backend"] == "naive") & (b["block"] == "down_blocks.0.attentions.0.transformer_blocks.0.attn1")]
    assert abs(measured["peak_mem_bytes"].iloc[0] - rss) / rss < 0.1, (measured["peak_mem_bytes"].iloc[0], rss)


def test_cells_errors_within_tolerance_and_unavailable_rows(run):
    cells = run.cells().set_index("backend")
    assert cells.loc["xformers", "status"] == "unavailable"
    assert cells.loc["xformers", "error"] == "xformers is not installed: pip install xformers"
    for name in ("naive", "sdpa-flash"):
        c = cells.loc[name]
        assert c["status"] == "ok" and c["error_ok"] and c["max_rel_err"] < 1e-3, c["max_rel_err"]
        assert c["calls"] == 32 and c["forward_time_ms"] > c["attention_time_ms"] > 0
        assert c["nvml_status"].startswith("unavailable")
    assert cells.loc["naive", "forward_peak_mem_bytes"] >= cells.loc["naive", "attention_peak_mem_bytes"]
    env = run.manifest()["environment"]
    assert env["torch"].startswith("2.13") and env["diffusers"] and env["git_revision"] is not None


def test_each_call_is_placed_against_the_devices_measured_limits(run):
    """The manifest holds the peaks measured at the start of the run; every ok call its achieved FLOP/s, the bytes
    its backend's model moves, its intensity and the percent of the roofline bound that applies."""
    m = run.manifest()
    peak, bandwidth = m["device_peak_flops"]["float32"], m["device_peak_bytes_per_s"]
    assert peak > 1e8 and bandwidth > 1e8 and m["device_limits"]["cache"].endswith("device-limits.json")
    cells, b = run.read()
    ok = cells[cells["status"] == "ok"]
    assert (ok["device_peak_flops_per_s"] == peak).all() and (ok["device_peak_bytes_per_s"] == bandwidth).all()
    assert b[["achieved_flops_per_s", "bytes_moved", "arithmetic_intensity", "pct_of_peak"]].gt(0).all().all()
    assert np.allclose(b["achieved_flops_per_s"], b["flops"] / (b["time_ms"] / 1e3))
    assert np.allclose(b["arithmetic_intensity"], b["flops"] / b["bytes_moved"])
    # a call whose working set stays in half the last-level cache meets the cache's bandwidth (measure/limits.place)
    from profiler.measure.limits import CACHE_SHARE
    from profiler.planner.memory import working_set

    cache = m["device_memory"]
    assert (ok["device_cache_bytes"] == cache["cache_bytes"]).all()
    working = np.array([working_set(r["backend"], r, "float32", **json.loads(r["backend_options"] or "{}"))
                        for r in b.to_dict("records")])
    rate = np.where(working <= CACHE_SHARE * cache["cache_bytes"], max(bandwidth, cache["cache_bytes_per_s"]),
                    bandwidth)
    bound = np.minimum(peak, b["arithmetic_intensity"] * rate)
    assert np.allclose(b["pct_of_peak"], 100 * b["achieved_flops_per_s"] / bound)
    assert (b["roofline_bound"] == np.where(b["arithmetic_intensity"] * rate < peak, "memory", "compute")).all()
    first = b[b["block"] == "down_blocks.0.attentions.0.transformer_blocks.0.attn1"].set_index("backend")
    assert (first["level"] == 0).all() and (first["kind"] == "self").all()
    # naive writes and reads its 512 MiB score table four times; flash reads Q, K, V and writes O once
    assert first.loc["naive", "bytes_moved"] == 4 * 8 * 4096 * 4 * 4 + 4 * 8 * 4096 * 4096 * 4
    assert first.loc["naive", "arithmetic_intensity"] < first.loc["sdpa-flash", "arithmetic_intensity"] / 100
    assert (ok["attention_pct_of_peak"] > 0).all()


def test_bfloat16_cells_on_the_cpu_are_judged_by_the_bfloat16_tolerance(tmp_path):
    """The reference is float32: a bfloat16 forward differs from it by more than float32's tolerance (1e-3) and less
    than bfloat16's (6e-2), so the per-dtype tolerance is what decides error_ok."""
    from profiler.measure.cell import TOLERANCE

    sweep = Sweep(models=("tiny-sd15",), sizes=((64, 64),), dtypes=("bfloat16",), device="cpu", repeats=1, warmup=0,
                  backends=(("naive", ()), ("sdpa", ()), ("split", ())), out=str(tmp_path))
    cells = Run.open(execute(sweep, workers=False, progress=False).run_path).cells()
    assert set(cells["status"]) == {"ok"} and cells["error_ok"].all()
    assert (cells["max_rel_err"] > TOLERANCE["float32"]).all(), cells["max_rel_err"].tolist()
    assert (cells["max_rel_err"] < TOLERANCE["bfloat16"]).all(), cells["max_rel_err"].tolist()
    assert set(cells["dtype"]) == {"bfloat16"}


@pytest.mark.parametrize("argv, message", [
    (["--backend", "flashy"], "unknown backend 'flashy': use one of naive, sliced"),
    (["--backend", "sliced", "--option", "slice_size=0"], "option slice_size=0 of backend 'sliced'"),
    (["--backend", "sliced", "--option", "slicesize"], "backend option 'slicesize' is not KEY=VALUE"),
    (["--device", "cuda:99"], "CUDA device(s): use cuda:0") if torch.cuda.is_available() else
    (["--device", "cuda"], "no CUDA device is visible here"),
    (["--device", "tpu"], "device 'tpu' is not auto, cpu, cuda or cuda:N"),
    (["--repeats", "0"], "--repeats 0 is too small"),
    (["--memory-budget", "lots"], "'lots' is not a size"),
])
def test_run_rejects_bad_input_before_measuring(tmp_path, capsys, argv, message):
    code = main(["run", "--model", "tiny-sd15", "--out", str(tmp_path / "results"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "results").exists()


def test_show_and_runs_print_the_run(run, capsys):
    assert main(["show", run.id, "--results", str(run.path.parent), "--wide"]) == 0  # every column (120 leave out
    out = capsys.readouterr().out  # 'of peak' since the core and projections columns came)
    assert "sdpa-flash" in out and "xformers is not installed" in out and "1.0 GiB" in out
    assert "of peak" in out and re.search(r"\d+\.\d% of (memory|compute)", out)  # the bound that applies
    assert "device limits (measured):" in out
    assert main(["runs", "--results", str(run.path.parent)]) == 0
    assert "2 ok, 1 unavailable" in capsys.readouterr().out
    assert main(["show", "nope", "--results", str(run.path.parent)]) == 2


def test_a_checkpoint_folder_is_measured_with_its_real_weights(tmp_path):
    from profiler.unet import models
    from profiler.measure.cell import ModelCache

    saved = models.build("tiny-sd15", weights="random", dtype="float32", seed=7)  # not the registry's seed 0
    saved.save_pretrained(tmp_path / "ckpt" / "unet", safe_serialization=True)
    _, unet = ModelCache().get(str(tmp_path / "ckpt"), "float32", "cpu")
    for (name, p), (_, q) in zip(unet.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_folder_with_only_bin_weights_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, tiny_sd15):
    folder = tmp_path / "ckpt"
    tiny_sd15.save_pretrained(folder / "unet", safe_serialization=False)
    results = tmp_path / "results"
    config = tmp_path / "sweep.yaml"
    config.write_text(f"models: [{folder}]\nsizes: [64x64]\ndtypes: [float32]\ndevice: cpu\nout: {results}\n")
    for argv in (["run", "--model", str(folder), "--size", "64x64", "--dtype", "float32", "--device", "cpu",
                  "--in-process", "--out", str(results)], ["sweep", str(config), "--in-process"],
                 ["plan", "--model", str(folder), "--size", "64x64"]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert f"model folder {folder / 'unet'} holds only diffusion_pytorch_model.bin" in err
        assert "diffusion_pytorch_model.safetensors" in err and "Traceback" not in err
        assert not results.exists()  # nothing written


def test_a_run_in_which_no_cell_ended_ok_exits_1(tmp_path, capsys):
    code = main(["run", "--model", "tiny-sd15", "--size", "64x64", "--dtype", "float32", "--device", "cpu",
                 "--backend", "xformers", "--in-process", "--quiet", "--out", str(tmp_path / "results")])
    out, err = capsys.readouterr()
    assert code == 1 and "unavailable" in out  # the status table still prints
    assert err.startswith("attnprof: no cell ended ok: see the errors with attnprof show ") and err.count("\n") == 1


def test_retry_failed_alone_resumes_the_latest_run_of_the_config(tmp_path, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text(f"models: [tiny-sd15]\nsizes: [64x64]\ndtypes: [float32]\nbackends: [sdpa, xformers]\n"
                      f"repeats: 1\nwarmup: 0\ndevice: cpu\nout: {tmp_path / 'results'}\n")
    assert main(["sweep", str(config), "--in-process", "--quiet"]) == 0
    first = Run.open(list_runs(tmp_path / "results")[0]).cells().set_index("backend")
    assert main(["sweep", str(config), "--retry-failed", "--in-process", "--quiet"]) == 0
    assert len(list_runs(tmp_path / "results")) == 1  # no new run of every cell
    second = Run.open(list_runs(tmp_path / "results")[0]).cells().set_index("backend")
    assert second.loc["sdpa", "recorded_at"] == first.loc["sdpa", "recorded_at"]  # ok: kept
    assert second.loc["xformers", "recorded_at"] != first.loc["xformers", "recorded_at"]  # not ok: run again
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "did not end ok (implies --resume)" in " ".join(capsys.readouterr().out.split())


def test_the_workers_calibration_answer_comes_back_on_its_stream():
    """On CUDA the sweep's parent asks a short-lived worker for the machine's calibration (the parent makes no CUDA
    context); its answer must come on the worker's own stream, not on stderr, where print() went and the first H200
    run failed every run-based step with 'the calibration exited with exit code 0'. Asked here of the CPU."""
    from profiler.execute.local import _subprocess

    answer = _subprocess("--calibrate", ["cpu", "start"], "the calibration")
    assert answer["when"] == "start" and answer["median_ms"] > 0 and len(answer["samples_ms"]) == 41
