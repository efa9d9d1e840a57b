"""The dashboard's pages through Streamlit's AppTest, over a run written by the real profiler (conftest's
dashboard_results), an empty folder, a corrupt one, and 100 synthetic runs of 10,000 block rows each."""
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from profiler.attention import backends

pytest.importorskip("streamlit", reason="the dashboard needs streamlit (not on the lent GPU machine)")
from streamlit.testing.v1 import AppTest  # noqa: E402

from profiler.store import Run, list_runs

APP = str(Path(__file__).resolve().parent.parent / "dashboards" / "app.py")


def _app(results: Path, monkeypatch, **params) -> AppTest:
    monkeypatch.setenv("ATTNPROF_RESULTS", str(results))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _charts(at) -> list[tuple[dict, pd.DataFrame]]:
    """(spec, data) of each Vega-Lite chart on the page."""
    out = []
    for el in at.get("vega_lite_chart"):
        data = pa.ipc.open_stream(el.proto.data.data).read_pandas() if el.proto.data.data else pd.DataFrame()
        out.append((json.loads(el.proto.spec), data))
    return out


def _qp(at, key: str) -> list[str]:
    """A query parameter of the page's URL after the run, as a list (AppTest gives one value as a str)."""
    value = at.query_params.get(key, [])
    return value if isinstance(value, list) else [value]


def _table(at, i: int) -> pd.DataFrame:
    return at.dataframe[i].value


def _run_id(results: Path) -> str:
    return list_runs(results)[0].name


def test_runs_page_lists_the_run_with_its_cells_by_status(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch)
    runs = _table(at, 0)
    assert runs["run_id"].tolist() == [_run_id(dashboard_results)]
    assert runs[["cells", "ok", "skipped", "unavailable", "oom"]].iloc[0].tolist() == [8, 5, 1, 2, 0]
    assert runs["device"].iloc[0].startswith("cpu") and "torch" in runs["versions"].iloc[0]
    assert _qp(at, "page") == ["Runs"] and _qp(at, "run") == [_run_id(dashboard_results)]
    assert [b.label for b in at.download_button] == ["Download runs.csv"]
    assert not at.warning


def test_run_page_draws_the_unet_coloured_by_time_then_by_memory(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch, page="Run")
    charts = _charts(at)
    assert len(charts) == 4  # the U-Net, time per call, peak per call, the roofline
    spec, unet = charts[0]
    assert spec["mark"]["type"] == "rect" and spec["encoding"]["color"]["field"] == "time_ms"
    assert len(unet) == 32 and unet["column"].nunique() == 16  # SD1.5: 16 Transformer2DModels, 32 calls
    assert unet.groupby("stage")["column"].nunique().to_dict() == {"down": 6, "mid": 1, "up": 9}
    finest = unet[(unet["level"] == 0) & (unet["kind"] == "self")]
    assert set(finest["tokens"]) == {"64 x 64"} and set(finest["score_table"]) == {"128.0 KiB"}  # 8 heads, fp32
    assert spec["encoding"]["x"]["title"] and "ms" in charts[1][0]["encoding"]["x"]["title"]
    assert "MiB" in charts[2][0]["encoding"]["x"]["title"]
    roofline, points = charts[3]  # every ok call of the chosen cells a point, the device's limits as lines
    assert len(points) == 5 * 32 and points["arithmetic_intensity"].gt(0).all()
    manifest = json.loads((list_runs(dashboard_results)[0] / "manifest.json").read_text())
    lines = pd.DataFrame(roofline["layer"][1]["data"]["values"])
    compute = lines[lines["limit"].str.contains("compute")]
    memory = lines[lines["limit"].str.contains("memory")]
    assert (compute["achieved_flops_per_s"] == manifest["device_peak_flops"]["float32"]).all()
    assert np.allclose(memory["achieved_flops_per_s"] / memory["arithmetic_intensity"],
                       manifest["device_peak_bytes_per_s"])
    assert roofline["layer"][0]["encoding"]["x"]["scale"]["type"] == "log"
    # the run's findings word for word as findings.py states them from its stored cells: which backend they name
    # the fastest, if any, is the run's timings' (a loaded machine's overlapping spreads name none: test_findings),
    # not a verdict this test takes
    from dashboards import transforms as T

    (run_id, sentences), = T.run_findings(*T.load_run(list_runs(dashboard_results)[0])).items()
    found = [m.value for m in at.markdown if m.value.startswith("**Findings, ")]
    assert found == [f"**Findings, {run_id}**\n\n" + "\n".join(f"- {s}" for s in sentences)]
    assert "needed the least memory" in found[0] and any(
        s in found[0] for s in ("was the fastest", "no backend is clearly the fastest", "the machine moved")), found
    first = _qp(at, "cell")
    at.sidebar.radio(key="color").set_value("peak memory").run()
    assert _charts(at)[0][0]["encoding"]["color"]["field"] == "peak_mem_MiB"
    assert _qp(at, "color") == ["peak memory"] and _qp(at, "cell") == first
    cells = _table(at, 1)
    assert len(cells) == 8 and cells["status"].value_counts().to_dict() == {"ok": 5, "unavailable": 2, "skipped": 1}
    skipped = cells[cells["status"] == "skipped"].iloc[0]
    assert skipped["backend_label"] == "naive" and "exceeds the memory budget" in skipped["error"]
    assert cells[cells["status"] == "unavailable"]["error"].str.contains("xformers").all()
    assert len(at.dataframe) == 2 and [b.label for b in at.download_button] == [
        "Download blocks.csv", "Download cells.csv", "Download report.html (self-contained, opens with no network)"]


def test_runs_page_states_the_runs_findings_first(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch)
    found = at.markdown[0].value
    assert found.startswith(f"**Findings, {_run_id(dashboard_results)}**") and "- At 64x64 " in found
    assert "naive stopped fitting at 128x128" in found


def test_run_page_offers_the_cells_traces_for_download(traced_results, monkeypatch):
    root, _ = traced_results
    at = _app(root, monkeypatch, page="Run", backend="sdpa")
    cell_id = _qp(at, "cell")[0].split("/")[1]
    assert f"Download {cell_id}.trace.json" in [b.label for b in at.download_button]


def test_run_page_cell_comes_from_the_url(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch, page="Run", backend="subquad", size="128x128")
    cell = at.sidebar.selectbox(key="cell")
    assert len(cell.options) == 1 and cell.options[0].startswith("128x128 subquad float32 b1")
    unet = _charts(at)[0][1]
    assert set(unet["level_label"]) == {"level 0: 256 tokens", "level 1: 64 tokens", "level 2: 16 tokens",
                                        "level 3: 4 tokens"}
    assert _qp(at, "backend") == ["subquad"] and _qp(at, "size") == ["128x128"] and _qp(at, "cell") == [cell.value]


def _copy_run(src: Path, root: Path, run_id: str, sdpa_slower: float = 1.0) -> None:
    """Another run of the same grid: the same cell ids under a new run id, its sdpa times scaled. Each cell's samples
    are its attention time within +-2% (as many as it has), so that a verdict between two copies is the scaling's,
    not the spread of a source run measured beside a loaded machine (a 3x slower copy came out within noise once)."""
    dst = root / run_id
    shutil.copytree(src, dst)
    (dst / "manifest.json").write_text(json.dumps({**json.loads((src / "manifest.json").read_text()),
                                                   "run_id": run_id}))
    for name, columns in (("cells.parquet", ["attention_time_ms", "attention_time_samples_ms"]),
                          ("blocks.parquet", ["time_ms"])):
        df = pd.read_parquet(dst / name).assign(run_id=run_id)
        if name == "cells.parquet":
            df["attention_time_samples_ms"] = [
                None if v is None else [t * (0.98 + 0.04 * i / max(len(v) - 1, 1)) for i in range(len(v))]
                for t, v in zip(df["attention_time_ms"], df["attention_time_samples_ms"])]
        sdpa = df["backend"] == "sdpa"
        for column in columns:
            df.loc[sdpa, column] = df.loc[sdpa, column].map(lambda v: v * sdpa_slower if v is None or
                                                            isinstance(v, float) else [x * sdpa_slower for x in v])
        df.to_parquet(dst / name, index=False)


def test_two_runs_of_one_grid_are_told_apart(dashboard_results, tmp_path, monkeypatch):
    good = list_runs(dashboard_results)[0]
    _copy_run(good, tmp_path, "30000101-000000-aaaa")
    _copy_run(good, tmp_path, "30000101-000000-bbbb", sdpa_slower=3.0)
    at = _app(tmp_path, monkeypatch, page="Run", run=["30000101-000000-aaaa", "30000101-000000-bbbb"],
              backend="sdpa", size="64x64")
    assert len(at.sidebar.selectbox(key="cell").options) == 2
    assert _qp(at, "cell")[0].startswith("30000101-000000-aaaa/")
    assert len(_charts(at)[0][1]) == 32  # one cell drawn, not both runs' calls
    assert sorted(_table(at, 1)["run_id"]) == ["30000101-000000-aaaa", "30000101-000000-bbbb"]
    at = _app(tmp_path, monkeypatch, page="Compare", run=["30000101-000000-aaaa", "30000101-000000-bbbb"],
              by="backend")
    ratios = _table(at, 1)
    assert sorted(ratios[ratios["backend_label"] == "naive"]["time_ratio"]) == ["-", "-", "1.00x", "1.00x"]
    points = _charts(at)[1][1]  # each run's ratios against its own naive cell: run b's sdpa is 3x run a's
    sdpa = points[(points["backend_label"] == "sdpa") & (points["size"] == "64x64")].set_index("run_id")["time_ratio"]
    assert sdpa["30000101-000000-bbbb"] == pytest.approx(3 * sdpa["30000101-000000-aaaa"])
    assert len(_table(at, 0)) == 2 * 4  # the largest size per backend, per run


def test_runs_side_by_side_with_a_verdict_per_cell(dashboard_results, tmp_path, monkeypatch):
    """Two runs of one grid, the second's sdpa three times slower: two series, and its sdpa cells regressions."""
    good = list_runs(dashboard_results)[0]
    a, b = "30000101-000000-aaaa", "30000101-000000-bbbb"
    _copy_run(good, tmp_path, a)
    _copy_run(good, tmp_path, b, sdpa_slower=3.0)
    at = _app(tmp_path, monkeypatch, page="Compare", run=[a, b])
    assert at.sidebar.selectbox(key="by").value == "run" and _qp(at, "by") == ["run"]
    assert at.sidebar.selectbox(key="by").options == ["backend", "run"]  # the copies share their environment
    spec, points = _charts(at)[0]
    assert spec["encoding"]["xOffset"]["field"] == "series" and set(points["series"]) == {a, b}
    diff = _table(at, 0).set_index(["backend", "width"])
    assert diff.loc[("sdpa", 64), "verdict"] == "regression" and diff.loc[("sdpa", 64), "time_ratio"] == "3.00x"
    assert diff.loc[("naive", 64), "verdict"] == "within noise"
    best = _table(at, 1)
    assert set(best["fastest"]) <= {"naive", "sdpa", "subquad"} and "fastest_that_fits" in best


def test_compare_page_ratios_and_largest_size(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch, page="Compare")
    assert at.sidebar.selectbox(key="baseline").value == "naive"
    (scatter, points), (ratio, ratios), _ = _charts(at)
    assert scatter["encoding"]["x"]["scale"]["type"] == "log" == scatter["encoding"]["y"]["scale"]["type"]
    assert "MiB" in scatter["encoding"]["x"]["title"] and "ms" in scatter["encoding"]["y"]["title"]
    assert scatter["encoding"]["shape"]["field"] == "family"
    assert sorted(points["backend_label"]) == ["naive", "sdpa", "sdpa", "subquad", "subquad"]
    at64 = points[points["size"] == "64x64"].set_index("backend_label")
    assert at64.loc["naive", "time_ratio"] == pytest.approx(1.0)
    assert at64.loc["sdpa", "time_ratio"] == pytest.approx(at64.loc["sdpa", "attention_time_ms"] /
                                                           at64.loc["naive", "attention_time_ms"])
    assert at64.loc["sdpa", "peak_ratio"] < 1  # the fused kernel holds no score table
    largest = _table(at, 0).set_index("backend_label")
    assert largest.loc["naive", "largest_ok_size"] == "64x64" and largest.loc["naive", "failed_above"] == \
           "skipped at 128x128"
    assert largest.loc["sdpa", "largest_ok_size"] == "128x128" and largest.loc["sdpa", "family"] == "fused exact"
    assert largest.loc["subquad", "family"] == "chunked"
    at.sidebar.selectbox(key="baseline").set_value("sdpa").run()
    assert _qp(at, "baseline") == ["sdpa"]
    ratios = _charts(at)[1][1].set_index(["size", "backend_label"])
    assert ratios.loc[("128x128", "sdpa"), "time_ratio"] == pytest.approx(1.0)
    assert ratios.loc[("64x64", "naive"), "peak_ratio"] > 1  # naive materialises the score table


def _views(spec: dict) -> list[dict]:
    """The single views of a spec: itself, or each panel of its small multiples."""
    return spec.get("concat", [spec])


def test_scaling_page_measured_beside_predicted_on_log_axes(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch, page="Scaling")
    charts = _charts(at)
    assert len(charts) == 4
    for spec, _ in charts:
        for view in _views(spec):
            x, y = view["encoding"]["x"], view["encoding"]["y"]
            assert x["scale"]["type"] == "log" == y["scale"]["type"]
            assert x["axis"]["values"] == [4096, 16384]  # ticked at the sizes, named as sizes
            assert x["axis"]["labelExpr"] == "datum.value == 4096 ? '64x64' : datum.value == 16384 ? '128x128' : ''"
    tokens = charts[0][1].set_index("size")["tokens_max"]
    assert tokens.to_dict() == {"64x64": 64, "128x128": 256}
    peak_spec, peaks = charts[3]
    panel = peak_spec["concat"][0]
    assert [v["title"] for v in peak_spec["concat"]] == ["tiny-sd15"]  # one model, one panel
    assert panel["layer"][0]["encoding"]["strokeDash"]["field"] == "source"  # the lines' dash, not the points'
    assert panel["layer"][0]["encoding"]["strokeDash"]["legend"]["symbolType"] == "stroke"
    assert sorted(peaks["source"].unique()) == ["measured", "predicted"]
    assert len(peaks) == 2 * 5  # five cells ran, each measured and predicted
    assert "MiB" in panel["encoding"]["y"]["title"] and "ms" in charts[2][0]["concat"][0]["encoding"]["y"]["title"]
    assert "MiB" in charts[1][0]["encoding"]["y"]["title"]  # the score table


def test_scaling_shows_every_run_by_default_and_joins_runs_of_other_sizes(dashboard_results, tmp_path,
                                                                         monkeypatch):
    """A run per size (each a real run's cells of one size): the Scaling page picks both by default (the other pages
    the latest), and each backend's line runs through both sizes, its points naming their run."""
    run_id = _run_id(dashboard_results)
    for name, size in (("a-small", 64), ("b-large", 128)):
        shutil.copytree(dashboard_results / run_id, tmp_path / name)
        cells = pd.read_parquet(tmp_path / name / "cells.parquet")
        cells[cells["width"] == size].to_parquet(tmp_path / name / "cells.parquet", index=False)
    at = _app(tmp_path, monkeypatch, page="Scaling")
    assert _qp(at, "run") == ["a-small", "b-large"]
    spec, time = _charts(at)[2]
    assert spec["concat"][0]["encoding"]["color"]["title"] == "backend"  # no two runs hold one size: one line each
    sdpa = time[time["label"] == "sdpa"].sort_values("pixels")
    assert sdpa[["size", "run_id"]].values.tolist() == [["64x64", "a-small"], ["128x128", "b-large"]]
    at.sidebar.selectbox(key="page").set_value("Run").run()
    assert _qp(at, "run") == ["b-large"]  # not picked by anyone: the Run page's own default, the latest
    at.sidebar.multiselect(key="run").set_value(["a-small"]).run()
    at.sidebar.selectbox(key="page").set_value("Scaling").run()
    assert _qp(at, "run") == ["a-small"]  # picked: kept on every page


def test_filters_from_the_url_narrow_every_table(dashboard_results, monkeypatch):
    at = _app(dashboard_results, monkeypatch, page="Run", backend=["sdpa", "nonsense"], dtype="float32")
    cells = _table(at, 1)
    assert set(cells["backend_label"]) == {"sdpa"} and len(cells) == 2
    assert _qp(at, "backend") == ["sdpa"]  # the unknown value is dropped from the URL
    at.sidebar.multiselect(key="size").set_value(["64x64"]).run()
    assert _qp(at, "size") == ["64x64"] and len(_table(at, 1)) == 1


def test_planner_page_needs_no_run(tmp_path, monkeypatch):
    params = dict(page="Planner", plan_model="tiny-sd15", plan_size="512x512", plan_dtype="float16", budget="1GiB")
    at = _app(tmp_path, monkeypatch, **params)
    plan = _table(at, 0).set_index("backend")
    assert len(plan) == len(backends.names())
    # two float32 tables of 8 x 4096 x 4096 (1 GiB), and diffusers' uncompiled FlexAttention's three
    assert plan.index[~plan["fits"]].tolist() == ["sdpa-math", "diffusers:flex", "diffusers:_native_math"]
    assert plan.loc["naive", "largest_call"] == "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert plan.loc["naive", "need"].endswith("MiB")
    assert plan.loc["xformers", "how"].startswith("attention calls from the memory model")
    at.text_input(key="budget").set_value("4090").run()
    assert "fit in 4090 = the RTX-4090's 24 GiB" in at.caption[0].value
    at.text_input(key="budget").set_value("24").run()
    assert "has no unit" in at.error[0].value
    at.text_input(key="budget").set_value("300MiB").run()
    plan = _table(at, 0).set_index("backend")
    assert not plan.loc["naive", "fits"] and plan.loc["sdpa", "fits"]  # naive holds two 256 MiB score tables
    assert _qp(at, "budget") == ["300MiB"]
    spec, data = _charts(at)[0]
    assert spec["layer"][0]["encoding"]["x"]["title"] == "predicted need (GiB)"  # sdpa-math needs over 1 GiB
    assert spec["layer"][1]["encoding"]["x"]["datum"] == pytest.approx(300 / 1024)  # the budget line, in GiB
    spec, data = _charts(at)[1]  # predicted time per backend and size on the H100 (profiler/gpus.py)
    assert spec["encoding"]["y"]["title"] == "predicted forward time (ms, published efficiencies)"
    naive, sdpa = (data[data["backend"] == b].set_index("size")["forward_ms"] for b in ("naive", "sdpa"))
    assert naive["1536x1536"] > naive["512x512"] and naive["1536x1536"] > sdpa["1536x1536"]  # its table passes
    assert set(data["gpu"]) == {"H100-SXM"}
    largest = _table(at, 1).set_index("backend")
    assert list(largest.columns) == ["8 GiB", "12 GiB", "16 GiB", "24 GiB", "40 GiB", "48 GiB", "80 GiB", "141 GiB"]
    side = lambda size: int(size.split("x")[0])  # noqa: E731
    assert side(largest.loc["naive", "8 GiB"]) < side(largest.loc["sdpa", "8 GiB"])  # the score tables cost pixels
    assert side(largest.loc["naive", "8 GiB"]) <= side(largest.loc["naive", "24 GiB"])
    generation = next(t for t in (_table(at, i) for i in range(len(at.dataframe))) if "gpu" in t)  # every GPU
    assert list(generation.columns) == ["gpu", "sdpa (s)", "xformers (s)", "sliced (s)", "naive (s)"]
    seconds = generation.set_index("gpu")
    assert seconds.loc["H100-SXM", "sdpa (s)"] < seconds.loc["T4", "sdpa (s)"]  # 989 against 65 TFLOP/s
    assert (seconds > 0).all().all() and len(seconds) == 12
    pipeline = _table(at, 2).set_index("gpu_memory_gib")  # a whole SD 1.5 generation, per GPU size
    assert list(pipeline.index) == [8, 12, 16, 24, 40, 48, 80, 141]
    assert set(pipeline["limited_by"]) <= {"text", "denoise", "decode"}
    for gib, row in pipeline.iterrows():  # no larger than its most demanding phase alone
        assert side(row["largest"]) == min(side(row["denoise_alone"]), side(row["decode_alone"])), gib
    at.text_input(key="plan_size").set_value("500x500").run()
    assert "multiple of 8" in at.error[0].value


def test_empty_results_folder_says_how_to_make_a_run(tmp_path, monkeypatch):
    at = _app(tmp_path / "results", monkeypatch, page="Compare")
    assert "make profile" in at.info[0].value and "attnprof run" in at.info[0].value
    assert not at.dataframe and not _charts(at)


def test_a_corrupt_run_is_listed_with_a_warning_and_the_others_still_show(dashboard_results, tmp_path, monkeypatch):
    good = list_runs(dashboard_results)[0]
    shutil.copytree(good, tmp_path / good.name)
    for name, broken in (("zz-bad-cells", "cells.parquet"), ("zz-bad-manifest", "manifest.json")):
        shutil.copytree(good, tmp_path / name)
        path = tmp_path / name / broken
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    at = _app(tmp_path, monkeypatch)
    assert _table(at, 0)["run_id"].tolist() == [good.name, "zz-bad-cells", "zz-bad-manifest"]
    warnings = [w.value for w in at.warning]
    assert len(warnings) == 2 and "zz-bad-cells: unreadable" in warnings[0] and "zz-bad-manifest" in warnings[1]
    assert _qp(at, "run") == [good.name]  # the latest readable run is the default
    at = _app(tmp_path, monkeypatch, page="Run", run=["zz-bad-cells", good.name])
    assert _qp(at, "run") == [good.name] and len(_table(at, 1)) == 8


def test_a_run_whose_blocks_break_after_listing_is_skipped_with_a_warning(dashboard_results, tmp_path, monkeypatch):
    good = list_runs(dashboard_results)[0]
    shutil.copytree(good, tmp_path / good.name)
    at = _app(tmp_path, monkeypatch, page="Run")
    assert len(_charts(at)) == 4
    blocks = tmp_path / good.name / "blocks.parquet"
    blocks.write_bytes(blocks.read_bytes()[:200])  # a new mtime: the cached load is not reused
    at.run()
    assert not at.exception and "unreadable" in at.warning[0].value.lower()


# ---- 100 runs of 10,000 block rows each

def _synthetic_results(root: Path, runs: int = 100, cells_per_run: int = 313) -> None:
    """Runs in the store's layout with the real schema, written with pandas: 313 cells x 32 calls = 10,016 rows."""
    rng = np.random.default_rng(0)
    sizes = [(64 * (1 + i % 16), 64 * (1 + i // 16)) for i in range(cells_per_run)]
    cells = pd.DataFrame({"model": "sd15", "width": [w for w, _ in sizes], "height": [h for _, h in sizes],
                          "batch": 1, "dtype": "float16", "backend": ["naive", "sdpa", "subquad", "sliced"] * 78 +
                          ["split"], "device": "cuda", "backend_options": "{}",
                          "cell_id": [f"c{i:04d}" for i in range(cells_per_run)], "status": "ok", "error": "",
                          "forward_time_ms": rng.uniform(10, 100, cells_per_run), "forward_iqr_ms": 0.1,
                          "noisy": False, "forward_peak_mem_bytes": 2.0**30, "attention_time_ms": 5.0,
                          "attention_peak_mem_bytes": 2.0**28, "predicted_peak_bytes": 2.0**28, "calls": 32.0,
                          "kernel": "k", "max_abs_err": 1e-3, "max_rel_err": 1e-3, "error_ok": True})
    calls = 32
    blocks = cells.loc[cells.index.repeat(calls), ["model", "width", "height", "batch", "dtype", "backend", "device",
                                                    "backend_options", "cell_id"]].reset_index(drop=True)
    n = len(blocks)
    index = np.tile(np.arange(calls), cells_per_run)
    level = np.minimum(index // 8, 3)
    blocks = blocks.assign(call_index=index, block=[f"down_blocks.{lv}.attentions.{i % 8 // 2}.transformer_blocks.0"
                                                     f".attn{1 + i % 2}" for lv, i in zip(level, index)],
                           stage="down", level=level, kind=np.where(index % 2, "cross", "self"), heads=8,
                           head_dim=40, tokens_q=4096 >> (2 * level), tokens_k=77, score_elements=1000,
                           score_bytes=2000, flops=10**9, time_ms=rng.uniform(0.1, 2, n), iqr_ms=0.01, noisy=False,
                           time_samples_ms=[[1.0, 1.1, 0.9]] * n, peak_mem_bytes=2**24, predicted_peak_bytes=2**24,
                           kernel="k", status="ok")
    spec = cells[["model", "width", "height", "batch", "dtype", "backend", "device", "backend_options", "cell_id"]]
    for r in range(runs):
        run_id = f"20260101-{r:06d}-beef"
        path = root / run_id
        path.mkdir(parents=True)
        manifest = {"run_id": run_id, "created_at": "2026-01-01T00:00:00+00:00", "ended_at": "2026-01-01T01:00:00",
                    "command": "synthetic", "sweep": {"models": ["sd15"], "backends": [["naive", {}]]},
                    "memory_budget_bytes": 2**34, "cells": spec.to_dict("records"),
                    "environment": {"torch": "2.13.0", "diffusers": "0.42.1", "python": "3.11", "device": "cuda",
                                    "device_name": "synthetic"}}
        (path / "manifest.json").write_text(json.dumps(manifest))
        cells.assign(run_id=run_id).to_parquet(path / "cells.parquet", index=False)
        blocks.assign(run_id=run_id).to_parquet(path / "blocks.parquet", index=False)


def test_100_runs_of_10000_rows_open_in_a_few_seconds(tmp_path, monkeypatch):
    root = tmp_path / "results"
    _synthetic_results(root)
    assert len(list_runs(root)) == 100
    start = time.perf_counter()
    at = _app(root, monkeypatch, page="Run")
    first = time.perf_counter() - start
    print(f"100 runs x 10,016 block rows: index + Run page {first:.2f} s")
    assert len(_table(at, 0)) == 32 and len(_table(at, 1)) == 313  # the latest run's blocks of one cell, its cells
    start = time.perf_counter()
    at.sidebar.selectbox(key="page").set_value("Compare").run()
    again = time.perf_counter() - start
    print(f"then the Compare page, cached: {again:.2f} s")
    assert not at.exception and len(_table(at, 1)) == 313
    assert first < 8.0, f"index + Run page took {first:.1f} s"
    assert again < 3.0, f"a cached rerun took {again:.1f} s"


def test_a_link_naming_a_run_or_size_that_is_not_here_says_so(dashboard_results, monkeypatch):
    run_id = _run_id(dashboard_results)
    at = _app(dashboard_results, monkeypatch, page="Run", run=["20990101-000000-gone"], size=["64x64", "999x999"])
    warnings = [w.value for w in at.warning]
    assert warnings == [f"The link names run 20990101-000000-gone, which is not in the results folder "
                        f"{dashboard_results}: showing {run_id} instead.",
                        "The link names size 999x999, which is not among the chosen runs' values: showing 64x64 "
                        "instead."]
    assert _qp(at, "run") == [run_id] and _qp(at, "size") == ["64x64"]  # what is shown, as the warning says
    at.sidebar.radio(key="color").set_value("peak memory").run()
    assert not at.warning  # said once, not on every change after it
    at = _app(dashboard_results, monkeypatch, page="Nowhere")
    assert [w.value for w in at.warning] == ["The link names page Nowhere, which is not one of the choices: showing "
                                             "Runs instead."]


def test_a_link_naming_a_run_in_an_empty_results_folder_says_so(tmp_path, monkeypatch):
    at = _app(tmp_path / "results", monkeypatch, run="20990101-000000-gone")
    assert [w.value for w in at.warning] == [f"The link names run 20990101-000000-gone, which is not in the results "
                                             f"folder {tmp_path / 'results'}: showing all instead."]
    assert "make profile" in at.info[0].value


def test_the_planners_caption_says_what_the_batch_is(tmp_path, monkeypatch):
    """The page's caption at batch 1; the other batches through guidance(), which the caption calls (a page at a new
    batch screens every size and backend anew: about 10 s of CPU each)."""
    from dashboards.views.planner import guidance

    at = _app(tmp_path, monkeypatch, page="Planner", plan_model="tiny-sd15", plan_size="64x64", plan_batch="1")
    assert at.caption[0].value.startswith(
        "tiny-sd15 at 64x64, batch 1 (a pipeline with classifier-free guidance runs batch 2 for one image: set Batch "
        "to 2 for it), float16, on a CUDA GPU: ")
    assert guidance(2) == " (one image under classifier-free guidance)" and guidance(3) == ""


# ---- recorded generations (conftest's record_results: two record runs of the tiny SD 1.5 pipeline)

def _both(record_results) -> list[str]:
    return [record_results["loaded"], record_results["sliced"]]


def test_the_generation_page_per_component_step_and_generation(record_results, monkeypatch):
    """Issue 53: the latest recorded generation by default; per component its forwards' time with attention's time
    inside (the text encoder's CLIP calls among them), per step the U-Net's attention, per generation, the
    costliest blocks."""
    root = record_results["root"]
    at = _app(root, monkeypatch, page="Generation")
    assert _qp(at, "run") == [record_results["sliced"]] and _qp(at, "beside") == ["none"]
    charts = _charts(at)
    assert len(charts) == 3
    (comp_spec, comps), (step_spec, steps), (block_spec, blocks) = charts
    assert comps.set_index("component")["attention_calls"].to_dict() == {"vae": 1, "text_encoder": 4, "unet": 64}
    assert [layer["encoding"]["x"]["field"] for layer in comp_spec["layer"]] == ["time_ms", "attention_ms"]
    assert steps[["step", "calls"]].values.tolist() == [[0, 32], [1, 32]] and step_spec["mark"]["type"] == "line"
    assert len(blocks) == 10 and blocks["total_ms"].is_monotonic_decreasing
    table = _table(at, 0).set_index("component")  # shown in units: ms, %; calls as counts
    assert table.loc["text_encoder", "class"] == "CLIPTextModel" and table.loc["text_encoder", "attention_calls"] == 4
    assert table.loc["unet", "time share"].endswith("%") and table.loc["unet", "attention"].endswith(" ms")
    for part in ("attention core", "attention projections"):  # the attention's split (profile: on the CPU too)
        assert table.loc["unet", part].endswith(" ms")
    generations = _table(at, 1)
    assert generations[["generation", "steps", "calls"]].values.tolist() == [[0, 2, 69]]  # 32 x 2 + 2 x 2 + 1
    assert generations["core"].iloc[0].endswith(" ms") and generations["projections"].iloc[0].endswith(" ms")
    assert any("q/k/v and output projections" in c.value for c in at.caption)
    assert any(m.value.startswith(f"**sliced 96x64 ({record_results['sliced']})**: StableDiffusionPipeline, sliced")
               for m in at.markdown)


def test_two_recorded_generations_side_by_side_on_the_generation_page(record_results, monkeypatch):
    root = record_results["root"]
    at = _app(root, monkeypatch, page="Generation", run=_both(record_results))
    beside = at.sidebar.selectbox(key="beside")
    sliced = f"{record_results['sliced']}/{Run.open(root / record_results['sliced']).cells()['cell_id'].iloc[0]}"
    assert beside.options == ["none", f"sliced 96x64 ({record_results['sliced']})"]  # none, or the other one
    beside.set_value(sliced).run()
    assert _qp(at, "beside") == [sliced] and not at.exception
    (_, comps), (_, steps), (_, blocks) = _charts(at)
    assert comps["label"].nunique() == 2 and len(comps) == 6
    assert steps.groupby("label").size().to_dict() == {  # a line per generation of each recorded cell
        f"generation 0 loaded 64x64 ({record_results['loaded']})": 3,
        f"generation 1 loaded 64x64 ({record_results['loaded']})": 3,
        f"generation 0 sliced 96x64 ({record_results['sliced']})": 2}
    per_cell = blocks.groupby("cell")["block"].agg(frozenset)  # the first's ten costliest, each in both
    assert len(per_cell) == 2 and per_cell.iloc[0] == per_cell.iloc[1] and len(per_cell.iloc[0]) == 10
    side = _table(at, 1).set_index("component")
    assert list(side.index) == ["vae", "text_encoder", "unet"] and side.loc["unet", "time_ratio"].endswith("x")
    assert _table(at, 2)["generation"].tolist() == [0, 1, 0]


def test_the_run_page_draws_each_component_of_a_recorded_generation_apart(record_results, monkeypatch):
    """Issue 53: the VAE's mid-block call is not in the U-Net's level rows, the text encoder's calls are bars of
    their own; the peak-memory chart, empty on the CPU, says why instead."""
    at = _app(record_results["root"], monkeypatch, page="Run", run=[record_results["loaded"]])
    titles = [h.value for h in at.subheader]
    assert titles[:3] == ["The U-Net: down, mid and up by level; each tile one attention call (self | cross)",
                          "The text_encoder: its attention calls in order, one bar each (4 heads of 8; 77 tokens)",
                          "The VAE: its mid block's attention (one tile per call: a tiled decode calls it per tile)"]
    charts = _charts(at)
    unet, text, vae = (data for _, data in charts[:3])
    assert len(unet) == 32 and not unet["block"].str.startswith("vae.").any()
    assert charts[1][0]["mark"]["type"] == "bar" and len(text) == 2
    assert vae["block"].tolist() == ["vae.decoder.mid_block.attentions.0"] and vae["level_label"].tolist() == [
        "level 3: 64 tokens"]
    assert len(charts) == 4  # and time per call: the peak per call's chart is a note
    assert any(i.value.startswith("No peak memory to draw: these are generations recorded on the CPU")
               for i in at.info)


def test_the_runs_page_names_a_recorded_runs_model_and_backend(record_results, monkeypatch):
    runs = _table(_app(record_results["root"], monkeypatch), 0).set_index("run_id")
    assert runs.loc[record_results["loaded"], ["kind", "backends"]].tolist() == ["record", "loaded"]
    assert runs.loc[record_results["sliced"], "models"] == "StableDiffusionPipeline UNet2DConditionModel 7f3af43b"


def test_the_memory_charts_of_recorded_generations_say_why_they_are_empty(record_results, monkeypatch):
    """On the CPU a recorded generation has no per-call peak: Compare's time-against-peak and peak-ratio charts and
    Scaling's peak chart are each a note that says why, not an empty plot."""
    why = "No peak memory to draw: these are generations recorded on the CPU, where no call has a peak of its own"
    for params, charts, notes in ((dict(page="Compare", by="backend"), ["time_ratio"], 2),
                                  (dict(page="Scaling"), ["tokens_max", "score_table_max_MiB", None], 1)):
        at = _app(record_results["root"], monkeypatch, run=_both(record_results), **params)
        drawn = [s.get("encoding", {}).get("y", {}).get("field") or s.get("layer", [{}])[0].get("encoding", {}).get(
            "y", {}).get("field") for s, _ in _charts(at)]
        assert drawn == charts, params
        assert [i.value.startswith(why) for i in at.info] == [True] * notes, params
