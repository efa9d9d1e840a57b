"""attnprof replay: each distinct attention shape of a plan or a run, the backend's kernel alone on random Q, K, V;
stored as a run that show and diff read; no U-Net built (a fresh process stays far below SDXL's weights)."""
import subprocess
import sys

import pytest

from profiler.attention import backends
from profiler.cli import main
from profiler.measure.replay import shape_of
from profiler.planner import memory, plan
from profiler.store import Run, list_runs
from tests.rss import fresh_process_peak_rss_of


def _table_rows(out: str, header: str) -> list[str]:
    """The data rows of the per-shape table that follows the line starting with `header`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 3  # header, columns, rule
    return [line for line in lines[start:] if line.strip()][:next((i for i, line in enumerate(lines[start:])
                                                                    if not line.strip()), None)]


def test_a_plans_every_distinct_shape_is_replayed_and_stored_as_a_run(tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["replay", "--model", "tiny-sdxl", "--size", "256x256", "--backend", "sdpa", "--device", "cpu",
                 "--dtype", "float32", "--repeats", "2", "--warmup", "0", "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rows = plan("tiny-sdxl", 256, 256, 1, "float32")["blocks"]
    shapes = {shape_of(r) for r in rows}
    assert len(rows) == 140 and len(shapes) == 4  # SDXL: 140 calls; 2 levels with attention, self and cross each
    table = _table_rows(printed, "tiny-sdxl 256x256 batch 1 float32 sdpa: 140 calls, 4 distinct shapes")
    assert len(table) == 4 and all("TFLOP/s" not in row for row in table)
    run = Run.open(list_runs(out)[0])
    cells, blocks = run.read()
    (cell,) = cells.to_dict("records")
    assert cell["status"] == "ok" and cell["calls"] == 140 and cell["shapes"] == 4
    assert run.manifest()["replay"]["source"] == "a plan of tiny-sdxl" and run.manifest()["device_peak_flops"]
    assert blocks["block"].tolist() == [r["block"] for r in rows] and blocks["flops"].tolist() == [r["flops"]
                                                                                                   for r in rows]
    by_shape = blocks.assign(shape=[shape_of(r) for r in blocks.to_dict("records")]).groupby("shape")
    assert by_shape["time_ms"].nunique().eq(1).all()  # each shape measured once, its figures on all its calls
    assert by_shape["time_samples_ms"].first().map(len).ge(2).all()
    assert (blocks["kernel"] == "aten::_scaled_dot_product_flash_attention_for_cpu").all()
    assert blocks["bytes_moved"].tolist() == [memory.bytes_moved("sdpa", r, "float32") for r in rows]
    assert blocks["pct_of_peak"].gt(0).all() and blocks["in_model_time_ms"].isna().all()
    assert cell["attention_time_ms"] == pytest.approx(blocks["time_ms"].sum())
    assert main(["show", run.id, "--results", str(out)]) == 0 and "tiny-sdxl" in capsys.readouterr().out


def test_a_runs_replay_gives_the_gap_to_the_same_calls_inside_the_model(traced_results, tmp_path, capsys):
    root, _ = traced_results
    measured = Run.open(list_runs(root)[0])
    out = tmp_path / "results"
    code = main(["replay", measured.id, "--results", str(root), "--device", "cpu", "--repeats", "2", "--warmup", "0",
                 "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and f"of run {measured.id}" in printed
    replayed = Run.open(list_runs(out)[0])
    cells, blocks = replayed.read()
    assert sorted(cells["backend"]) == ["naive", "sdpa"] and set(cells["status"]) == {"ok"}  # the run's backends
    inside = measured.blocks().set_index(["backend", "block"])["time_ms"]
    mine = blocks.set_index(["backend", "block"])
    assert (mine["in_model_time_ms"] == inside.loc[mine.index]).all()
    assert (mine["gap_ms"] == mine["in_model_time_ms"] - mine["time_ms"]).all()
    naive = mine.loc["naive"]  # its memory model, less the Q, K and V that exist before the call here (to 64 B)
    assert (naive["peak_mem_bytes"] - naive["predicted_peak_bytes"]).abs().le(64).all()
    assert "-" not in [row.split()[-1] for row in _table_rows(printed, "tiny-sd15 64x64 batch 1 float32 naive")]
    assert main(["diff", str(measured.path), str(replayed.path), "--results", str(out), "--json"]) in (0, 1, 3)
    assert '"matched": 2' in capsys.readouterr().out  # diff matches the replay's cells with the run's


def test_sdxl_is_replayed_without_building_the_unet(tmp_path):
    """SDXL's weights alone are 10.3 GB in float32; the replay process stays far below them."""
    rows = plan("sdxl-base", 512, 512, 1, "float32")["blocks"]
    peak, out = fresh_process_peak_rss_of(["replay", "--model", "sdxl-base", "--size", "512x512", "--backend", "sdpa",
                                           "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                                           "--quiet", "--out", str(tmp_path / "results")])
    assert peak < 2 * 2**30, peak  # torch, diffusers and the meta-device plan: well under 2 GiB
    table = _table_rows(out, "sdxl-base 512x512 batch 1 float32 sdpa: 140 calls, 4 distinct shapes")
    assert len(table) == len({shape_of(r) for r in rows}) == 4


@pytest.mark.parametrize("argv, message", [
    (["latest", "--model", "tiny-sd15"], "replay takes a run (RUN) or a plan (--model M --size WxH), one of the two"),
    ([], "replay takes a run (RUN) or a plan"),
    (["latest", "--size", "64x64"], "--size, --batch and --dtype go with --model"),
    (["--model", "tiny-sd15", "--backend", "nope"], "unknown backend 'nope'"),
    (["--model", "tiny-sd15", "--repeats", "0"], "--repeats must be 1 or more"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    code = main(["replay", *argv, "--device", "cpu", "--results", str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_console_entry_point_takes_replay():
    p = subprocess.run([sys.executable, "-m", "profiler", "replay", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "kernel alone" in " ".join(p.stdout.split())


def test_on_a_gpu_an_isolated_call_is_timed_by_its_kernels_each_after_an_l2_flush(monkeypatch):
    """replay on CUDA times a call as Inductor's do_bench_using_profiling does: its kernels (CUPTI), calls back to
    back in batches, a flush of twice the L2 before each outside its range. Here on the synthetic GPU
    (tests/gpu_trace.py): every sample is the call's kernels alone (the flush's kernel not among them), SD 1.5's
    1024-token self-attention at its real head dim 80 under naive: baddbmm, softmax, bmm and the head layouts."""
    from profiler.measure import replay
    from profiler.spec import CellSpec
    from tests import gpu_trace

    durations = {"aten::baddbmm": 300_000, "aten::_softmax": 100_000, "aten::bmm": 200_000}
    traces = gpu_trace.install(monkeypatch, lambda name, core: durations.get(name, 7_000))
    shape = {"batch": 1, "heads": 8, "head_dim": 80, "tokens_q": 1024, "tokens_k": 1024, "kind": "self",
             "upcast": "", "block": "down_blocks.1.attentions.0.transformer_blocks.0.attn1"}
    spec = CellSpec("sd15", 512, 512, 1, "float32", "naive", "cpu")
    got = replay.measure_shape(shape, spec, repeats=3, warmup=1)
    kernels = [e for e in traces[0] if e.name().startswith("synthetic_kernel")]
    flushes = [e for e in kernels if "zero_" in e.name() or "fill_" in e.name()]
    assert flushes and got["time_source"] == "cupti" and len(got["time_samples_ms"]) >= 10
    others = {round((e.end_ns() - e.start_ns()) / 1e6, 6) for e in kernels} - {0.3, 0.1, 0.2}
    assert others == {0.007}  # the layout copies'
    per_call = sum(durations.values()) / 1e6
    assert all(per_call <= s < per_call + 0.007 * 6 for s in got["time_samples_ms"]), got["time_samples_ms"][:3]
    assert len(set(got["time_samples_ms"])) == 1 and not got["noisy"]
