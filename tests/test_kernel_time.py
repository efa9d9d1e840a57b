"""On a GPU a call's time is its kernels' (issue 51): the CUDA path of measure/passes.py run on the CPU against a
synthetic GPU (tests/gpu_trace.py: each compute op's kernel written into the profiled forwards' traces, a few
microseconds each, while the host takes milliseconds: a host-bound forward, as an eager U-Net at batch 1 is on an
H200). What is stored, read back from the run, is held against the kernels credited to each call independently."""
import re
import statistics

import pytest
import torch

from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute
from profiler.measure import passes
from profiler.report.findings import findings
from profiler.store import Run
from tests import gpu_trace

CORE_NS = {"naive": 30_000, "sdpa": 1_000}  # each attention core op's kernel: naive's three slow, SDPA's one fast
OTHER_NS = 2_000  # every other kernel (projections, norms, convolutions)


def _duration(name: str, in_core: bool) -> int:
    if not in_core:
        return OTHER_NS
    return CORE_NS["sdpa"] if "scaled_dot_product" in name else CORE_NS["naive"]


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    """tiny-sd15 (SD 1.5's block topology) at 64x64 on the synthetic GPU: naive (slow kernels, a fast host) and
    fault-scaled (SDPA with fast kernels, its host 4 ms late on every call), timed as on CUDA with the do_bench
    minimums cut so that the run takes seconds."""
    from profiler.measure import calibrate
    from tests import faults

    mp = pytest.MonkeyPatch()
    mp.setattr(calibrate, "calibrate", calibrate.calibrate)  # taken back after: _steady_machine replaces it
    faults.register_all()
    mp.setenv("ATTNPROF_FAULT_FACTOR", "0.1")
    mp.setenv("ATTNPROF_FAULT_STEADY", "1")
    faults._steady_machine()  # the run's own calibrations steady: no verdict of this test rests on the machine's load
    mp.setenv("ATTNPROF_CACHE", str(tmp_path_factory.mktemp("cache")))
    for name, value in (("MIN_PLAIN_S", 0.0), ("WARM_S", 0.0), ("MIN_PLAIN", 2), ("WARM_FORWARDS", 1),
                        ("PROFILED", 4)):
        mp.setattr(passes, name, value)
    traces = gpu_trace.install(mp, _duration)
    out = tmp_path_factory.mktemp("runs")
    sweep = Sweep(models=("tiny-sd15",), sizes=((64, 64),), dtypes=("float32",), device="cpu", repeats=3, warmup=1,
                  backends=(("naive", ()), ("fault-scaled", ())), out=str(out), trace="kernels")
    try:
        run = Run.open(execute(sweep, workers=False, progress=False).run_path)
        yield run, traces
    finally:
        mp.undo()
        faults.unregister_all()


def test_each_calls_stored_time_is_the_kernel_time_credited_to_it(kernel_run):
    run, traces = kernel_run
    cells, blocks = run.read()
    assert set(cells["status"]) == {"ok"} and set(blocks["time_source"]) == {"cupti"}
    for cell in cells.to_dict("records"):
        mine = blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index")
        # each block once in tiny-sd15's forward; a call's range is named by its block, and in a trace's later
        # forwards by its block and index (probes.CallTimer)
        ranges = {name: i for i, b in enumerate(mine["block"]) for name in (b, f"{b} (call {i})")}
        core = "aten::baddbmm" if cell["backend"] == "naive" else "scaled_dot_product"  # whose traces are whose
        sums: dict = {}
        for evs in traces:
            if any(core in e.name() for e in evs if e.name().startswith("synthetic_kernel")):
                for key, values in gpu_trace.credited(evs, ranges).items():
                    sums.setdefault(key, []).extend(values)
        for row in mine.to_dict("records"):
            credited = sums[row["call_index"]]
            assert len(credited) >= passes.PROFILED and row["time_samples_ms"] == pytest.approx(credited)
            assert row["time_ms"] == pytest.approx(statistics.median(credited))
            assert row["attn_kernel_ms"] + row["proj_kernel_ms"] == pytest.approx(row["time_ms"])
            core_ns = 3 * CORE_NS["naive"] if cell["backend"] == "naive" else CORE_NS["sdpa"]  # baddbmm, softmax, bmm
            assert row["attn_kernel_ms"] == pytest.approx(core_ns / 1e6), row["block"]
            assert row["host_ms"] > 0 and row["gpu_span_ms"] >= row["time_ms"] and row["event_ms"] > 0
            assert row["launch_bound"] == (row["host_ms"] > row["gpu_span_ms"])


def test_a_host_bound_cell_says_so_and_its_forward_is_timed_plain(kernel_run):
    run, _ = kernel_run
    cells, blocks = run.read()
    for cell in cells.to_dict("records"):
        calls = blocks[blocks["cell_id"] == cell["cell_id"]]
        assert cell["time_source"] == "cupti"
        assert cell["gpu_busy_pct"] == pytest.approx(100 * cell["forward_gpu_ms"] / cell["forward_time_ms"])
        assert cell["bound"] == "host" and cell["gpu_busy_pct"] < 50, cell["gpu_busy_pct"]
        assert cell["attention_time_ms"] == pytest.approx(calls["time_ms"].sum())  # every forward alike here
        assert cell["forward_gpu_ms"] > cell["attention_time_ms"]  # the forward's other kernels too
        assert cell["attention_kernel_ms"] == pytest.approx(calls["attn_kernel_ms"].sum())
        assert cell["plain_attn_kernel_ms"] == pytest.approx(cell["attention_kernel_ms"])  # hooks change no kernel
        assert len(cell["forward_time_samples_ms"]) >= passes.MIN_PLAIN and cell["timing_rounds"] >= 2
        assert cell["hooked_forward_ms"] > 0 and cell["forward_host_ms"] > 0
        assert cell["forward_graph_error"] == "RuntimeError: no CUDA graphs on a synthetic GPU"
        assert cell["timing_with"] == ("fault-scaled" if cell["backend"] == "naive" else "naive")


def test_findings_rank_by_kernel_time_not_by_the_host(kernel_run):
    """fault-scaled's host is 4 ms late on every call (its forward the slower by host and events), its kernels the
    faster: the findings name it the fastest, by its kernels."""
    run, _ = kernel_run
    cells, blocks = run.read()
    by = cells.set_index("backend")
    assert by.loc["fault-scaled", "attention_host_ms"] > by.loc["naive", "attention_host_ms"]
    assert by.loc["fault-scaled", "attention_time_ms"] < by.loc["naive", "attention_time_ms"]
    said = "\n".join(findings(cells, blocks, run.manifest()))
    assert "fault-scaled was the fastest" in said, said
    assert "the host sets the pace" in said, said


H200 = __import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "gpu-check-2026-12-04"


def _h200(backends_: tuple[str, ...], model: str = "sd15"):
    """The first H200 run's core cells of these backends (as that run stored them: event-timed), read as stored runs
    are (report/frame.normalised)."""
    import pandas as pd

    from profiler.report.frame import normalised

    floats = lambda text: [float(v) for v in text.strip("[]").split()]  # noqa: E731 (numpy's print of a list)
    cells, blocks = (pd.read_csv(H200 / f) for f in ("cells.csv", "blocks.csv"))
    cells = cells[(cells["step"] == "core run") & (cells["model"] == model) & cells["backend"].isin(backends_)]
    blocks = blocks[blocks["cell_id"].isin(cells["cell_id"]) & (blocks["step"] == "core run")]
    cells = cells.assign(settings=cells["settings"].fillna("{}"), backend_options="{}",
                         attention_time_samples_ms=cells["attention_time_samples_ms"].map(floats))
    blocks = blocks.assign(settings=blocks["settings"].fillna("{}"), backend_options="{}",
                           time_samples_ms=blocks["time_samples_ms"].map(floats))
    drop = ["time_source", "size", "pixels", "aspect", "frames", "backend_label", "settings_label", "family"]
    return normalised(cells.drop(columns=drop)), normalised(blocks.drop(columns=drop[1:], errors="ignore"))


def test_the_h200s_event_timed_cells_are_labelled_and_not_ranked_by_their_events():
    """The first H200 run's sd15 cells as stored: its events named sdpa-efficient the fastest (15.65 ms against
    cuDNN's 16.88: the host's speed, not the kernels'); read now, they are labelled event-timed and not ranked."""
    cells, blocks = _h200(("sdpa-cudnn", "sdpa-efficient"))
    assert set(cells["time_source"]) == {"cuda events"} and set(blocks["time_source"]) == {"cuda events"}
    said = findings(cells, blocks)
    assert said[0].startswith("Times not judged: this run's CUDA times are events around each call")
    assert not any("was the fastest" in s for s in said), said


def test_show_says_each_cuda_cells_clock_and_bound(kernel_run):
    """attnprof show of a kernel-timed run: each cell's clock (cupti), its forward's bound with the GPU's busy share
    and its attention calls' host time, as stored; the legend says what they are; no event-timed note."""
    from profiler.report.show import format_run

    run, _ = kernel_run
    cells, _ = run.read()
    out = format_run(run, None, legend=True)
    table = out.split("\n\n")[[i for i, part in enumerate(out.split("\n\n")) if part.startswith("model")][0]]
    header, _, *rows = table.splitlines()
    assert header.split()[header.split().index("attention"):][:7] == ["attention", "core", "projections", "clock",
                                                                      "bound", "attn", "host"]
    for c in cells.to_dict("records"):
        row = next(r for r in rows if f" {c['backend_label']} " in r)
        assert "cupti" in row and f"host, GPU {c['gpu_busy_pct']:.0f}% busy" in row, row
        assert f"{c['attention_host_ms']:.1f} ms" in row, row
    assert "clock: what timed the attention (time_source: cupti" in out and "busy under 70% of it" in out
    assert "not kernel time" not in out


def _stored_h200(root) -> Run:
    """The first H200 run's sd15 cudnn and efficient cells stored as that run stored them: no time_source (read
    back, normalised says cuda events)."""
    cells, blocks = _h200(("sdpa-cudnn", "sdpa-efficient"))
    run = Run.create(root, {"command": "gpu-check core run", "cells": [], "environment": {"device": "cuda"}})
    for c in cells.drop(columns=["time_source"]).to_dict("records"):
        run.record(c, blocks[blocks["cell_id"] == c["cell_id"]].drop(columns=["time_source"]).to_dict("records"))
    return Run.open(run.path)


def test_show_notes_an_event_timed_cuda_run(tmp_path):
    """show names the clock of each of the H200's event-timed cells and says under the table that the times are
    the host's."""
    from profiler.report.show import format_run

    out = format_run(_stored_h200(tmp_path), 118)
    rows = [line for line in out.splitlines() if line.startswith("sd15 ")]
    assert len(rows) == 2 and all("cuda events" in r for r in rows), out
    assert "note: this run's CUDA times are cuda events around each call in a hooked forward (recorded before " \
           "attnprof timed\n  kernels): the host's time on a host-bound GPU, not kernel time" in out, out


def test_the_report_labels_an_event_timed_cuda_run(tmp_path):
    """attnprof report of the H200's event-timed cells: its findings open with the event-timed label and name no
    fastest; its cells table gives each cell's clock."""
    import html

    pytest.importorskip("vl_convert", reason="the report embeds vl-convert-python's Vega bundle")
    from dashboards.report import render

    page = html.unescape(render([_stored_h200(tmp_path).path]))
    found = page.split("<h2>Findings</h2>")[1].split("<h2>")[0]
    assert "<li>Times not judged: this run's CUDA times are events around each call" in found, found
    assert "was the fastest" not in found
    cells = page.split("<h2>Cells</h2>")[1]
    assert "<th>time_source</th>" in cells and cells.count("<td>cuda events</td>") == 2


def test_the_h200s_kernels_rank_cudnn_ahead_of_efficient():
    """The same cells with each call's kernels (gpu_time_ms, CUPTI's) as its time, as a kernel-timed run stores
    them: cuDNN 1.31 ms against mem-efficient's 2.53 ms a forward, so cuDNN is the fastest."""
    cells, blocks = _h200(("sdpa-cudnn", "sdpa-efficient"))
    blocks = blocks.assign(time_ms=blocks["gpu_time_ms"], time_source="cupti",
                           time_samples_ms=[[g] * 5 for g in blocks["gpu_time_ms"]])
    sums = blocks.groupby("cell_id")["gpu_time_ms"].sum()
    cells = cells.assign(time_source="cupti", attention_time_ms=cells["cell_id"].map(sums),
                         attention_time_samples_ms=[[sums[c]] * 5 for c in cells["cell_id"]])
    said = " ".join(findings(cells, blocks))
    assert "sdpa-cudnn was the fastest: 1.31 ms of attention kernels per forward" in said, said
    assert "1.93x faster" not in said  # against naive only, and naive is not in these cells


def test_a_gap_within_the_samples_spread_names_no_fastest():
    cells, blocks = _h200(("sdpa", "sdpa-cudnn"))
    blocks = blocks.assign(time_source="cupti")
    cells = cells.assign(time_source="cupti", attention_time_ms=[1.312, 1.310],
                         attention_time_samples_ms=[[1.30, 1.31, 1.312, 1.33, 1.34], [1.29, 1.30, 1.310, 1.32, 1.34]])
    said = " ".join(findings(cells, blocks))
    assert "no backend is clearly the fastest: sdpa-cudnn (1.31 ms) and sdpa (1.31 ms) lie within their summed " \
           "spread" in said, said


def test_the_machine_state_verdicts():
    from profiler.measure.state import verdict

    steady = {"host_launch_us_before": 5.0, "host_launch_us_after": 5.2, "gpu_ref_ms_before": 1.0,
              "gpu_ref_ms_after": 1.04, "sm_clock_mhz_median": 1950, "sm_clock_mhz_max": 1980, "clock_reasons": None}
    assert verdict(steady) == {"unsteady": None, "unsteady_gpu": False}
    host = verdict({**steady, "host_launch_us_after": 7.35})
    assert host == {"unsteady": "the host's launch cost moved +47% (5 -> 7.35)", "unsteady_gpu": False}
    assert verdict({**steady, "gpu_ref_ms_after": 1.1})["unsteady_gpu"]
    clock = verdict({**steady, "sm_clock_mhz_median": 1600})
    assert clock["unsteady_gpu"] and "the SM clock's median 1600 MHz is 81% of its highest 1980 MHz" in \
        clock["unsteady"]
    hw = verdict({**steady, "clock_reasons": "hw thermal slowdown"}, reasons=0x40)
    assert hw == {"unsteady": "NVML saw hw thermal slowdown", "unsteady_gpu": True}
    assert not verdict(steady, reasons=0x4)["unsteady_gpu"]  # the software power cap is no hardware slowdown


def test_a_kept_kernel_trace_reads_again_as_the_calls_it_timed(kernel_run, tmp_path):
    """trace "kernels" keeps each cell's first profiled trace (trace.save: gzipped, names interned); read again
    (trace.load) its calls' kernels are the cell's first samples; make gpu-check copies one a model to the top of
    --out (report.Out.keep_traces), the sdpa cell's where there is one, else the first."""
    import shutil

    from profiler.gpu_check import report
    from profiler.measure import trace

    run, _ = kernel_run
    cells, blocks = run.read()
    for cell in cells.to_dict("records"):
        evs, meta = trace.load(run.path / "traces" / f"{cell['cell_id']}.kernels.json.gz")
        windows = trace.call_samples(evs, meta["ranges"])
        mine = blocks[blocks["cell_id"] == cell["cell_id"]].set_index("call_index")
        for key, w in windows.items():
            assert [x["gpu_time_ms"] for x in w] == pytest.approx(mine.loc[int(key), "time_samples_ms"][:len(w)])
        plain = trace.forward_kernels(evs, meta["plain"])
        assert len(plain) == 1 and plain[0]["gpu_ms"] == pytest.approx(cell["forward_gpu_ms"])
    runs = tmp_path / "runs"
    shutil.copytree(run.path, runs / run.path.name)
    copied = Run.open(runs / run.path.name)
    copied.update_manifest(command="gpu-check core run")
    out = report.Out(tmp_path / "gc", runs)
    assert out.keep_traces("core run") == ["trace-tiny-sd15.json.gz"]
    first = cells.sort_values("backend", key=lambda b: b != "sdpa", kind="stable")["cell_id"].iloc[0]
    assert (tmp_path / "gc" / "trace-tiny-sd15.json.gz").read_bytes() == \
        (run.path / "traces" / f"{first}.kernels.json.gz").read_bytes()


def test_a_profiled_generation_on_a_gpu_stores_each_calls_kernels_and_its_host_time(monkeypatch, tmp_path, capsys):
    """profiler.profile on CUDA (the synthetic GPU): the generation runs under the profiler, each call a range; its
    time is the kernels credited to it (found independently), its host time beside it, where the kernels went
    (its attention core's and the rest: no projection hook of the CPU's), and the stored run says cupti; the component
    forwards are events; print(prof) and attnprof show tell the core from the projections."""
    import importlib.util

    from profiler import profile
    from profiler.cli import main

    spec = importlib.util.spec_from_file_location("generate", H200.parent / "examples" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    traces = gpu_trace.install(monkeypatch, _duration)
    pipe = gen.tiny_pipeline()
    with profile(pipe, out=tmp_path) as prof:
        gen.generate(pipe, steps=2)
        hooked = [m for m in pipe.unet.modules() if isinstance(m, torch.nn.Linear) and m._forward_hooks]
    calls = prof.calls
    assert not hooked  # the projections' own hooks are the CPU's: here the trace splits each call
    assert len(traces) == 1 and len(calls) and calls["time_ms"].gt(0).all()
    # each call's range as the session names it: component, block, batch x query tokens x key tokens
    names = [f"{c}.{b}" if c in ("unet", "model") else b for c, b in zip(calls["component"], calls["block"])]
    names = [f"{n} {b}x{q}x{k}" for n, b, q, k in zip(names, calls["batch"], calls["tokens_q"], calls["tokens_k"])]
    # a call's range is its name, or after its first step its name and " (call N)" (probes.CallTimer): every such
    # range in time order is a call in the order the calls ran
    ranged = {e.name(): 0 for e in traces[0] if any(e.name() == n or e.name().startswith(f"{n} (call ")
                                                    for n in set(names))}
    credited = gpu_trace.credited(traces[0], {name: 0 for name in ranged})[0]
    assert calls["time_ms"].tolist() == pytest.approx(credited)
    unet = calls[calls["component"] == "unet"]
    core = CORE_NS["sdpa"] / 1e6  # the pipeline's own processors: AttnProcessor2_0, SDPA's one core kernel
    assert unet["attn_kernel_ms"].tolist() == pytest.approx([core] * len(unet))
    assert (unet["attn_kernel_ms"] + unet["proj_kernel_ms"]).tolist() == pytest.approx(unet["time_ms"].tolist())
    assert unet["host_ms"].gt(unet["time_ms"]).all()  # launches slow, kernels microseconds
    cells, blocks = Run.open(prof.run_dir).read()
    assert cells["time_source"].tolist() == ["cupti"] and set(blocks["time_source"]) == {"cupti"}
    assert cells["attention_host_ms"].iloc[0] > cells["attention_time_ms"].iloc[0]
    # every reader tells the core from the projections: print(prof) per component, show per cell and component
    comps = prof.components.set_index("component")
    core, proj = unet["attn_kernel_ms"].sum(), unet["proj_kernel_ms"].sum()
    assert comps.loc["unet", ["attention_core_ms", "attention_proj_ms"]].tolist() == pytest.approx([core, proj])
    assert re.search(rf"unet +2 +[\d.]+ ms +[\d.]+% +{len(unet)} +[\d.]+ ms +{core:.1f} ms +{proj:.1f} ms", str(prof))
    assert main(["show", str(prof.run_dir), "--wide"]) == 0
    shown = capsys.readouterr().out
    cell = cells.iloc[0]
    assert re.search(rf" {cell['attention_time_ms']:.1f} ms +{cell['attention_kernel_ms']:.1f} ms +"
                     rf"{cell['attention_proj_ms']:.1f} ms ", shown), shown
    assert re.search(rf"unet +UNet2DConditionModel +2 +[\d.]+ ms +[\d.]+% +{len(unet)} +[\d.]+ ms +{core:.1f} ms +"
                     rf"{proj:.1f} ms", shown), shown


def test_record_reads_the_machines_speed_on_the_device_the_generation_ran_on(tmp_path):
    """A generation whose pipeline ran on cuda:1: record's next calibrations are taken there, not on device 0 (its
    cell says where: pipeline_device); a start taken on another device before it is not paired with an end."""
    from profiler.record import script
    from profiler.store import Run

    run = Run.create(tmp_path, {"kind": "record", "command": "attnprof record", "cells": [], "ended_at": None})
    assert script.pipeline_device(run, "cuda") == "cuda"
    run.record({"cell_id": "c1", "model": "m", "width": 64, "height": 64, "batch": 1, "dtype": "float16",
                "backend": "loaded", "device": "cuda", "status": "ok", "pipeline_device": "cuda:1"}, [])
    assert script.pipeline_device(run, "cuda") == "cuda:1"


def test_a_cells_expected_forwards_follow_its_devices_passes(monkeypatch):
    """The sweep's predicted time counts a cell's forwards as its device runs them: on the CPU warm-up, timed and
    probe; on CUDA the passes' minimums by time as well (a short forward is repeated for a second and more). The
    passes' own figures here (kernel_run cuts them for its module)."""
    for name, value in (("MIN_PLAIN_S", 1.0), ("WARM_S", 0.5), ("MIN_PLAIN", 10), ("WARM_FORWARDS", 3),
                        ("PROFILED", 5)):
        monkeypatch.setattr(passes, name, value)
    assert passes.expected_forwards(False, 1, 3, 100.0) == 5
    short, long_ = passes.expected_forwards(True, 1, 3, 5.0), passes.expected_forwards(True, 1, 3, 500.0)
    assert short > long_ >= passes.MIN_PLAIN + passes.PROFILED
    assert short * 5.0 >= (passes.WARM_S + passes.MIN_PLAIN_S) * 1e3  # the second of plain forwards and more
