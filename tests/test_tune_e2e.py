"""attnprof tune and profiler.tune end to end (issue 54): tunes of tiny-sd15 (SD 1.5's block topology) and of the
tiny pipeline, their maps run, their runs read by show, findings, the report and the dashboard, and make gpu-check's
tune step on the CPU. Speed differences are injected by plugins (tests/faults.py: fault-slow-at, much slower at one
shape only; fault-paced, a set wait on every call), so that no verdict depends on the machine's load. An e2e module
(tests/conftest.py): make test runs it, make test-fast not."""
import json
from pathlib import Path

import pytest
import torch

from profiler.attention import backends
from profiler.store import Run, list_runs
from tests.test_tune import SIZE, _cli, _map


def _blocks_of(run_dir: Path, label: str) -> list[dict]:
    cells, blocks = Run.open(run_dir).read()
    cell = cells[cells["backend_label"] == label].iloc[0]
    assert cell["status"] == "ok", cell["error"]
    return blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index").to_dict("records")


def test_tune_avoids_a_backend_where_it_is_slow_and_only_there_and_run_measures_the_map(tmp_path, faults):
    """fault-slow-at is SDPA but 60 ms late on one shape (self-attention over 64 tokens: 5 of the 32 calls);
    fault-paced is SDPA 10 ms late on every call. The map runs fault-paced on exactly those 5 blocks, fault-slow-at
    on the 27 others; the proof (the whole forward, interleaved) finds it faster than the best single backend; `run
    --backend MAP` measures it as a cell of its own, the slow shape's calls paced, the others not."""
    out = _cli(["tune", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", "fault-slow-at",
                "--backend", "fault-paced", "--proof-rounds", "3", "--out", str(tmp_path / "t"), "--quiet"])
    last = out.strip().splitlines()[-1]
    assert last.startswith("tuned: the mixed U-Net forward took") and "faster by the noise rule" in last, last
    run_dir = list_runs(tmp_path / "t")[0]
    doc = json.loads((run_dir / "tuned.json").read_text())
    slow = {b for b, e in doc["blocks"].items() if e["kind"] == "self" and e["tokens_q"] == faults.SLOW_AT_TOKENS}
    assert len(slow) == 5 and len(doc["blocks"]) == 32
    assert {b for b, e in doc["blocks"].items() if e["backend"] == "fault-paced"} == slow
    assert all(doc["blocks"][b]["why"].startswith("fastest") for b in doc["blocks"])
    single = doc["proof"]["single"]
    assert single["faster"] and single["speedup"] > 1.2 and single["speedup_low"] > 1, single
    # the map measured: a cell of its own, each call its block's backend
    _cli(["run", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", str(run_dir / "tuned.json"),
          "--repeats", "1", "--warmup", "0", "--in-process", "--out", str(tmp_path / "r"), "--quiet"])
    calls = _blocks_of(list_runs(tmp_path / "r")[0], "tuned (tuned.json)")
    paced = sorted(c["time_ms"] for c in calls if c["block"] in slow)
    others = sorted(c["time_ms"] for c in calls if c["block"] not in slow)
    assert faults.PACED_MS <= paced[len(paced) // 2] < faults.SLOW_AT_MS, paced
    assert others[len(others) // 2] < faults.PACED_MS, others


def test_under_a_budget_the_map_mixes_and_its_planned_peak_is_the_measured_one(tmp_path, faults):
    """naive is the fastest at every shape (fault-paced waits 10 ms a call) but its whole forward does not fit the
    budget; fault-paced fits (SDPA's memory) but is slower: no single backend both fits and is fastest. The map mixes
    them, its planned forward peak within the budget; a measured CPU run of it peaks where the plan says."""
    from profiler.planner.forward import trace
    from profiler.tuning.tuner import tune_model

    traced = trace("tiny-sd15", 128, 128, 1, "float32", "cpu", ["naive", "fault-paced"])
    fat, lean = (traced["backends"][n]["predicted_forward_peak_bytes"] for n in ("naive", "fault-paced"))
    budget = (fat + lean) // 2
    assert lean < budget < fat
    tuned = tune_model("tiny-sd15", 128, 128, 1, "float32", "cpu", budget, ["naive", "fault-paced"],
                       proof_rounds=3, out=tmp_path / "t")
    doc = tuned.map
    chosen = {e["backend"] for e in doc["blocks"].values()}
    assert chosen == {"naive", "fault-paced"}, chosen
    assert doc["single"] == "fault-paced" and not doc["kept_single"]  # the only one that fits, and slower
    assert lean <= doc["planned_forward_peak_bytes"]["mix"] <= budget
    budgeted = [e for e in doc["blocks"].values() if e["backend"] == "fault-paced"]
    assert all(e["why"].startswith("fits the budget: naive") for e in budgeted)
    assert tuned.cell["verdict"] == "improvement"
    _cli(["run", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", str(tuned.path),
          "--repeats", "1", "--warmup", "0", "--in-process", "--out", str(tmp_path / "r"), "--quiet"])
    cells = Run.open(list_runs(tmp_path / "r")[0]).cells()
    cell = cells.iloc[0]
    assert cell["status"] == "ok" and cell["predicted_forward_peak_bytes"] == doc["planned_forward_peak_bytes"]["mix"]
    assert abs(cell["forward_peak_total_bytes"] / cell["predicted_forward_peak_bytes"] - 1) < 0.01, \
        (cell["forward_peak_total_bytes"], cell["predicted_forward_peak_bytes"])


def test_profiler_tune_of_the_tiny_pipeline_applies_and_gives_the_users_processors_back(tmp_path, faults):
    """profiler.tune(pipe) on docs/examples/generate.py's tiny SD 1.5 pipeline: its U-Net's calls from one
    generation, a map that profiler.apply puts in place (every block its backend), images within the tolerance of
    the untuned ones, the user's own processor objects back on apply(pipe, None); pipe.unet.set_attn_processor takes
    profiler.processors(map) too. The map mixes two kernels whatever the machine's load (faults.py: naive attention
    late at one shape only, SDPA late everywhere), so the images are those of a mixed map: naive's in most blocks,
    SDPA's in the slow shape's."""
    import profiler
    from profiler.measure.rows import TOLERANCE
    from tests.test_profile import gen

    pipe = gen.tiny_pipeline()
    own = dict(pipe.unet.attn_processors)
    before = gen.generate(pipe, steps=2, size=64)
    tuned = profiler.tune(pipe, height=64, width=64, num_inference_steps=2,
                          backends=["fault-naive-slow-at", "fault-paced"], proof_rounds=3, out=tmp_path)
    assert all(a is b for a, b in zip(pipe.unet.attn_processors.values(), own.values()))  # tune left them as they were
    assert len(tuned.map["blocks"]) == 32 and tuned.path.is_file() and tuned.map["proof"]["what"] == "generation"
    slow = {b for b, e in tuned.map["blocks"].items() if e["kind"] == "self" and e["tokens_q"] == faults.SLOW_AT_TOKENS}
    assert len(slow) == 5 and not tuned.map["kept_single"], tuned.map["proof"]
    assert {b for b, e in tuned.map["blocks"].items() if e["backend"] == "fault-paced"} == slow
    assert str(tuned).strip().splitlines()[-1].startswith("tuned:")
    profiler.apply(pipe, tuned.path)
    made = {block.removesuffix(".processor"): type(p).__name__ for block, p in pipe.unet.attn_processors.items()}
    want = {b: type(backends.make_processor(e["backend"], **e["options"])).__name__
            for b, e in tuned.map["blocks"].items()}
    assert made == want
    after = gen.generate(pipe, steps=2, size=64)
    assert abs(after - before).max() / abs(before).max() <= TOLERANCE["float32"]
    profiler.apply(pipe, None)
    assert all(a is b for a, b in zip(pipe.unet.attn_processors.values(), own.values()))
    pipe.unet.set_attn_processor(profiler.processors(tuned.map))
    assert {k.removesuffix(".processor"): type(p).__name__ for k, p in pipe.unet.attn_processors.items()} == want


@pytest.fixture(scope="module")
def tune_run(tmp_path_factory) -> Path:
    """A tune of tiny-sd15 at 64x64 over naive, sdpa and split (a quick one), through the command line: its run."""
    root = tmp_path_factory.mktemp("tune") / "results"
    torch.set_num_threads(1)
    out = _cli(["tune", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--backend", "naive",
                "--backend", "sdpa", "--backend", "split", "--proof-rounds", "3", "--out", str(root), "--quiet"])
    assert out.strip().splitlines()[-1].startswith("tuned:")
    return list_runs(root)[0]


def test_show_findings_and_the_report_show_the_map(tune_run, tmp_path):
    run = Run.open(tune_run)
    assert run.kind.name == "tune"
    doc = json.loads((tune_run / "tuned.json").read_text())
    shown = _cli(["show", tune_run.name, "--results", str(tune_run.parent), "--wide"])
    assert "the map for tiny-sd15 at 64x64" in shown and f"map: {tune_run / 'tuned.json'}" in shown
    for block, entry in doc["blocks"].items():  # a row per block: its backend, time and why
        line = next(l for l in shown.splitlines() if l.startswith(block + " "))
        assert f" {entry['backend']} " in line and f"{entry['time_ms']:.3f} ms" in line and entry["why"] in line
    assert any(line.startswith("tuned: ") for line in shown.splitlines())  # the proof's line, closing the map
    assert "The map tuned (tuned.json) for tiny-sd15 at 64x64 runs" in shown  # the findings' sentence
    cells = run.cells()
    assert set(cells["backend_label"]) == {"naive", "sdpa", "split", "tuned (tuned.json)"}
    import pandas as pd  # as stored, before a reader fills what old runs lack: each row says its clock, as a sweep's

    stored = {f: pd.read_parquet(tune_run / f"{f}.parquet") for f in ("cells", "blocks")}
    assert len(stored["cells"]) == 4 and stored["cells"]["time_source"].tolist() == ["host clock"] * 4
    assert set(stored["blocks"]["time_source"]) == {"host clock"}
    html = tmp_path / "r.html"
    _cli(["report", tune_run.name, "--out", str(html), "--results", str(tune_run.parent)])
    text = html.read_text()
    assert "<h2>Processor maps</h2>" in text and text.count("transformer_blocks.0.attn") >= 32


def test_the_dashboards_run_page_shows_the_map(tune_run, monkeypatch):
    pytest.importorskip("streamlit", reason="the dashboard needs streamlit")
    from streamlit.testing.v1 import AppTest

    from dashboards import transforms as T

    rows, lines = T.tuned_maps(*Run.open(tune_run).read())
    assert len(rows) == 32 and len(lines) == 1 and "tuned:" in lines[0]
    monkeypatch.setenv("ATTNPROF_RESULTS", str(tune_run.parent))
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboards" / "app.py"),
                           default_timeout=120)
    at.query_params.update(page="Run")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Processor map: the fastest backend per block" in [h.value for h in at.subheader]
    shown = next(d.value for d in at.dataframe if "why" in d.value)
    assert len(shown) == 32 and set(shown["chosen"]) <= {"naive", "sdpa", "split"}


def test_the_gpu_check_step_tunes_each_model_and_judges_its_map_against_sdpa(tmp_path):
    from profiler.gpu_check.verdicts import Context
    from profiler.tuning.check import judge_maps, tuned_maps_against_sdpa

    ctx = Context(device="cpu", out=tmp_path, runs=tmp_path / "runs", pairs=(("tiny-sd15", 64),))
    verdict = tuned_maps_against_sdpa(ctx)
    assert verdict.figure.startswith("tiny-sd15 64x64: ") and len(verdict.evidence) == 1
    run = list_runs(tmp_path / "runs")[0]
    cell = Run.open(run).cells().query("backend == 'tuned'").iloc[0]
    speedup = cell["speedup"] if cell["versus"] == "sdpa" else cell["sdpa_speedup"]
    assert "sdpa everywhere" in verdict.figure if speedup != speedup or speedup is None else \
        f"{speedup:.2f}x over sdpa" in verdict.figure
    good = {"model": "sd15", "width": 512, "height": 512, "map_counts": {"sdpa-cudnn": 20, "sdpa-flash": 12},
            "versus": "sdpa-cudnn", "sdpa_speedup": 1.3, "sdpa_verdict": "improvement", "error_ok": True}
    assert not judge_maps([good]).failed and "1.30x over sdpa (improvement)" in judge_maps([good]).figure
    slower = {**good, "sdpa_speedup": 0.8, "sdpa_verdict": "regression"}
    off = {**good, "error_ok": False, "max_rel_err": 0.2}
    untimed = {**good, "sdpa_speedup": None, "sdpa_verdict": None}
    for bad, says in ((slower, "slower than sdpa"), (off, "off the fp32 reference"), (untimed, "not timed")):
        found = judge_maps([bad])
        assert len(found.failed) == 1 and says in found.failed[0] and not found.evidence[0]["ok"]


def test_a_profiled_generation_runs_a_map_file_as_its_backend(tmp_path):
    """What `attnprof record --backend tuned.json` does in its child (session.profile with backend=FILE): each U-Net
    block runs its entry's backend, any other attention module (the VAE's) the map's default; the cell is labelled
    by the map and the user's processors are back after."""
    from profiler import profile
    from profiler.planner import plan
    from tests.test_profile import gen

    rows = plan("tiny-sd15", 64, 64, 1, "float32")["blocks"]
    path = _map(tmp_path, {r["block"]: {"backend": "naive" if r["kind"] == "cross" else "split"} for r in rows},
                {"backend": "sdpa"}, "tuned.json")
    pipe = gen.tiny_pipeline()
    own = dict(pipe.unet.attn_processors)
    seen = {}
    hook = pipe.unet.register_forward_pre_hook(lambda m, a: seen.update(
        {k: type(p).__name__ for k, p in m.attn_processors.items()}))
    with profile(pipe, out=tmp_path / "r", backend=str(path)) as prof:
        gen.generate(pipe, steps=2, size=64)
    hook.remove()
    kinds = {r["block"]: r["kind"] for r in rows}
    assert seen == {f"{b}.processor": "AttnProcessor" if k == "cross" else "SplitProcessor" for b, k in kinds.items()}
    assert all(a is b for a, b in zip(pipe.unet.attn_processors.values(), own.values()))
    cells = Run.open(prof.run_dir).cells()
    assert cells["backend_label"].tolist() == ["tuned (tuned.json)"]
    assert "AttnProcessor2_0 x2" in cells["processors"].iloc[0]  # the VAE's two: the default, sdpa
